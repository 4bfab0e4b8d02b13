"""The ``global_ddp`` stage: the global CNN trained with DDP (ddcnn's loop on Lightning Fabric) on
``methods.global_ddp.num_devices`` devices.

Spawned by this process (gloo on CPU, one CPU share of ``threads // P`` threads per rank), or, under ``srun`` with P
tasks in any form (``-n P``, ``--ntasks=P``, ``--ntasks-per-node=P``), across the tasks of the step. The report then
compares the CNN-DNN on ``P`` devices with the global CNN on 1 device *and* on ``P`` devices. It starts from the
global CNN's initial weights and keeps its global batch: each of the ``P`` ranks takes ``data.batch_size / P``
samples per step and DDP averages their gradients, so it takes the same optimizer steps as the one-device global CNN.
Its time follows the timing rule of every method: spawning the ranks and their rendezvous are start-up
(``startup_s``), left out as every process's start-up is.
"""

from __future__ import annotations

from ddcnn.context import Context, ddp_devices
from ddcnn.stages import global_cnn

__all__ = ["run"]


def run(ctx: Context, device=None) -> dict:
    return global_cnn.run(ctx, device, stage="global_ddp", num_devices=ddp_devices(ctx.cfg))
