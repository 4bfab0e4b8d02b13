"""The ``e2e`` stage: the CNN-DNN (:class:`~ddcnn.models.cnn_dnn.CNNDNN`) trained end to end from scratch.

Its local nets start from the same random weights as the independently trained ones (same per-sub-domain seeds), so
the only difference to the staged CNN-DNN is the joint training on full images.
"""

from __future__ import annotations

import time

from ddcnn.context import Context, build_coarse_net, build_local_net, subdomain_seed
from ddcnn.engine.train import seed_everything
from ddcnn.models.cnn_dnn import CNNDNN
from ddcnn.stages.common import skip, stage_seed, train_full_images

__all__ = ["run"]


def run(ctx: Context, device=None) -> dict:
    """The CNN-DNN trained end to end from random weights on full images."""
    if (done := skip(ctx, "e2e")) is not None:
        return done
    ctx.run.make_stage_dir("e2e")
    start = time.perf_counter()
    n = ctx.decomposition.num_subdomains
    nets = []
    for i in range(n):
        seed_everything(subdomain_seed(ctx.settings.seed, i))
        nets.append(build_local_net(ctx.settings, ctx.data))
    seed_everything(stage_seed(ctx, "coarse"))
    coarse = build_coarse_net(ctx.settings.coarse, n, ctx.data.num_classes)
    model = CNNDNN(ctx.decomposition, nets, coarse, ctx.settings.coarse.input)
    return train_full_images(
        ctx, "e2e", model, start, device, {"coarse_input": ("probs" if model.use_probs else "logits")}
    )
