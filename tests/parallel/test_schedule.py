"""Cost model, LPT placement, calibration and the scaling prediction."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from ddcnn.parallel.schedule import (
    calibrate,
    default_device_counts,
    local_costs,
    lpt,
    parse_device_counts,
    parse_mixed,
    scaling_rows,
    train_samples_per_epoch,
)


def _optimal_makespan(costs: dict[int, float], speeds: list[float]) -> float:
    best = float("inf")
    for choice in itertools.product(range(len(speeds)), repeat=len(costs)):
        load = [0.0] * len(speeds)
        for task, d in zip(costs, choice, strict=True):
            load[d] += costs[task] / speeds[d]
        best = min(best, max(load))
    return best


def test_cost_is_proportional_to_pixels_samples_and_epochs():
    base = local_costs({0: 100, 1: 200}, n_train=50, n_eval=0, epochs=3)
    assert base[1] == pytest.approx(2 * base[0])
    assert local_costs({0: 100}, 100, 0, 3)[0] == pytest.approx(2 * base[0])
    assert local_costs({0: 100}, 50, 0, 6)[0] == pytest.approx(2 * base[0])
    # Evaluation and predictions add cost at a third of the weight of training.
    assert local_costs({0: 1}, 30, 30, 1, n_predict=30)[0] == pytest.approx(30 + 10 + 10)


def test_samples_per_epoch_honour_limit_train_batches():
    assert train_samples_per_epoch(300, 32, None) == 300
    assert train_samples_per_epoch(300, 32, 4) == 128
    assert train_samples_per_epoch(300, 32, 0.5) == 5 * 32
    assert train_samples_per_epoch(300, 32, 100) == 300


def test_lpt_equal_tasks_spread_evenly_and_deterministically():
    placement = lpt({i: 1.0 for i in range(8)}, [1.0, 1.0, 1.0, 1.0])
    assert sorted(len(a) for a in placement.assignment) == [2, 2, 2, 2]
    assert placement.makespan == pytest.approx(2.0)
    assert placement.assignment == lpt({i: 1.0 for i in range(8)}, [1.0] * 4).assignment
    assert sorted(i for a in placement.assignment for i in a) == list(range(8))


def test_lpt_places_longest_first_onto_the_earliest_finish():
    placement = lpt({0: 3.0, 1: 3.0, 2: 2.0, 3: 2.0, 4: 2.0}, [1.0, 1.0])
    # Classic LPT example: 3,3 | then 2 on each | last 2 -> makespan 7 (optimum 6, within 4/3).
    assert placement.makespan == pytest.approx(7.0)
    assert placement.assignment[0][0] == 0 and placement.assignment[1][0] == 1


def test_lpt_gives_a_fast_device_proportionally_more_work():
    placement = lpt({i: 1.0 for i in range(10)}, [4.0, 1.0])
    assert len(placement.assignment[0]) == 8 and len(placement.assignment[1]) == 2
    assert placement.makespan == pytest.approx(2.0)
    # Per-device predicted finish times are the sums of cost / speed.
    assert placement.predicted_s == pytest.approx([8 / 4.0, 2 / 1.0])


def test_lpt_unequal_costs_within_four_thirds_of_optimum():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        costs = {i: float(c) for i, c in enumerate(torch.randint(1, 20, (7,), generator=gen))}
        speeds = [1.0, 1.0, 1.0]
        assert lpt(costs, speeds).makespan <= 4 / 3 * _optimal_makespan(costs, speeds) + 1e-9


def test_lpt_overhead_and_ready_times_count():
    placement = lpt({0: 1.0, 1: 1.0}, [1.0, 1.0], overhead_s=0.5, ready_s=[0.0, 10.0])
    # The second device starts late, so both tasks go to the first.
    assert placement.assignment == [[0, 1], []]
    assert placement.predicted_s[0] == pytest.approx(3.0)


@pytest.mark.parametrize("speeds", [[], [1.0, 0.0], [1.0, -2.0]])
def test_lpt_refuses_bad_speeds(speeds):
    with pytest.raises(ValueError):
        lpt({0: 1.0}, speeds)


def test_calibrate_measures_a_positive_speed():
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
    ips = calibrate(net, (1, 9, 9), num_classes=5, batch_size=8, steps=2, warmup=1, min_time_s=0.01)
    assert ips > 0


def test_parse_device_sets():
    assert parse_device_counts("1,2, 4") == [1, 2, 4]
    assert parse_mixed("2x1.0,6x0.25") == [1.0, 1.0] + [0.25] * 6
    for bad in ("", "0,2", "a"):
        with pytest.raises(ValueError, match="--devices"):
            parse_device_counts(bad)
    for bad in ("2", "x1", "2x0", "2x-1", "ax1"):
        with pytest.raises(ValueError, match="--mixed"):
            parse_mixed(bad)
    assert default_device_counts(16) == [1, 2, 4, 8, 16]
    assert default_device_counts(6) == [1, 2, 4, 6]
    assert default_device_counts(1) == [1]


def test_scaling_rows_predict_makespan_speedup_and_efficiency():
    local = {i: 10.0 for i in range(8)}
    rows = scaling_rows(local, coarse_s=2.0, global_s=60.0, device_counts=[1, 2, 8], mixed=[1.0, 1.0] + [0.25] * 6)
    by_label = {r.label: r for r in rows}
    assert by_label["1 x 1.0"].total_s == pytest.approx(82.0)
    assert by_label["2 x 1.0"].local_s == pytest.approx(40.0)
    assert by_label["8 x 1.0"].total_s == pytest.approx(12.0)
    assert by_label["8 x 1.0"].speedup == pytest.approx(5.0)
    assert by_label["8 x 1.0"].efficiency == pytest.approx(1.0)
    mixed = rows[-1]
    assert mixed.label == "2 x 1 + 6 x 0.25" and mixed.devices == 8
    # Fast devices take 3 nets each (30 s); a slow one would need 40 s for its first.
    assert mixed.local_s == pytest.approx(40.0)
    assert rows[0].speedup == pytest.approx(60.0 / 82.0)


def test_scaling_rows_without_global_or_coarse():
    rows = scaling_rows({0: 5.0, 1: 3.0}, coarse_s=None, global_s=None, device_counts=[2], startup_s=1.0)
    assert rows[0].total_s == pytest.approx(6.0) and rows[0].speedup is None
