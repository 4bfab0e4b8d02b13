"""The ``global_ensemble_coarse`` stage: the coarse DNN fit on the ``k`` global CNNs' outputs of ``global_ensemble``.

The same fit as the CNN-DNN's coarse DNN (:func:`ddcnn.stages.coarse.fit_coarse`: ``coarse.input``, ``coarse.net``,
the convex start, selection on validation) and the same seed, on the members' saved outputs ``(n, k, K)`` in place of
the ``N`` local nets' ``(n, N, K)``: what the coarse fit adds to an ensemble that saw whole images. Its parameters are
the members' and the coarse DNN's.
"""

from __future__ import annotations

from ddcnn.context import Context, build_coarse_net, count_parameters
from ddcnn.stages import coarse
from ddcnn.stages.common import skip

__all__ = ["run"]

STAGE = "global_ensemble_coarse"
SOURCE = "global_ensemble"


def run(ctx: Context, device=None) -> dict:
    """Fit the coarse DNN on the finished ensemble's member outputs."""
    if (done := skip(ctx, STAGE)) is not None:
        return done
    if not ctx.run.is_done(SOURCE):
        raise FileNotFoundError(
            f"global_ensemble_coarse fits on the members of global_ensemble, which has not finished in {ctx.run.root}; "
            f"run stage=global_ensemble first (stage=all with methods.enabled.global_ensemble_coarse=true runs it)."
        )
    ensemble = ctx.run.meta(SOURCE)
    k = int(ensemble["k"])
    coarse_params = count_parameters(build_coarse_net(ctx.settings.coarse, k, ctx.data.num_classes))
    extra = {"k": k, "coarse_params": coarse_params, "params": int(ensemble["params"]) + coarse_params}
    return coarse.run(ctx, device, stage=STAGE, source=SOURCE, count=k, extra=extra)
