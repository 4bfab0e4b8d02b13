"""The ``global_ddp`` stage: the global CNN trained with DDP (ddcnn's loop on Lightning Fabric) on
``methods.global_ddp.num_devices`` devices.

Spawned by this process (gloo on CPU, one CPU share of ``threads // P`` threads per rank), or, under ``srun`` with P
tasks in any form (``-n P``, ``--ntasks=P``, ``--ntasks-per-node=P``), across the tasks of the step. The report then
compares the CNN-DNN on ``P`` devices with the global CNN on 1 device *and* on ``P`` devices. It starts from the
global CNN's initial weights and keeps its global batch: each of the ``P`` ranks takes ``data.batch_size / P``
samples per step and DDP averages their gradients, so it takes the same optimizer steps as the one-device global CNN.
Its time follows the timing rule of every method: spawning the ranks and their rendezvous are start-up
(``startup_s``), left out as every process's start-up is.

Like the global CNN it depends on nothing of the decomposition, so with ``store.reuse`` (the default) it is trained
once per data, model, recipe, seed and ``methods.global_ddp`` settings and copied into every other run of a sweep that
shares them (:mod:`ddcnn.stages.reuse`). When this process spawns the ranks, it alone decides whether to train or copy;
across the tasks of an ``srun`` step every task must join the same training, so there it trains in the run directory.
"""

from __future__ import annotations

from ddcnn.context import Context
from ddcnn.settings.loop import check_srun_ddp
from ddcnn.stages import global_cnn, reuse
from ddcnn.stages.common import skip

__all__ = ["STAGE", "run"]

STAGE = "global_ddp"


def run(ctx: Context, device=None) -> dict:
    if (done := skip(ctx, STAGE)) is not None:
        return done
    num_devices = ctx.settings.methods.global_ddp.num_devices
    if check_srun_ddp(num_devices) is not None:  # every srun task joins one training: no one-process decision
        return global_cnn.train_stage(ctx, device, STAGE, num_devices, {})
    return reuse.run(ctx, STAGE, device, lambda extra: global_cnn.train_stage(ctx, device, STAGE, num_devices, extra))
