"""The ``coarse_alt`` stage: the coarse DNN on the other local output than ``coarse.input``.

Probabilities (as in the paper) when the main coarse DNN uses logits (the default), and vice versa, by the same
procedure and seed, into ``coarse_alt/``; "the main" is the input a finished ``coarse/`` records, which a run directory
of an older default (``probs``) keeps. The evaluate stage reports both as ``cnn_dnn_probs`` and ``cnn_dnn_logits``.
"""

from __future__ import annotations

from ddcnn.context import Context
from ddcnn.stages import coarse

__all__ = ["run"]


def run(ctx: Context, device=None) -> dict:
    main = ctx.settings.coarse.input
    if ctx.run.is_done("coarse"):  # the input its coarse DNN was trained on (under an older default: probs)
        main = ctx.run.meta("coarse").get("input", "probs")
    return coarse.run(ctx, device, stage="coarse_alt", kind="logits" if main == "probs" else "probs")
