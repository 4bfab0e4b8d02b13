"""The ``global_ddp`` stage: the global CNN trained with Lightning DDP on ``methods.global_ddp.num_devices`` devices.

``ddp_spawn``; gloo on CPU, one CPU share of ``cores // P`` threads per process. The report then compares the
CNN-DNN on ``P`` devices with the global CNN on 1 device *and* on ``P`` devices. It starts from the global CNN's
initial weights and keeps its global batch: each of the ``P`` processes takes ``data.batch_size / P`` samples per
step and DDP averages their gradients, so it takes the same optimizer steps as the one-device global CNN. Its time
is the wall time on ``P`` devices, process start-up included.
"""

from __future__ import annotations

from ddcnn.context import Context, ddp_devices
from ddcnn.stages import global_cnn

__all__ = ["run"]


def run(ctx: Context, device=None) -> dict:
    return global_cnn.run(ctx, device, stage="global_ddp", num_devices=ddp_devices(ctx.cfg))
