"""The ``global_wide`` stage: the global CNN widened to the CNN-DNN's parameter count.

The CNN-DNN of ``N`` local nets holds ``N`` times the parameters of one (the networks end in global pooling, so a local
net has as many as the global CNN) plus the coarse DNN's: 4 to 16 times the global CNN's in 2D, 8 times at 2x2x2. This
arm asks whether its lead is that of more parameters: the global CNN's network with every width scaled by one factor
(``model.width_mult``, or ``global_model``'s) chosen so that its parameter count matches the CNN-DNN's
(:func:`matched_width`: a bisection on the factor, whose parameter count is non-decreasing in it), trained as the global
CNN is (recipe, epochs, curve) from its own seed. ``meta.json`` records the factor, the target and the count reached
(``param_match``); the count lands within :data:`TOLERANCE` of the target or the stage refuses to train, with the
numbers.

Its network depends on the decomposition only through the width factor (``N`` and the nets' parameter counts): with
``store.reuse`` it is trained once per settings, seed and width and copied into every run of that width (2x2 at
overlap 0 and 2), as the global CNN is (:mod:`ddcnn.stages.reuse`, its key holding the width and the counts matched).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from torch import nn

from ddcnn.context import Context, build_coarse_net, build_global_net, build_local_net, count_parameters
from ddcnn.settings import RunSettings
from ddcnn.stages import reuse
from ddcnn.stages.common import skip
from ddcnn.stages.global_cnn import train_stage

log = logging.getLogger(__name__)

__all__ = ["STAGE", "TOLERANCE", "run", "cnn_dnn_parameters", "matched_width", "wide_settings"]

STAGE = "global_wide"
# How far the widened global CNN's parameter count may lie from the CNN-DNN's (relative): widths are whole channels,
# so the count moves in steps (a few tenths of a percent for vgg_small near 2x); 3% is a few of them.
TOLERANCE = 0.03
# The width factors the search tries: from this to at most _MAX_WIDTH (64x the parameters of the base network).
_MIN_WIDTH, _MAX_WIDTH = 0.05, 8.0
_STEPS = 40


def _network_key(settings: RunSettings) -> str:
    return "global_model" if settings.global_model else "model"


def wide_settings(settings: RunSettings, width_mult: float) -> RunSettings:
    """``settings`` with the global CNN's network (``global_model``, or ``model``) at width factor ``width_mult``.

    Raises:
        ValueError: When that network has no ``width_mult`` setting (a library's backbone), or starts from pretrained
            weights that a widened network does not fit, naming the setting and the fix.
    """
    key = _network_key(settings)
    spec = dict(settings.global_model or settings.model)
    if "width_mult" not in spec:
        raise ValueError(
            f"global_wide widens the global CNN by its width factor, but {key} ({spec.get('_target_')}) has no "
            f"width_mult setting; use one of ddcnn's own networks (conf/model/vgg_*.yaml, resnet*.yaml) as {key}, or "
            f"set methods.enabled.global_wide=false."
        )
    if spec.get("weights") is not None:
        raise ValueError(
            f"global_wide widens the global CNN, which the pretrained weights of {key}.weights={spec['weights']!r} do "
            f"not fit; set methods.enabled.global_wide=false, or {key}.weights=null."
        )
    spec["width_mult"] = float(width_mult)
    return dataclasses.replace(settings, global_model=spec)


def cnn_dnn_parameters(settings: RunSettings, data: Any, num_subdomains: int) -> dict[str, int]:
    """The CNN-DNN's parameter count: its ``N`` local nets' and its coarse DNN's (``data``: anything with
    ``spatial_dims``, ``in_channels`` and ``num_classes``)."""
    local = count_parameters(build_local_net(settings, data, weights=False))
    coarse = count_parameters(build_coarse_net(settings.coarse, num_subdomains, data.num_classes))
    return {
        "local": local,
        "local_total": num_subdomains * local,
        "coarse": coarse,
        "total": num_subdomains * local + coarse,
    }


def matched_width(settings: RunSettings, data: Any, target: int) -> dict:
    """The width factor whose global CNN's parameter count is nearest ``target``, by bisection on the factor.

    Returns:
        ``{"width_mult", "params", "target", "relative_difference", "base_width_mult", "base_params"}``.

    Raises:
        ValueError: When no factor in ``[0.05, 8]`` comes within :data:`TOLERANCE` of ``target``, with the numbers.
    """
    base_width = float((settings.global_model or settings.model).get("width_mult", 1.0))
    tried: dict[float, int] = {}

    def count(width: float) -> int:
        if width not in tried:
            tried[width] = count_parameters(build_global_net(wide_settings(settings, width), data, weights=False))
        return tried[width]

    low, high = _MIN_WIDTH, _MAX_WIDTH
    if count(high) < target or count(low) > target:
        raise ValueError(
            f"global_wide: no width factor in [{low}, {high}] gives the CNN-DNN's {target} parameters (the global CNN "
            f"has {count(low)} to {count(high)} there); set methods.enabled.global_wide=false."
        )
    for _ in range(_STEPS):
        middle = (low + high) / 2
        if count(middle) < target:
            low = middle
        else:
            high = middle
    width = min(tried, key=lambda w: (abs(tried[w] - target), w))
    params = tried[width]
    difference = (params - target) / target
    if abs(difference) > TOLERANCE:
        raise ValueError(
            f"global_wide: the nearest width factor ({width:.4f}) gives {params} parameters, {100 * difference:+.1f}% "
            f"from the CNN-DNN's {target} (more than {100 * TOLERANCE:g}%): the network's widths move its count in "
            f"too large steps; set methods.enabled.global_wide=false."
        )
    return {
        "width_mult": float(width),
        "params": int(params),
        "target": int(target),
        "relative_difference": float(difference),
        "base_width_mult": base_width,
        "base_params": int(count(base_width)),
    }


def run(ctx: Context, device=None) -> dict:
    """Widen the global CNN to the CNN-DNN's parameter count and train it as the global CNN is trained."""
    if (done := skip(ctx, STAGE)) is not None:
        return done
    start = time.perf_counter()
    n = ctx.decomposition.num_subdomains
    target = cnn_dnn_parameters(ctx.settings, ctx.data, n)
    match = matched_width(ctx.settings, ctx.data, target["total"])
    match["cnn_dnn"] = target
    match["search_s"] = time.perf_counter() - start  # building the candidates: set-up, not training
    log.info(
        "global_wide: width factor %.4f gives %d parameters, %+.2f%% from the CNN-DNN's %d",
        match["width_mult"],
        match["params"],
        100 * match["relative_difference"],
        target["total"],
    )
    settings = wide_settings(ctx.settings, match["width_mult"])

    def build() -> nn.Module:
        return build_global_net(settings, ctx.data, weights=False)

    extra = {"param_match": match, "network": _network_key(ctx.settings)}
    # Runs whose widened net is the same (the same width for the same parameter count: 2x2 at overlap 0 and 2) share
    # one training through the store, as they share the global CNN (store.reuse).
    derived = {key: match[key] for key in ("width_mult", "params", "target")}

    def train(more: dict) -> dict:
        return train_stage(ctx, device, STAGE, 1, {**extra, **more}, build=build)

    return reuse.run(ctx, STAGE, device, train, derived=derived)
