"""The ``coarse_alt`` stage: the coarse DNN on the other local output than ``coarse.input``.

Logits when the main coarse DNN uses probabilities (as in the paper), and vice versa, by the same procedure and
seed, into ``coarse_alt/``. The evaluate stage reports both as ``cnn_dnn_probs`` and ``cnn_dnn_logits``.
"""

from __future__ import annotations

from ddcnn.context import Context
from ddcnn.stages import coarse

__all__ = ["run"]


def run(ctx: Context, device=None) -> dict:
    main = ctx.settings.coarse.input
    return coarse.run(ctx, device, stage="coarse_alt", kind="logits" if main == "probs" else "probs")
