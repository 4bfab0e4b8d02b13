"""Paired statistics of the comparison protocol (ddcnn/report/stats.py): known differences give a known 95% interval,
and the verdict follows the interval, at its boundary too."""

from __future__ import annotations

import math

import pytest

from ddcnn.report.stats import (
    BASELINE_NOT_CONVERGED,
    BETTER,
    NO_INTERVAL,
    NO_SPREAD,
    WITHIN_NOISE,
    WORSE,
    all_converged,
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
