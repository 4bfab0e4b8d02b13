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

One run has one seed, but its test images are a sample too: two methods scored on the same test images differ on
the images one classifies right and the other wrong. :func:`image_paired_difference` gives such a difference its
interval over test images: McNemar's exact test (:func:`mcnemar_exact`: a binomial test of the discordant images,
``scipy.stats.binomtest``) and a paired percentile bootstrap over the images (:func:`paired_bootstrap`), with a
verdict that needs a margin stated in advance to call two methods equivalent (:func:`margin_verdict`: ``better`` /
``worse`` when the interval excludes 0, ``equivalent`` only inside ±``margin``, ``not distinguishable`` otherwise).
:func:`holm` adjusts a family of p-values for multiplicity (Holm's step-down procedure).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

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
    "two_level_bootstrap",
    "two_level_bootstrap_metric",
    "holm_verdict",
    "verdict",
    "all_converged",
    "EQUIVALENT",
    "NOT_DISTINGUISHABLE",
    "EQUIVALENCE_MARGIN_POINTS",
    "BOOTSTRAP_RESAMPLES",
    "mcnemar_exact",
    "paired_bootstrap",
    "holm",
    "margin_verdict",
    "image_paired_difference",
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
EQUIVALENT, NOT_DISTINGUISHABLE = "equivalent", "not distinguishable"
# The equivalence margin of an accuracy difference, in points, fixed before the runs (docs/protocol.md, section 5):
# half a point, 50 of the 10,000 official test images of MNIST or Fashion-MNIST.
EQUIVALENCE_MARGIN_POINTS = 0.5
# Resamples of the paired bootstrap: the Monte Carlo error of a 2.5% percentile from 10,000 resamples is about
# sqrt(0.025 * 0.975 / 10000) = 0.16% in probability, far below the interval's own width.
BOOTSTRAP_RESAMPLES = 10_000


def t_quantile_975(df: int) -> float:
    """Student's t quantile at 0.975 (a two-sided 95% interval) for ``df`` >= 1 degrees of freedom (SciPy's)."""
    if df < 1:
        raise ValueError(f"a t quantile needs at least 1 degree of freedom, got {df}.")
    # Imported here: scipy.stats takes about 0.7 s to import, paid only by the pages that draw an interval.
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def _t_test_p(statistic: float, df: int) -> float:
    """The two-sided p of a t ``statistic`` with ``df`` degrees of freedom (SciPy's Student t)."""
    from scipy.stats import t

    return float(min(1.0, 2 * t.sf(abs(statistic), df)))


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
    """Mean, sample standard deviation, ``n``, 95% t-interval, the paired t-test's two-sided p and the verdict of
    paired ``differences`` (one per seed).

    Returns:
        ``{"n", "mean", "std", "low", "high", "half_width", "p", "verdict", "baseline_converged", "seeds"}``; ``std``,
        the interval and ``p`` are ``None`` for fewer than 2 differences, the interval and ``p`` also when they are all
        equal (``p`` is the t-interval's: at most 0.05 exactly when the interval excludes 0).
    """
    values = [float(d) for d in differences]
    n = len(values)
    mean = sum(values) / n if n else None
    std = low = high = half = p = None
    if n >= 2:
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        if std <= SPREAD_TOLERANCE:  # equal differences, up to floating-point rounding
            std = 0.0
        else:
            half = t_quantile_975(n - 1) * std / math.sqrt(n)
            low, high = mean - half, mean + half
            p = _t_test_p(mean / (std / math.sqrt(n)), n - 1)
    return {
        "n": n,
        "mean": mean,
        "std": std,
        "low": low,
        "high": high,
        "half_width": half,
        "p": p,
        "verdict": NO_SPREAD
        if std == 0 and baseline_converged is not False
        else verdict(low, high, n, baseline_converged),
        "baseline_converged": baseline_converged,
        "seeds": list(seeds) if seeds is not None else None,
    }


def _as_bool(correct: Sequence[bool] | np.ndarray) -> np.ndarray:
    return np.asarray(correct, dtype=bool).reshape(-1)


def mcnemar_exact(correct_a: Sequence[bool] | np.ndarray, correct_b: Sequence[bool] | np.ndarray) -> dict:
    """McNemar's exact test of two classifiers scored on the same images: under the null hypothesis that both are
    equally accurate, each discordant image (one right, the other wrong) is equally likely to favour either, so the
    count ``b`` of images only ``a`` gets right is binomial(``b + c``, 1/2). The two-sided p-value is SciPy's
    ``binomtest`` (the probabilities no larger than the observed one, summed); 1 when no image is discordant.

    Args:
        correct_a, correct_b: Per image, whether each classifier predicted its label (same images, same order).

    Returns:
        ``{"b", "c", "n", "p"}``: ``b`` images only ``a`` got right, ``c`` only ``b``, ``n`` images, the p-value.
    """
    a, b_ = _as_bool(correct_a), _as_bool(correct_b)
    if a.shape != b_.shape:
        raise ValueError(f"McNemar's test pairs images: {a.size} against {b_.size} predictions.")
    b, c = int(np.sum(a & ~b_)), int(np.sum(~a & b_))
    if b + c == 0:
        p = 1.0
    else:
        from scipy.stats import binomtest  # imported here, as the t quantile: scipy.stats is slow to import

        p = float(binomtest(b, b + c, 0.5).pvalue)
    return {"b": b, "c": c, "n": int(a.size), "p": min(1.0, p)}


def paired_bootstrap(
    correct_a: Sequence[bool] | np.ndarray,
    correct_b: Sequence[bool] | np.ndarray,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """The paired percentile bootstrap interval of an accuracy difference ``acc(a) - acc(b)`` over test images (as a
    fraction; seeded, so the same predictions give the same interval).

    Each resample draws ``n`` images with replacement and keeps both classifiers' outcomes on each (the pairing).
    The per-image difference takes three values (+1: only ``a`` right, -1: only ``b``, 0: both or neither), so a
    resample's mean depends only on how many of each it drew: a multinomial draw of ``n`` over their observed shares
    is the same distribution as drawing the image indices, at a cost independent of ``n``.

    Args:
        correct_a, correct_b: Per image, whether each classifier predicted its label.
        resamples: Bootstrap resamples.
        seed: Seeds NumPy's generator.
        level: Coverage of the two-sided interval.

    Returns:
        ``(low, high)``: the ``(1 - level) / 2`` and ``(1 + level) / 2`` percentiles of the resampled differences.
    """
    a, b_ = _as_bool(correct_a), _as_bool(correct_b)
    n = a.size
    if n == 0 or a.shape != b_.shape:
        raise ValueError(f"a paired bootstrap needs the same images for both: {a.size} against {b_.size}.")
    shares = np.array([np.sum(a & ~b_), np.sum(~a & b_), 0], dtype=float) / n
    shares[2] = max(0.0, 1.0 - shares[0] - shares[1])
    counts = np.random.default_rng(seed).multinomial(n, shares / shares.sum(), size=int(resamples))
    means = (counts[:, 0] - counts[:, 1]) / n
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def two_level_bootstrap(
    differences: np.ndarray,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
    level: float = 0.95,
    chunk: int = 250,
) -> dict:
    """The paired difference of two methods over seeds and test images together (``docs/protocol.md`` section 5a):
    each resample draws the seeds with replacement and, once, the test images with replacement (the same image draw
    for every seed: every seed is scored on the same images, so their sampling error is shared); its statistic is the
    mean over the drawn seeds of each seed's mean difference on the drawn images.

    Args:
        differences: ``(seeds, images)``: per seed and test image, method minus baseline (for an accuracy: +1, 0 or
            -1; averaged over a dataset's configurations first where the comparison pools them).
        resamples, seed, level: Bootstrap resamples, the seed of NumPy's generator, the interval's coverage.
        chunk: Resamples drawn at once (their image counts are ``chunk x images`` integers).

    Returns:
        ``{"difference", "per_seed", "low", "high", "p", "seeds", "images", "resamples", "seed"}``: the observed mean
        difference and each seed's, the percentile interval, the two-sided p (twice the smaller share of resamples at
        or beyond 0 on either side, at least ``1 / resamples``), all as fractions (``x 100`` for points).

    Raises:
        ValueError: Without a seed or an image.
    """
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] < 1 or d.shape[1] < 1:
        raise ValueError(f"a two-level bootstrap needs (seeds, images) differences, got shape {d.shape}.")
    n_images = d.shape[1]

    def per_seed(counts: np.ndarray) -> np.ndarray:
        return (counts @ d.T) / n_images

    return _two_level(per_seed, *d.shape, resamples, seed, level, chunk, observed=d.mean())


def two_level_bootstrap_metric(
    metric: str,
    labels: np.ndarray,
    method: np.ndarray,
    baseline: np.ndarray,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
    level: float = 0.95,
    chunk: int = 250,
) -> dict:
    """:func:`two_level_bootstrap` of a metric that is no mean over images: the balanced accuracy (the mean of the
    per-class recalls) or the ROC AUC of two classes, recomputed on each resample's image draw (an image drawn ``c``
    times counts ``c`` times) for each seed and configuration; a seed's difference is the mean over the
    configurations of method minus baseline. The same draws as :func:`two_level_bootstrap` with the same ``seed``.

    Args:
        metric: ``balanced_accuracy`` or ``auc``.
        labels: ``(images,)``: the test labels (for ``auc``: 0 and 1).
        method, baseline: ``(seeds, configurations, images)``: the predicted class (``balanced_accuracy``) or the
            probability of class 1 (``auc``; ties count one half).
        resamples, seed, level, chunk: As :func:`two_level_bootstrap`.

    Returns:
        As :func:`two_level_bootstrap`, differences as fractions (``x 100`` for points). A resample that draws no
        image of a class leaves that class out of its balanced accuracy (and out of its AUC: the AUC is then 0.5 for
        both, a difference of 0).

    Raises:
        ValueError: For another metric, mismatched shapes, or an AUC of other than two classes.
    """
    y = np.asarray(labels).astype(np.int64)
    a, b = np.asarray(method), np.asarray(baseline)
    if a.shape != b.shape or a.ndim != 3 or a.shape[2] != len(y) or min(a.shape) < 1:
        raise ValueError(
            f"a two-level bootstrap of {metric} needs method and baseline of shape (seeds, configurations, images) "
            f"with images = {len(y)} labels, got {a.shape} and {b.shape}."
        )
    n_seeds, n_configs, _ = a.shape
    if metric == "balanced_accuracy":
        # per class: the difference of the correct indicators (method minus baseline) of its images
        d = ((a == y).astype(np.float64) - (b == y)).reshape(n_seeds * n_configs, -1)
        masks = [y == c for c in np.unique(y)]

        def per_seed(counts: np.ndarray) -> np.ndarray:
            total, present = 0.0, 0
            for mask in masks:
                drawn = counts[:, mask].sum(axis=1, keepdims=True)
                recall = np.zeros((len(counts), len(d)))
                total = total + np.divide(counts[:, mask] @ d[:, mask].T, drawn, where=drawn > 0, out=recall)
                present = present + (drawn > 0)
            return (total / np.maximum(present, 1)).reshape(-1, n_seeds, n_configs).mean(axis=2)

    elif metric == "auc":
        if not set(np.unique(y)) <= {0, 1}:
            raise ValueError(f"the bootstrap's AUC is of two classes (labels 0 and 1), got labels {np.unique(y)}.")
        pos, neg = y == 1, y == 0
        sa, sb = (x.reshape(n_seeds * n_configs, -1).astype(np.float64) for x in (a, b))

        def per_seed(counts: np.ndarray) -> np.ndarray:
            diff = _weighted_auc(sa, counts, pos, neg) - _weighted_auc(sb, counts, pos, neg)
            return diff.reshape(-1, n_seeds, n_configs).mean(axis=2)

    else:
        raise ValueError(f"metric must be balanced_accuracy or auc, got {metric!r}.")
    return _two_level(per_seed, n_seeds, len(y), resamples, seed, level, chunk)


def _weighted_auc(scores: np.ndarray, counts: np.ndarray, pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """The ROC AUC of each row of ``scores`` ``(m, images)`` with image ``i`` counted ``counts[:, i]`` times
    ``(r, images)``: per resample, the weighted share of (positive, negative) pairs the positive scores above, ties
    one half (0.5 where a resample drew no image of a class). Returns ``(r, m)``."""
    cp, cn = counts[:, pos].astype(np.float64), counts[:, neg].astype(np.float64)
    norm = cp.sum(axis=1) * cn.sum(axis=1)
    out = np.full((len(counts), len(scores)), 0.5)
    for k, row in enumerate(scores):
        order = np.argsort(row[neg], kind="stable")
        sorted_neg = row[neg][order]
        cum = np.concatenate([np.zeros((len(counts), 1)), np.cumsum(cn[:, order], axis=1)], axis=1)
        below = cum[:, np.searchsorted(sorted_neg, row[pos], side="left")]  # negatives scored lower: (r, positives)
        upto = cum[:, np.searchsorted(sorted_neg, row[pos], side="right")]  # ... lower or equal
        wins = (cp * (below + 0.5 * (upto - below))).sum(axis=1)
        np.divide(wins, norm, where=norm > 0, out=out[:, k])
    return out


def _two_level(
    per_seed, n_seeds: int, n_images: int, resamples: int, seed: int, level: float, chunk: int, observed=None
) -> dict:
    """The two-level bootstrap's draws and summary; ``per_seed(counts)``: for image counts ``(r, images)`` each seed's
    difference ``(r, seeds)``; ``observed``: the difference at counts of 1 where the caller has it exactly."""
    rng = np.random.default_rng(seed)
    stats = np.empty(int(resamples))
    for start in range(0, int(resamples), chunk):
        r = min(chunk, int(resamples) - start)
        images = rng.multinomial(n_images, np.full(n_images, 1.0 / n_images), size=r)  # (r, images): counts
        seeds = rng.multinomial(n_seeds, np.full(n_seeds, 1.0 / n_seeds), size=r)  # (r, seeds)
        stats[start : start + r] = (seeds * per_seed(images)).sum(axis=1) / n_seeds
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(stats, [tail, 100 - tail])
    p = min(1.0, 2 * min(float(np.mean(stats <= 0)), float(np.mean(stats >= 0))))
    seeds_observed = per_seed(np.ones((1, n_images)))[0]  # each seed's difference on every image once
    return {
        "difference": float(seeds_observed.mean()) if observed is None else float(observed),
        "per_seed": [float(v) for v in seeds_observed],
        "low": float(low),
        "high": float(high),
        "p": max(p, 1.0 / int(resamples)),
        "seeds": n_seeds,
        "images": n_images,
        "resamples": int(resamples),
        "seed": int(seed),
    }


def holm_verdict(low: float | None, high: float | None, p_adjusted: float | None, margin: float, alpha: float = 0.05):
    """A Holm-adjusted verdict (``docs/protocol.md`` section 5a): ``better`` / ``worse`` only when the adjusted p is
    at most ``alpha`` and the interval excludes 0; ``equivalent`` when the interval lies inside ``(-margin, margin)``;
    ``not distinguishable`` otherwise."""
    verdict = margin_verdict(low, high, margin)
    if verdict in (BETTER, WORSE) and (p_adjusted is None or p_adjusted > alpha):
        return EQUIVALENT if -margin < low and high < margin else NOT_DISTINGUISHABLE
    return verdict


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of ``m`` p-values (Holm 1979, "A simple sequentially rejective
    multiple test procedure"): sorted ascending, the ``i``-th smallest (from 0) becomes ``(m - i) p``, made monotone
    (never below an adjusted p-value before it) and capped at 1. A hypothesis is rejected at level alpha when its
    adjusted p-value is at most alpha; this controls the family-wise error rate without assuming independence.

    Returns:
        The adjusted p-values, in the order given.
    """
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: float(pvalues[i]))
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        adjusted[i] = running
    return adjusted


def margin_verdict(low: float | None, high: float | None, margin: float = EQUIVALENCE_MARGIN_POINTS) -> str:
    """The verdict of an interval ``[low, high]`` of a difference with an equivalence ``margin`` (same units, e.g.
    points): ``better`` / ``worse`` when it lies above / below 0 (a bound at 0 does not exclude it), ``equivalent``
    only when it lies inside ``(-margin, margin)``, ``not distinguishable`` otherwise (the interval holds 0 and
    reaches beyond the margin: the data cannot tell the two apart, which is not the same as equal)."""
    if low is None or high is None:
        return NO_INTERVAL
    if low > 0:
        return BETTER
    if high < 0:
        return WORSE
    if -margin < low and high < margin:
        return EQUIVALENT
    return NOT_DISTINGUISHABLE


def image_paired_difference(
    correct_a: Sequence[bool] | np.ndarray,
    correct_b: Sequence[bool] | np.ndarray,
    margin: float = EQUIVALENCE_MARGIN_POINTS,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> dict:
    """One run's paired difference ``acc(a) - acc(b)`` over its test images, in points: McNemar's exact p
    (:func:`mcnemar_exact`), the 95% paired bootstrap interval (:func:`paired_bootstrap`) and its verdict with the
    equivalence ``margin`` in points (:func:`margin_verdict`).

    Returns:
        ``{"n", "difference", "b", "c", "p_mcnemar", "low", "high", "margin", "verdict", "resamples", "seed"}``;
        ``difference``, ``low``, ``high`` and ``margin`` in points.
    """
    a, b_ = _as_bool(correct_a), _as_bool(correct_b)
    test = mcnemar_exact(a, b_)
    low, high = paired_bootstrap(a, b_, resamples=resamples, seed=seed)
    low, high = 100 * low, 100 * high
    return {
        "n": test["n"],
        "difference": 100 * (test["b"] - test["c"]) / test["n"],
        "b": test["b"],
        "c": test["c"],
        "p_mcnemar": test["p"],
        "low": low,
        "high": high,
        "margin": float(margin),
        "verdict": margin_verdict(low, high, margin),
        "resamples": int(resamples),
        "seed": int(seed),
    }
