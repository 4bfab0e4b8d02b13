"""The ``coarse_oof`` stage: the coarse DNN fit on out-of-fold local outputs (cross-fitting).

Exactly the coarse stage's procedure and seed, on the training images' outputs from local nets that never saw them
(stage ``local_oof``), selected on the validation split and evaluated on the test split's outputs of the local nets
themselves. Against the ``coarse`` row it measures the in-sample bias of the paper's fit.
"""

from __future__ import annotations

from ddcnn.context import Context
from ddcnn.stages import coarse

__all__ = ["run"]


def run(ctx: Context, device=None) -> dict:
    return coarse.run(ctx, device, stage="coarse_oof", fit_on="out_of_fold")
