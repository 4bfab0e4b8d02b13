"""The ``global`` stage: the baseline, the same network family trained on full images (on one or several devices)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from torch import nn

from ddcnn import registry
from ddcnn.context import Context, build_global_net
from ddcnn.engine.train import fit, seed_everything
from ddcnn.settings.loop import check_srun_ddp
from ddcnn.stages import reuse
from ddcnn.stages.common import (
    curve_callbacks,
    finish_stage,
    full_image_data,
    lr_advice_names,
    scaled_optimizer,
    skip,
    stage_seed,
)

log = logging.getLogger(__name__)

__all__ = ["run"]


def run(ctx: Context, device=None, stage: str = "global", num_devices: int = 1) -> dict:
    """Train the global CNN into folder ``stage``.

    With ``num_devices > 1`` (the ``global_ddp`` stage) it trains with DDP on that many devices, from the same
    initial weights and with the same global batch: each device takes ``data.batch_size / num_devices`` samples per
    step. Inside a multi-task ``srun`` step the ranks are its tasks (any srun form), else this process spawns them.
    Predictions are then made in this process (rank 0) on one device.

    The one-device global CNN is trained once per settings and reused by the runs of a sweep that share them
    (``store.reuse``, :mod:`ddcnn.stages.reuse`).
    """
    if (done := skip(ctx, stage)) is not None:
        return done
    if registry.get(stage).reusable and num_devices == 1:
        return reuse.run(ctx, stage, device, lambda extra: train_stage(ctx, device, stage, num_devices, extra))
    return train_stage(ctx, device, stage, num_devices, {})


def train_stage(
    ctx: Context,
    device,
    stage: str,
    num_devices: int,
    extra: dict,
    member: int | None = None,
    seed: int | None = None,
    build: Callable[[], nn.Module] | None = None,
) -> dict:
    """Train the global CNN into folder ``stage`` of the run directory (no store), ``extra`` added to its meta.json.

    ``member``: into the member's folder ``RUN_DIR/<stage>/<member>/`` (an ensemble of global CNNs); ``seed``: in place
    of the stage's seed (its data order and initial weights); ``build``: the network, built after seeding, in place of
    :func:`~ddcnn.context.build_global_net` (the widened global CNN).
    """
    launcher = None
    if num_devices > 1:
        # One task per device: DDP across the tasks of this srun step (refused with the fix when they do not match).
        launcher = "srun" if check_srun_ddp(num_devices) is not None else "spawn"
    folder = ctx.run.make_stage_dir(stage, member)
    seed = stage_seed(ctx, stage) if seed is None else int(seed)
    batch = ctx.settings.data.batch_size
    dm = full_image_data(ctx, seed, batch // num_devices)
    start = time.perf_counter()
    seed_everything(seed)
    net = build_global_net(ctx.settings, ctx.data) if build is None else build()
    callbacks = curve_callbacks(ctx, dm, device, ctx.settings.loop.max_epochs) if num_devices == 1 else []
    devices = num_devices if num_devices > 1 else None
    # engine.activation_checkpointing=global: the global CNN's trainings recompute activations, no other training does
    checkpointing = "all" if ctx.settings.loop.activation_checkpointing == "global" else None
    # global_lr_scale: the global baseline's own learning rate (its tuning budget, docs/protocol.md 5b)
    scale = ctx.settings.global_lr_scale
    optimizer = scaled_optimizer(ctx, scale) if scale != 1.0 else None
    result = fit(
        ctx.settings,
        net,
        dm,
        folder,
        start,
        callbacks,
        seed=seed,
        device=device,
        num_devices=devices,
        launcher=launcher,
        activation_checkpointing=checkpointing,
        optimizer=optimizer,
    )
    if result.global_rank != 0:  # a peer of rank 0 in DDP across srun tasks: rank 0 alone writes the artifacts
        return {"stage": stage, "global_rank": result.global_rank}
    if num_devices > 1:
        dm = full_image_data(ctx, seed, batch)
    ddp = (
        {"batch_per_device": batch // num_devices, "world_size": result.world_size, "ddp_launcher": launcher}
        if num_devices > 1
        else {}
    )
    names = lr_advice_names(ctx, "global_lr_scale", scale)
    extra = {**extra, "advice_names": names} if names else extra
    meta = finish_stage(
        ctx, stage, result.net, dm, device, seed, result, subdomain=member, num_devices=num_devices, **ddp, **extra
    )
    log.info(
        "%s: test acc %.4f in %.1f s on %d device(s)",
        stage if member is None else f"{stage} {member}",
        meta["accuracy"]["test"],
        meta["time_s"],
        num_devices,
    )
    return meta
