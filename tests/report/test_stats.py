"""Paired statistics of the comparison protocol (ddcnn/report/stats.py): known differences give a known 95% interval,
and the verdict follows the interval, at its boundary too."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ddcnn.report.stats import (
    BASELINE_NOT_CONVERGED,
    BETTER,
    EQUIVALENCE_MARGIN_POINTS,
    EQUIVALENT,
    NO_INTERVAL,
    NO_SPREAD,
    NOT_DISTINGUISHABLE,
    WITHIN_NOISE,
    WORSE,
    all_converged,
    holm,
    image_paired_difference,
    margin_verdict,
    mcnemar_exact,
    paired_bootstrap,
    paired_difference,
    t_quantile_975,
    verdict,
)


def test_t_quantiles_are_students_to_six_decimals_and_approach_the_normal():
    # t(0.975, df) to six decimals (R's qt(0.975, df); a printed table rounds them to three: 12.706, 4.303, 2.042).
    for df, exact in ((1, 12.706205), (2, 4.302653), (3, 3.182446), (4, 2.776445), (30, 2.042272), (50, 2.008559)):
        assert t_quantile_975(df) == pytest.approx(exact, abs=1e-6)
    assert t_quantile_975(1000) == pytest.approx(1.962339, abs=1e-6)
    assert t_quantile_975(10**9) == pytest.approx(1.959964, abs=1e-6)  # the normal's 97.5% quantile
    with pytest.raises(ValueError, match="at least 1 degree of freedom"):
        t_quantile_975(0)


def test_known_differences_give_the_known_interval():
    # The AdrenalMNIST3D seeds: +2.13 ± 2.28 points over 3 seeds has a 95% interval of about ±5.7 points.
    d = [1.0, 4.5, 0.9]  # mean 2.1333, sample std 2.0502
    out = paired_difference(d, seeds=[0, 1, 2])
    mean, std = sum(d) / 3, math.sqrt(sum((x - sum(d) / 3) ** 2 for x in d) / 2)
    assert out["n"] == 3 and out["mean"] == pytest.approx(mean) and out["std"] == pytest.approx(std)
    t2 = 4.302653  # t(0.975, 2)
    assert out["half_width"] == pytest.approx(t2 * std / math.sqrt(3))
    assert (out["low"], out["high"]) == pytest.approx((mean - t2 * std / math.sqrt(3), mean + t2 * std / 3**0.5))
    assert out["verdict"] == WITHIN_NOISE and out["seeds"] == [0, 1, 2]
    # the paired t-test's two-sided p, by hand: Student's t with 2 degrees of freedom has the closed-form CDF
    # 1/2 + t / (2 sqrt(2 + t^2)), so p = 1 - |t| / sqrt(2 + t^2)
    t = mean / (std / math.sqrt(3))
    assert out["p"] == pytest.approx(1 - t / math.sqrt(2 + t * t)) and out["p"] > 0.05
    # p at most 0.05 exactly when the t-interval excludes 0; none without an interval
    for values in ([1.0, 1.2, 0.8, 1.1, 0.9], [0.1, -0.3, 0.5, 0.2], [2.0, 2.1]):
        got = paired_difference(values)
        assert (got["p"] <= 0.05) == (got["low"] > 0 or got["high"] < 0)
    assert paired_difference([1.0])["p"] is None and paired_difference([0.5, 0.5, 0.5])["p"] is None
    # Five seeds all clearly above 0: better; all below: worse.
    assert paired_difference([1.0, 1.2, 0.8, 1.1, 0.9])["verdict"] == BETTER
    assert paired_difference([-1.0, -1.2, -0.8, -1.1, -0.9])["verdict"] == WORSE


def test_the_verdict_at_the_boundary_of_the_interval():
    # Differences 1 and 3: mean 2, std sqrt(2), half width t(0.975, 1) * sqrt(2) / sqrt(2) = 12.706: the interval
    # [-10.706, 14.706] holds 0.
    assert paired_difference([1.0, 3.0])["low"] == pytest.approx(2 - 12.706205)
    # An interval whose lower end is exactly 0 does not exclude 0: within noise; just above it: better.
    assert verdict(0.0, 2.0, 5) == WITHIN_NOISE and verdict(1e-9, 2.0, 5) == BETTER
    assert verdict(-2.0, 0.0, 5) == WITHIN_NOISE and verdict(-2.0, -1e-9, 5) == WORSE


def test_one_seed_has_no_interval_and_an_unconverged_baseline_no_verdict():
    one = paired_difference([2.5])
    assert one["verdict"] == NO_INTERVAL and one["std"] is None and one["low"] is None and one["mean"] == 2.5
    assert paired_difference([1.0, 1.2, 0.8, 1.1, 0.9], baseline_converged=False)["verdict"] == BASELINE_NOT_CONVERGED
    # Convergence not recorded (runs of an older ddcnn): the interval's verdict, flagged as such by the reader.
    unknown = paired_difference([1.0, 1.2, 0.8, 1.1, 0.9], baseline_converged=None)
    assert unknown["verdict"] == BETTER and unknown["baseline_converged"] is None
    # Over seeds: one unconverged seed withholds the verdict even where another's convergence is not recorded.
    assert all_converged([True, None, False]) is False and all_converged([True, None]) is None
    assert all_converged([True, True]) is True


def test_equal_differences_give_no_interval_and_no_verdict():
    """Two seeds that both gave +3.02 points (AdrenalMNIST3D, seeds 0 and 1 of the page) have a sample std of 0: a
    t-interval of no width would call the difference better; there is no spread to judge noise from."""
    same = paired_difference([3.02, 3.02])
    assert same["verdict"] == NO_SPREAD and same["std"] == 0.0 and same["low"] is None and same["high"] is None
    assert paired_difference([-0.5, -0.5, -0.5])["verdict"] == NO_SPREAD
    rounded = [251 / 298 - 242 / 298, 249 / 298 - 240 / 298]  # 9 of 298 volumes twice, apart by float rounding
    assert rounded[0] != rounded[1] and paired_difference(rounded)["verdict"] == NO_SPREAD
    assert paired_difference([3.02, 3.02], baseline_converged=False)["verdict"] == BASELINE_NOT_CONVERGED


def _outcomes(only_a: int, only_b: int, both: int, neither: int) -> tuple[list[bool], list[bool]]:
    """Per-image outcomes of two classifiers with the given 2x2 table."""
    a = [True] * only_a + [False] * only_b + [True] * both + [False] * neither
    b = [False] * only_a + [True] * only_b + [True] * both + [False] * neither
    return a, b


def test_mcnemar_exact_against_the_binomial_by_hand():
    # 7 images only a gets right, 1 only b: under H0 b ~ Binomial(8, 1/2); two-sided p = 2 P(X <= 1)
    # = 2 (C(8,0) + C(8,1)) / 2^8 = 2 * 9 / 256 = 0.0703125. The concordant images (50 both right) do not count.
    a, b = _outcomes(7, 1, 50, 2)
    out = mcnemar_exact(a, b)
    assert (out["b"], out["c"], out["n"]) == (7, 1, 60)
    assert out["p"] == pytest.approx(18 / 256, abs=1e-12)
    # 10 against 2: 2 (1 + 12 + 66) / 4096 = 158 / 4096; symmetric in a and b.
    a, b = _outcomes(10, 2, 0, 0)
    assert mcnemar_exact(a, b)["p"] == pytest.approx(158 / 4096, abs=1e-12) == mcnemar_exact(b, a)["p"]
    # As many discordant images each way, or none at all: p = 1.
    assert mcnemar_exact(*_outcomes(4, 4, 3, 0))["p"] == pytest.approx(1.0)
    assert mcnemar_exact(*_outcomes(0, 0, 5, 5))["p"] == 1.0
    with pytest.raises(ValueError, match="pairs images"):
        mcnemar_exact([True, False], [True])


def test_paired_bootstrap_matches_the_normal_approximation_on_many_images():
    # 10,000 images, 400 only a right, 300 only b: the mean difference 0.01 has variance
    # ((p+ + p-) - (p+ - p-)^2) / n = (0.07 - 0.0001) / 10000, so the normal 95% interval is 0.01 ± 1.96 * 0.0026439.
    a, b = _outcomes(400, 300, 9000, 300)
    se = math.sqrt((0.07 - 0.0001) / 10_000)
    low, high = paired_bootstrap(a, b, resamples=10_000, seed=0)
    assert low == pytest.approx(0.01 - 1.959964 * se, abs=3e-4)
    assert high == pytest.approx(0.01 + 1.959964 * se, abs=3e-4)
    # Seeded: the same predictions give the same interval; another seed moves it by Monte Carlo noise only.
    assert paired_bootstrap(a, b, seed=0) == (low, high)
    other = paired_bootstrap(a, b, seed=1)
    assert other != (low, high) and other == pytest.approx((low, high), abs=3e-4)
    # Identical classifiers: no discordant image, an interval of no width at 0.
    assert paired_bootstrap(a, a) == (0.0, 0.0)


def test_holm_on_the_textbook_example():
    # Holm's procedure on Wikipedia's example (four hypotheses, p = 0.01, 0.04, 0.03, 0.005, alpha 0.05): sorted,
    # 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (monotone): H1 and H4 rejected.
    adjusted = holm([0.01, 0.04, 0.03, 0.005])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert [p <= 0.05 for p in adjusted] == [True, False, False, True]
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([0.02]) == [0.02] and holm([]) == []


def test_margin_verdict_calls_equivalent_only_inside_the_margin():
    assert EQUIVALENCE_MARGIN_POINTS == 0.5
    assert margin_verdict(0.04, 1.2) == BETTER and margin_verdict(-1.2, -0.04) == WORSE
    assert margin_verdict(-0.3, 0.4) == EQUIVALENT
    assert margin_verdict(-0.3, 0.6) == NOT_DISTINGUISHABLE and margin_verdict(-0.5, 0.2) == NOT_DISTINGUISHABLE
    assert margin_verdict(-0.3, 0.6, margin=1.0) == EQUIVALENT
    assert margin_verdict(0.0, 0.3) == EQUIVALENT  # a bound at 0 does not exclude it


def test_one_runs_difference_over_its_test_images():
    a, b = _outcomes(7, 1, 50, 2)
    out = image_paired_difference(a, b)
    assert out["difference"] == pytest.approx(100 * 6 / 60) and out["p_mcnemar"] == pytest.approx(18 / 256)
    assert out["low"] < out["difference"] < out["high"] and out["verdict"] in (BETTER, NOT_DISTINGUISHABLE)
    # 10,000 images, 30 against 28 discordant: the interval is about ±0.15 points, inside the margin.
    a, b = _outcomes(30, 28, 9800, 142)
    near = image_paired_difference(a, b)
    assert -0.5 < near["low"] < 0 < near["high"] < 0.5 and near["verdict"] == EQUIVALENT


def test_two_level_bootstrap_matches_its_exact_distribution_on_two_seeds_and_two_images():
    """2 seeds x 2 images: a resample draws one of 4 ordered seed pairs and one of 4 ordered image pairs, 16 equally
    likely outcomes, enumerated here by hand; the bootstrap's shares of each statistic match them."""
    from itertools import product

    from ddcnn.report.stats import two_level_bootstrap

    d = np.array([[1.0, 0.0], [0.0, -1.0]])  # seed 0: +1 on image 0; seed 1: -1 on image 1
    exact = []
    for seeds, images in product(product(range(2), repeat=2), product(range(2), repeat=2)):
        exact.append(np.mean([np.mean([d[s, i] for i in images]) for s in seeds]))
    out = two_level_bootstrap(d, resamples=40_000, seed=1)
    assert out["difference"] == pytest.approx(0.0) and out["seeds"] == 2 and out["images"] == 2
    # the exact distribution: P(stat <= 0) and P(stat >= 0), the two-sided p is twice the smaller
    p_exact = 2 * min(np.mean(np.array(exact) <= 0), np.mean(np.array(exact) >= 0))
    assert out["p"] == pytest.approx(min(1.0, p_exact), abs=0.02)
    quantiles = np.percentile(exact, [2.5, 97.5], method="inverted_cdf")  # of the exact distribution
    assert (out["low"], out["high"]) == tuple(quantiles)


def test_two_level_bootstrap_carries_both_the_image_and_the_seed_noise():
    """Identical seeds: the image level alone, as wide as the one-level paired bootstrap; seeds that differ by a
    constant on every image: the seed level alone (no image noise), as wide as the bootstrap of the seed means."""
    from ddcnn.report.stats import paired_bootstrap, two_level_bootstrap

    rng = np.random.default_rng(0)
    a, b = rng.random(4000) < 0.9, rng.random(4000) < 0.88
    same = np.stack([a.astype(float) - b] * 5)
    out = two_level_bootstrap(same, resamples=4000)
    low, high = paired_bootstrap(a, b, resamples=4000)
    assert out["high"] - out["low"] == pytest.approx(high - low, rel=0.1)
    shifts = np.array([0.01, 0.03, -0.02, 0.0, 0.02])
    flat = np.repeat(shifts[:, None], 1000, axis=1)
    out = two_level_bootstrap(flat, resamples=4000)
    means = [rng.choice(shifts, 5).mean() for _ in range(4000)]
    assert out["high"] - out["low"] == pytest.approx(np.percentile(means, 97.5) - np.percentile(means, 2.5), rel=0.15)
    assert out["difference"] == pytest.approx(shifts.mean())
    with pytest.raises(ValueError, match=r"\(seeds, images\)"):
        two_level_bootstrap(np.zeros(5))


def test_a_holm_verdict_needs_the_adjusted_p_and_equivalence_the_margin():
    from ddcnn.report.stats import holm_verdict

    assert holm_verdict(0.2, 1.0, 0.01, 0.5) == "better"
    assert holm_verdict(0.2, 1.0, 0.2, 0.5) == "not distinguishable"  # its interval excludes 0, its adjusted p not
    assert holm_verdict(0.1, 0.4, 0.2, 0.5) == "equivalent"  # inside the margin
    assert holm_verdict(-1.2, -0.3, 0.001, 0.5) == "worse"
    assert holm_verdict(-0.3, 0.8, 0.5, 0.5) == "not distinguishable"


def test_the_metric_bootstraps_observed_differences_are_sklearns_and_each_resample_is_the_metric_on_its_draw():
    """Balanced accuracy and the AUC of two classes: at counts of 1 the observed difference is scikit-learn's metric
    of the method minus the baseline's, per seed and configuration averaged; for one resample's image counts, the
    metric equals scikit-learn's on the images repeated as drawn (a hand-made resample)."""
    from sklearn.metrics import balanced_accuracy_score, roc_auc_score

    from ddcnn.report.stats import _weighted_auc, two_level_bootstrap_metric

    rng = np.random.default_rng(3)
    y = (rng.random(120) < 0.25).astype(int)
    # 2 seeds x 2 configurations; scores with ties (rounded) and a method better than its baseline
    method = np.round(np.clip(y + rng.normal(0, 0.8, (2, 2, 120)), 0, 1), 1)
    baseline = np.round(np.clip(y + rng.normal(0, 1.2, (2, 2, 120)), 0, 1), 1)
    auc = two_level_bootstrap_metric("auc", y, method, baseline, resamples=2000)
    expected = np.mean(
        [roc_auc_score(y, method[s, c]) - roc_auc_score(y, baseline[s, c]) for s in (0, 1) for c in (0, 1)]
    )
    assert auc["difference"] == pytest.approx(expected) and auc["low"] < auc["difference"] < auc["high"]
    pred_m, pred_b = (method > 0.5).astype(int), (baseline > 0.5).astype(int)
    bal = two_level_bootstrap_metric("balanced_accuracy", y, pred_m, pred_b, resamples=2000)
    expected = np.mean(
        [
            balanced_accuracy_score(y, pred_m[s, c]) - balanced_accuracy_score(y, pred_b[s, c])
            for s in (0, 1)
            for c in (0, 1)
        ]
    )
    assert bal["difference"] == pytest.approx(expected) and bal["low"] < bal["difference"] < bal["high"]
    # one resample: image i drawn counts[i] times
    counts = rng.multinomial(120, np.full(120, 1 / 120))
    drawn = np.repeat(np.arange(120), counts)
    weighted = _weighted_auc(method[0], counts[None, :], y == 1, y == 0)[0]
    assert weighted == pytest.approx([roc_auc_score(y[drawn], method[0, c][drawn]) for c in (0, 1)])


def test_the_metric_bootstrap_of_one_seed_is_the_image_bootstrap_of_the_metric_and_refuses_what_it_cannot_compute():
    from sklearn.metrics import roc_auc_score

    from ddcnn.report.stats import two_level_bootstrap_metric

    rng = np.random.default_rng(5)
    y = (rng.random(300) < 0.3).astype(int)
    a, b = y + rng.normal(0, 0.7, 300), y + rng.normal(0, 0.9, 300)
    out = two_level_bootstrap_metric("auc", y, a[None, None], b[None, None], resamples=500, seed=2)
    # the same image draws by hand (NumPy's generator, seeded as the function seeds it: images, then seeds)
    gen, stats = np.random.default_rng(2), []
    for _ in range(0, 500, 250):
        images = gen.multinomial(300, np.full(300, 1 / 300), size=250)
        gen.multinomial(1, [1.0], size=250)
        for counts in images:
            drawn = np.repeat(np.arange(300), counts)
            stats.append(roc_auc_score(y[drawn], a[drawn]) - roc_auc_score(y[drawn], b[drawn]))
    assert (out["low"], out["high"]) == pytest.approx(tuple(np.percentile(stats, [2.5, 97.5])))
    with pytest.raises(ValueError, match="two classes"):
        two_level_bootstrap_metric("auc", np.arange(300) % 3, a[None, None], b[None, None])
    with pytest.raises(ValueError, match=r"\(seeds, configurations, images\)"):
        two_level_bootstrap_metric("auc", y, a[None], b[None])
    with pytest.raises(ValueError, match="balanced_accuracy or auc"):
        two_level_bootstrap_metric("f1", y, a[None, None], b[None, None])
