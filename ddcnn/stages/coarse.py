"""The ``coarse`` stage: the coarse DNN trained on the saved local outputs (train split), selected on val.

The one training loop trains it (:func:`ddcnn.engine.train.fit`, with the run's precision, clipping and batch limits;
``coarse.batch_size`` rows per step, ``coarse.num_threads`` CPU threads); it resumes from ``last.ckpt`` like every
stage, and its ``meta.json`` times include the training time of processes that were interrupted.
"""

from __future__ import annotations

import logging
import time

import torch

from ddcnn.context import Context, build_coarse_net
from ddcnn.data.datamodule import TensorDataModule
from ddcnn.engine.loop import EVAL_CHUNK, torch_threads
from ddcnn.engine.train import fit
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
    coarse = ctx.cfg.coarse
    torch.manual_seed(seed)
    net = build_coarse_net(ctx.cfg, n, ctx.data.num_classes)
    # coarse.batch_size rows per step (null or 0: the whole training split), one plain-tensor Batches source.
    batch = int(coarse.get("batch_size") or 0) or len(y["train"])
    dm = TensorDataModule(x, y, batch_size=batch, eval_batch_size=EVAL_CHUNK, seed=seed)
    threads = coarse.get("num_threads")
    with torch_threads(threads):
        start = time.perf_counter()
        result = fit(
            ctx.cfg,
            net,
            dm,
            folder,
            device,
            seed,
            start,
            max_epochs=int(coarse.max_epochs),
            optimizer_cfg=coarse.optimizer,
            num_devices=1,
            checkpoint_every=int(coarse.get("checkpoint_every") or coarse.max_epochs),
        )
        by_design = "coarse.num_threads" if threads is not None else None
        meta = finish_stage(ctx, stage, result.net, dm, device, seed, result, threads_by_design=by_design, input=kind)
    log.info("%s (on %s): test acc %.4f in %.1f s", stage, kind, meta["accuracy"]["test"], meta["time_s"])
    return meta
