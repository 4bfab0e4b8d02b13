"""The ``coarse_alt`` stage: the coarse DNN on the other local output than ``coarse.input``.

Logits when the main coarse DNN uses probabilities (the paper's, the default), and vice versa, by the same procedure
and seed, into ``coarse_alt/``; "the main" is the input a finished ``coarse/`` records, which a run directory of an
older default (``logits`` from 2026-12-04 to 2026-12-07) keeps. The evaluate stage reports both as ``cnn_dnn_probs``
and ``cnn_dnn_logits``.
"""

from __future__ import annotations

from ddcnn.context import Context, finished_coarse_input
from ddcnn.stages import coarse

__all__ = ["run"]


def run(ctx: Context, device=None) -> dict:
    main = finished_coarse_input(ctx) if ctx.run.is_done("coarse") else ctx.settings.coarse.input
    return coarse.run(ctx, device, stage="coarse_alt", kind="logits" if main == "probs" else "probs")
