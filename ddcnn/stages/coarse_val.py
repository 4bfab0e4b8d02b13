"""The ``coarse_val`` stage: the coarse DNN fit on the validation split's local outputs.

Exactly the coarse stage's procedure and seed, fit on half of the validation split's local outputs (which no local
net trained on) and selected on the other half (stratified halves). It needs no extra training, at the price of
fewer rows than the training split: the cheap way around the in-sample bias.
"""

from __future__ import annotations

from ddcnn.context import Context
from ddcnn.stages import coarse

__all__ = ["run"]


def run(ctx: Context, device=None) -> dict:
    return coarse.run(ctx, device, stage="coarse_val", fit_on="val")
