"""The ``transfer`` stage: the CNN-DNN assembled from the finished local nets and coarse DNN, trained further.

It trains end to end on full images with a learning rate scaled by ``methods.transfer.lr_scale``.
"""

from __future__ import annotations

import time

from ddcnn.context import Context, assemble_cnn_dnn
from ddcnn.models.cnn_dnn import CNNDNN
from ddcnn.stages.common import skip, train_full_images

__all__ = ["run", "init_transfer"]


def init_transfer(ctx: Context) -> CNNDNN:
    """The starting point: the assembled CNN-DNN (raises ``FileNotFoundError`` naming unfinished stages)."""
    return assemble_cnn_dnn(ctx).train()


def run(ctx: Context, device=None) -> dict:
    """The assembled CNN-DNN (finished local nets + coarse DNN) trained further end to end on full images."""
    if (done := skip(ctx, "transfer")) is not None:
        return done
    start = time.perf_counter()
    model = init_transfer(ctx)  # before creating the folder: a missing local net leaves nothing behind
    ctx.run.make_stage_dir("transfer")
    extra = {"coarse_input": ("probs" if model.use_probs else "logits")}
    return train_full_images(ctx, "transfer", model, start, device, extra, measure_start=True)
