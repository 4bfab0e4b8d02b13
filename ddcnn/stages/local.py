"""The ``local`` stage: local net ``i`` trained on the sub-images of sub-domain ``i`` only."""

from __future__ import annotations

import logging
import time

from ddcnn.context import Context, build_augment, build_local_net, subdomain_seed
from ddcnn.data.datamodule import PreparedBatches
from ddcnn.engine.train import fit, seed_everything
from ddcnn.stages.common import (
    LocalSnapshots,
    curve_epochs,
    finish_stage,
    skip,
    snapshot_train_rows,
)

log = logging.getLogger(__name__)

__all__ = ["run"]


def run(ctx: Context, device=None, subdomain: int = 0) -> dict:
    """Train local net ``subdomain`` on its sub-images only, then save its class probabilities."""
    if not 0 <= subdomain < ctx.decomposition.num_subdomains:
        raise ValueError(
            f"subdomain={subdomain} does not exist: the {ctx.decomposition.describe()} has sub-domains "
            f"0..{ctx.decomposition.num_subdomains - 1}."
        )
    if (done := skip(ctx, "local", subdomain)) is not None:
        return done
    folder = ctx.run.make_stage_dir("local", subdomain)
    seed = subdomain_seed(ctx.settings.seed, subdomain)
    dec = ctx.decomposition
    # Only the sub-domain's box is read of every sample (with augmentation: the region of the augmented whole image
    # that the box shows), so every local net sees its part of the same augmented image.
    dm = PreparedBatches(
        ctx.data, ctx.settings.data.batch_size, seed=seed, box=dec.box(subdomain), augment=build_augment(ctx.settings)
    )
    start = time.perf_counter()
    seed_everything(seed)
    net = build_local_net(ctx.settings, ctx.data)
    curves = ctx.settings.report.curves
    callbacks = []
    if curves.enabled:  # the local outputs at a few epochs: the CNN-DNN's accuracy-versus-time curve
        epochs, test_epochs = curve_epochs(curves, ctx.settings.loop.max_epochs)
        rows = snapshot_train_rows(len(ctx.data.y["train"]), curves.max_train_rows, ctx.settings.data.split_seed)
        callbacks.append(LocalSnapshots(dm, device, epochs, folder, rows, test_epochs))
    result = fit(ctx.settings, net, dm, folder, start, callbacks, seed=seed, device=device)
    meta = finish_stage(
        ctx,
        "local",
        result.net,
        dm,
        device,
        seed,
        result,
        subdomain,
        position=list(dec.position(subdomain)),
        box=[[s.start, s.stop] for s in dec.box(subdomain)],
        n_train=len(ctx.data.y["train"]),
    )
    log.info("local %d: test acc %.4f in %.1f s", subdomain, meta["accuracy"]["test"], meta["time_s"])
    return meta
