"""The ``coarse`` stage: the coarse DNN trained on the saved local outputs (train split), selected on val."""

from __future__ import annotations

import logging
import time

import lightning as L
import torch

from ddcnn.context import Context, build_coarse_net
from ddcnn.data.datamodule import TensorDataModule
from ddcnn.engine.fit import fit
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
    dm = TensorDataModule(x, y, int(ctx.cfg.coarse.batch_size), seed=seed)
    start = time.perf_counter()
    L.seed_everything(seed, workers=True, verbose=False)
    net = build_coarse_net(ctx.cfg, n, ctx.data.num_classes)
    result = fit(
        ctx.cfg, net, dm, folder, device, seed, start, int(ctx.cfg.coarse.max_epochs), ctx.cfg.coarse.optimizer
    )
    meta = finish_stage(ctx, stage, result.net, dm, device, seed, start, result, input=kind)
    log.info("%s (on %s): test acc %.4f in %.1f s", stage, kind, meta["accuracy"]["test"], meta["time_s"])
    return meta
