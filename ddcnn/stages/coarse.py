"""The ``coarse`` stage: the coarse DNN trained on the saved local outputs (train split), selected on val.

A plain PyTorch loop trains it (:func:`ddcnn.engine.tensor_fit.fit_tensors`, ``coarse.batch_size`` rows per step,
``coarse.num_threads`` CPU threads); it resumes from ``last.ckpt`` like the Lightning stages, and its ``meta.json``
times include the training time of processes that were interrupted.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ddcnn.context import Context, build_coarse_net
from ddcnn.data.datamodule import TensorDataModule
from ddcnn.engine.tensor_fit import EVAL_CHUNK, fit_tensors, torch_threads
from ddcnn.engine.train import EpochReporter, FitResult, engine_settings
from ddcnn.rundir import SPLITS
from ddcnn.stages.common import finish_stage, skip, stage_seed

log = logging.getLogger(__name__)

__all__ = ["run", "coarse_inputs"]


def coarse_inputs(ctx: Context, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The coarse DNN's data: local outputs ``(n, N, K)`` of every split and their labels, checked against the data."""
    n = ctx.decomposition.num_subdomains
    x, y = {}, {}
    for split in SPLITS:
        x[split], y[split] = ctx.run.local_outputs(n, split, kind)
        if not torch.equal(y[split], ctx.data.y[split]):
            raise ValueError(
                f"saved local {split} predictions do not belong to the current data (labels differ); rerun the local "
                f"stage with force=true."
            )
    return x, y


def run(ctx: Context, device=None, stage: str = "coarse", kind: str | None = None) -> dict:
    """Train the coarse DNN on the saved local probabilities (or logits: ``kind``, default ``coarse.input``).

    ``stage`` and ``kind`` let a second coarse DNN train on the other input into its own stage folder
    (``coarse_alt``) by exactly the same procedure and seed.
    """
    if (done := skip(ctx, stage)) is not None:
        return done
    folder = ctx.run.make_stage_dir(stage)
    n = ctx.decomposition.num_subdomains
    kind = str(kind or ctx.cfg.coarse.get("input", "probs"))
    x, y = coarse_inputs(ctx, kind)
    seed = stage_seed(ctx, stage)
    coarse, settings = ctx.cfg.coarse, engine_settings(ctx.cfg)
    torch.manual_seed(seed)
    net = build_coarse_net(ctx.cfg, n, ctx.data.num_classes)
    # A plain PyTorch loop on the in-memory tensors: through Lightning, the thousands of small steps of an MLP cost
    # more than a local net (ddcnn.engine.tensor_fit).
    epochs = int(coarse.max_epochs)
    reporter = EpochReporter(ctx.cfg, folder, epochs)
    with torch_threads(coarse.get("num_threads")), contextlib.ExitStack() as stack:
        stack.callback(reporter.close)
        fitted = fit_tensors(
            net,
            x,
            y,
            folder,
            optimizer=coarse.optimizer,
            scheduler=ctx.cfg.get("scheduler"),
            max_epochs=epochs,
            batch_size=coarse.get("batch_size"),
            seed=seed,
            monitor=settings["monitor"],
            monitor_mode=settings["monitor_mode"],
            checkpoint_every=int(coarse.get("checkpoint_every") or coarse.max_epochs),
            device=device,
            on_epoch_end=reporter,
        )
        dm = TensorDataModule(x, y, eval_batch_size=EVAL_CHUNK, seed=seed)  # predictions only
        result = FitResult(
            fitted.net, fitted.fit_time_s, fitted.previous_time_s, fitted.resumed_from_epoch, fitted.best_epoch
        )
        meta = finish_stage(ctx, stage, fitted.net, dm, device, seed, result, input=kind)
    log.info("%s (on %s): test acc %.4f in %.1f s", stage, kind, meta["accuracy"]["test"], meta["time_s"])
    return meta
