"""The ``global`` stage: the baseline, the same network family trained on full images (on one or several devices)."""

from __future__ import annotations

import copy
import logging
import time

from omegaconf import open_dict

from ddcnn.context import Context, build_global_net
from ddcnn.engine.train import fit, seed_everything
from ddcnn.runtime import srun_task
from ddcnn.stages.common import batch_size, curve_hook, finish_stage, full_image_data, skip, stage_seed

log = logging.getLogger(__name__)

__all__ = ["run"]


def run(ctx: Context, device=None, stage: str = "global", num_devices: int = 1) -> dict:
    """Train the global CNN into folder ``stage``.

    With ``num_devices > 1`` (the ``global_ddp`` stage) it trains with DDP on that many devices, from the same
    initial weights and with the same global batch: each device takes ``data.batch_size / num_devices`` samples per
    step. Predictions are then made in this process on one device.
    """
    if (done := skip(ctx, stage)) is not None:
        return done
    cfg = ctx.cfg
    launcher = "spawn"
    if num_devices > 1:
        task = srun_task("auto")
        if task is not None:  # one task per device: DDP across the tasks of this srun step
            if task.ntasks != num_devices:
                raise ValueError(
                    f"{stage} trains on {num_devices} devices, but this srun step has {task.ntasks} tasks; DDP in an "
                    f"allocation uses one task per device: run srun -n {num_devices}, or set "
                    f"methods.global_ddp.num_devices={task.ntasks}."
                )
            launcher = "slurm"
        cfg = copy.deepcopy(ctx.cfg)  # a shallow copy would share (and change) the engine node
        with open_dict(cfg):
            cfg.engine.num_devices = num_devices
            cfg.engine.ddp_launcher = launcher
    folder = ctx.run.make_stage_dir(stage)
    seed = stage_seed(ctx, stage)
    batch = batch_size(ctx.cfg)
    dm = full_image_data(ctx, seed, batch // num_devices)
    start = time.perf_counter()
    seed_everything(seed)
    net = build_global_net(ctx.cfg, ctx.data)
    hook = curve_hook(ctx, dm, device, int(cfg.trainer.max_epochs)) if num_devices == 1 else None
    result = fit(cfg, net, dm, folder, device, seed, start, after_epoch=hook)
    if result.global_rank != 0:  # a peer of rank 0 in DDP across srun tasks: rank 0 alone writes the artifacts
        return {"stage": stage, "global_rank": result.global_rank}
    if num_devices > 1:
        dm = full_image_data(ctx, seed, batch)
    ddp = (
        {"batch_per_device": batch // num_devices, "world_size": result.world_size, "ddp_launcher": launcher}
        if num_devices > 1
        else {}
    )
    meta = finish_stage(ctx, stage, result.net, dm, device, seed, result, num_devices=num_devices, **ddp)
    log.info(
        "%s: test acc %.4f in %.1f s on %d device(s)", stage, meta["accuracy"]["test"], meta["time_s"], num_devices
    )
    return meta
