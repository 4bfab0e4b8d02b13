"""BPT-CNN's outer layer: IDPA allocation, AGWU damping, the server's rules, and P=2 runs against one process."""

from __future__ import annotations

import math

import pytest
import torch

from ddcnn.baselines.bpt_cnn import _Server, agwu_weight, idpa_allocate, round_chunks, train_bpt
from ddcnn.baselines.loop import TrainSpec, train_single
from ddcnn.models import vgg_small, vgg_tiny


# --- IDPA ----------------------------------------------------------------------------------------
def test_idpa_is_proportional_to_speed() -> None:
    assert idpa_allocate([2.0, 1.0], 300) == [200, 100]
    assert idpa_allocate([1, 3], 400) == [100, 300]
    assert idpa_allocate([1, 1], 100) == [50, 50]
    assert idpa_allocate([1, 1, 1], 10) == [4, 3, 3]  # the remainder goes to the lower index on a tie


def test_idpa_deals_whole_batches_and_gives_the_rest_to_the_fastest() -> None:
    # 300 samples = 9 batches of 32 + 12: 6 and 3 batches, the 12 left over to the faster worker.
    assert idpa_allocate([2.0, 1.0], 300, granularity=32) == [204, 96]
    assert idpa_allocate([1.0, 2.0], 300, granularity=32) == [96, 204]


def test_idpa_gives_the_remainder_to_the_faster_worker() -> None:
    # 5 batches at speeds 1:2 -> exact 1.67 and 3.33 batches: the largest remainder (0.67) is the slow worker's.
    assert idpa_allocate([1.0, 2.0], 5) == [2, 3]
    # Equal remainders: the faster worker first.
    assert idpa_allocate([1.0, 3.0], 2) == [0, 2]
    assert idpa_allocate([3.0, 1.0, 1.0, 3.0], 2) == [1, 0, 0, 1]


@pytest.mark.parametrize("speeds", [[1.0, 1.0], [5.0, 1.0], [0.3, 0.9, 2.5], [1e-3, 1.0, 7.0, 7.0]])
@pytest.mark.parametrize("n_samples", [0, 1, 31, 64, 1000, 1234])
@pytest.mark.parametrize("granularity", [1, 32])
def test_idpa_invariants(speeds: list[float], n_samples: int, granularity: int) -> None:
    counts = idpa_allocate(speeds, n_samples, granularity=granularity)
    assert sum(counts) == n_samples and min(counts) >= 0
    exact = [n_samples * s / sum(speeds) for s in speeds]
    leftover = n_samples % granularity
    for count, target in zip(counts, exact, strict=True):
        assert abs(count - target) <= granularity + leftover
    # Faster workers never get less.
    for i in range(len(speeds)):
        for j in range(len(speeds)):
            if speeds[i] > speeds[j]:
                assert counts[i] >= counts[j]


def test_idpa_minimum_share() -> None:
    assert idpa_allocate([1.0, 0.0], 100) == [100, 0]
    assert idpa_allocate([1.0, 0.0], 100, granularity=32, min_samples=32) == [68, 32]
    assert idpa_allocate([100.0, 1.0, 1.0], 10, min_samples=5) == [4, 3, 3]  # capped at n // workers


@pytest.mark.parametrize(
    "speeds, n, granularity",
    [([], 10, 1), ([1, -1], 10, 1), ([0, 0], 10, 1), ([1, math.nan], 10, 1), ([1], -1, 1), ([1], 10, 0)],
)
def test_idpa_rejects_bad_input(speeds: list[float], n: int, granularity: int) -> None:
    with pytest.raises(ValueError):
        idpa_allocate(speeds, n, granularity=granularity)


# --- AGWU ----------------------------------------------------------------------------------------
def test_agwu_fresh_updates_count_fully_and_stale_ones_decay() -> None:
    assert agwu_weight(0) == 1.0
    assert agwu_weight(0, gamma=0.1) == 1.0
    assert agwu_weight(1, gamma=0.5) == 0.5
    assert agwu_weight(3, gamma=0.5) == pytest.approx(0.125)
    weights = [agwu_weight(s, gamma=0.7) for s in range(10)]
    assert all(a > b > 0 for a, b in zip(weights, weights[1:], strict=False))
    assert all(agwu_weight(s, gamma=1.0) == 1.0 for s in range(5))


@pytest.mark.parametrize("staleness, gamma", [(-1, 0.5), (1, 0.0), (1, 1.5), (1, -0.5)])
def test_agwu_rejects_bad_input(staleness: int, gamma: float) -> None:
    with pytest.raises(ValueError):
        agwu_weight(staleness, gamma)


# --- the server's rules (no processes needed) ----------------------------------------------------
def test_server_applies_parameter_changes_and_blends_running_statistics() -> None:
    torch.manual_seed(0)
    net = vgg_tiny(2, 1, 5)
    server = _Server(net, 100, TrainSpec(epochs=1, batch_size=10), 2, 2, 0.5, None)
    before = server.weights.clone()
    target = torch.randn_like(before)
    # Parameters travel as changes, buffers as the worker's values.
    update = torch.where(server.buffers, target, target - before)
    server.apply(update, 0.25)
    params = ~server.buffers
    assert server.buffers.any() and params.any()
    torch.testing.assert_close(server.weights[params], before[params] + 0.25 * (target - before)[params])
    torch.testing.assert_close(server.weights[server.buffers], (0.75 * before + 0.25 * target)[server.buffers])


def test_server_hands_out_each_round_by_speed_without_overlap() -> None:
    net = vgg_tiny(2, 1, 5)
    spec = TrainSpec(epochs=2, batch_size=10, seed=3)
    server = _Server(net, 200, spec, 2, 2, 0.5, speeds=[3.0, 1.0])
    handed = []
    for _ in range(4):  # 2 epochs x 2 rounds
        fast, slow = server.assignment(0), server.assignment(1)
        # 100 samples, 10 batches: exactly 7.5 and 2.5 batches, the tied half batch goes to the faster worker.
        assert (len(fast), len(slow)) == (80, 20)
        handed.append(torch.cat([fast, slow]))
    assert server.assignment(0) is None and server.assignment(1) is None
    for epoch in range(2):
        seen = torch.cat(handed[2 * epoch : 2 * epoch + 2])
        assert sorted(seen.tolist()) == list(range(200))  # every sample once per epoch
        assert torch.equal(seen, torch.cat(round_chunks(200, 2, 3, epoch)))
    assert server.samples == [320, 80]


# --- P=2 runs ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits_8x8() -> tuple[torch.Tensor, ...]:
    from ddcnn.data.datamodule import prepare
    from ddcnn.data.sources import digits

    data = prepare(digits(), num_classes=10, in_channels=1, spatial_dims=2, val_fraction=0.15)
    return data.x["train"], data.y["train"], data.x["test"], data.y["test"]


SPEC = TrainSpec(epochs=4, batch_size=32, seed=0, schedule="cosine")


@pytest.fixture(scope="module")
def single_accuracy(digits_8x8) -> float:
    torch.manual_seed(0)
    return train_single(vgg_small(2, 1, 10), *digits_8x8, SPEC, threads=1)["accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_bpt_reaches_single_process_accuracy(digits_8x8, single_accuracy: float, mode: str) -> None:
    """P=2 workers + server on the digits (8x8), same backbone and epochs as one process.

    The bench checks the 1-point gap on a longer run; here, with 4 epochs and the arrival order of asynchronous
    updates left to the scheduler, a looser bound keeps the test from flaking.
    """
    torch.manual_seed(0)
    net = vgg_small(2, 1, 10)
    n_train = len(digits_8x8[0])
    # The synchronous run also checks that fixed speeds override the measured ones (3:1, by whole batches); the
    # asynchronous one that measured speeds steer IDPA, the second worker emulating a device 3x slower.
    speeds = [3.0, 1.0] if mode == "sync" else None
    slowdown = [1.0, 3.0] if mode == "async" else None
    result = train_bpt(net, *digits_8x8, SPEC, workers=2, mode=mode, speeds=speeds, slowdown=slowdown, timeout_s=240)
    assert result["accuracy"] >= single_accuracy - 0.04, (result["accuracy"], single_accuracy)
    assert single_accuracy > 0.9
    assert sum(result["samples_per_worker"]) == SPEC.epochs * n_train
    assert min(result["samples_per_worker"]) > 0
    assert result["rounds"] == 4 * SPEC.epochs
    if mode == "sync":
        assert result["staleness_max"] == 0 and result["version"] == result["rounds"]
        assert result["updates"] == 2 * result["rounds"]
        # Fixed speeds 3:1 decide every round's split, by whole batches (IDPA with the server's settings).
        expected = [0, 0]
        for epoch in range(SPEC.epochs):
            for chunk in round_chunks(n_train, 4, SPEC.seed, epoch):
                counts = idpa_allocate(speeds, len(chunk), granularity=SPEC.batch_size, min_samples=SPEC.batch_size)
                expected = [e + c for e, c in zip(expected, counts, strict=True)]
        assert result["samples_per_worker"] == expected
        assert 2.5 < expected[0] / expected[1] < 4.5
    else:
        assert result["version"] == result["updates"] >= 2 * result["rounds"] - 1
        assert result["staleness_max"] >= 1  # two workers: updates do overlap
        fast, slow = result["samples_per_worker"]
        assert fast > 1.5 * slow, result["allocations"]
