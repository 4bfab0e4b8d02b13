"""Paired statistics of the comparison protocol (``docs/protocol.md``): the difference of two methods paired by seed,
its 95% t-interval and the verdict that follows the interval.

Two methods of one configuration (dataset, backbone, grid, overlap, settings) trained with the same seed share their
data split, their local nets or their initial draw; their difference per seed cancels what the seed changes for both.
Over ``n`` seeds with differences ``d_1 .. d_n`` (mean ``m``, sample standard deviation ``s``) the 95% interval is
``m ± t(0.975, n-1) s / sqrt(n)`` (Student's t; the quantile from :func:`t_quantile_975`, SciPy's). The verdict:

- ``better`` / ``worse``: the interval lies above / below 0 (0 itself on the bound is ``within noise``);
- ``within noise``: the interval holds 0;
- ``n<2: no interval``: one seed says nothing about noise;
- ``no spread: no interval``: every seed gave the same difference (``s = 0``, common with few seeds, since an
  accuracy difference moves in steps of one test sample): the interval would have no width, and a zero spread
  estimated from a few seeds is not the absence of noise;
- ``baseline not converged``: the baseline of any seed did not converge; no verdict holds against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "PAIRS",
    "BETTER",
    "WORSE",
    "WITHIN_NOISE",
    "NO_INTERVAL",
    "NO_SPREAD",
    "NO_VERDICT",
    "BASELINE_NOT_CONVERGED",
    "t_quantile_975",
    "paired_difference",
    "verdict",
    "all_converged",
]

# The paired differences of the protocol: (label, method, baseline, the training whose convergence the baseline's is:
# the global CNN, or the local nets for the averaging combiner). Keys of results.json ``accuracy``.
PAIRS = (
    ("CNN-DNN − global CNN", "cnn_dnn", "global", "global"),
    ("CNN-DNN − mean probability", "cnn_dnn", "mean_prob", "local"),
    ("global DDP − global CNN", "global_ddp", "global", "global"),
    # decomposition or ensembling (docs/protocol.md): the ensemble of k global CNNs at equal one-device training time,
    # combined as the local nets are, and the global CNN of the CNN-DNN's parameter count
    ("CNN-DNN − ensemble of global CNNs (mean probability)", "cnn_dnn", "global_ensemble", "global_ensemble"),
    ("CNN-DNN − ensemble of global CNNs (coarse DNN)", "cnn_dnn", "global_ensemble_coarse", "global_ensemble"),
    ("CNN-DNN − global CNN of its parameter count", "cnn_dnn", "global_wide", "global_wide"),
    # where a run trained both coarse inputs (``coarse_alt``): the question of ``coarse.input``'s default
    ("coarse DNN on logits − on probabilities", "cnn_dnn_logits", "cnn_dnn_probs", "local"),
)

BETTER, WORSE, WITHIN_NOISE = "better", "worse", "within noise"
NO_INTERVAL = "n<2: no interval"
NO_SPREAD = "no spread: no interval"
NO_VERDICT = (NO_INTERVAL, NO_SPREAD)
# A sample std at or below this is 0: differences of accuracies (k / n each) that are equal but for float rounding.
SPREAD_TOLERANCE = 1e-9  # the verdicts that say no interval could be computed
BASELINE_NOT_CONVERGED = "baseline not converged"


def t_quantile_975(df: int) -> float:
    """Student's t quantile at 0.975 (a two-sided 95% interval) for ``df`` >= 1 degrees of freedom (SciPy's)."""
    if df < 1:
        raise ValueError(f"a t quantile needs at least 1 degree of freedom, got {df}.")
    # Imported here: scipy.stats takes about 0.7 s to import, paid only by the pages that draw an interval.
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def all_converged(states: Sequence[bool | None]) -> bool | None:
    """The convergence of a baseline over seeds: ``False`` if any seed's did not converge, else ``None`` if any seed's
    is not recorded, else ``True`` (the ``baseline_converged`` that :func:`verdict` takes)."""
    return False if False in states else (None if None in states else True)


def verdict(low: float | None, high: float | None, n: int, baseline_converged: bool | None = True) -> str:
    """The verdict of a difference (method minus baseline) from its interval ``[low, high]`` over ``n`` seeds (module
    doc). ``baseline_converged``: ``False`` when the baseline of any seed did not converge; ``None`` (not recorded)
    gives the verdict of the interval, which the reader is told rests on a baseline of unknown convergence."""
    if baseline_converged is False:
        return BASELINE_NOT_CONVERGED
    if n < 2 or low is None or high is None:
        return NO_INTERVAL
    if low > 0:
        return BETTER
    if high < 0:
        return WORSE
    return WITHIN_NOISE


def paired_difference(
    differences: Sequence[float], baseline_converged: bool | None = True, seeds: Sequence[int] | None = None
) -> dict:
    """Mean, sample standard deviation, ``n``, 95% t-interval and verdict of paired ``differences`` (one per seed).

    Returns:
        ``{"n", "mean", "std", "low", "high", "half_width", "verdict", "baseline_converged", "seeds"}``; ``std`` and the
        interval are ``None`` for fewer than 2 differences, the interval also when they are all equal.
    """
    values = [float(d) for d in differences]
    n = len(values)
    mean = sum(values) / n if n else None
    std = low = high = half = None
    if n >= 2:
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        if std <= SPREAD_TOLERANCE:  # equal differences, up to floating-point rounding
            std = 0.0
        else:
            half = t_quantile_975(n - 1) * std / math.sqrt(n)
            low, high = mean - half, mean + half
    return {
        "n": n,
        "mean": mean,
        "std": std,
        "low": low,
        "high": high,
        "half_width": half,
        "verdict": NO_SPREAD
        if std == 0 and baseline_converged is not False
        else verdict(low, high, n, baseline_converged),
        "baseline_converged": baseline_converged,
        "seeds": list(seeds) if seeds is not None else None,
    }
