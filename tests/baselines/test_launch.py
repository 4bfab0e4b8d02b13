"""Spawned ranks never outlive a run: a failing rank stops the others, a run past its deadline is killed."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ddcnn.baselines.launch import RankInfo, launch, process_group, threads_per_rank


def _fail_on_rank_1(info: RankInfo) -> None:
    with process_group(info):
        if info.rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        dist.barrier()  # rank 0 would wait here until the collective timeout


def _hang(info: RankInfo) -> None:
    time.sleep(600)


def _echo(info: RankInfo, value: int) -> None:
    with process_group(info):
        info.save_result({"rank": info.rank, "world": dist.get_world_size(), "value": value})


def test_results_come_back_from_every_rank() -> None:
    assert launch(_echo, 2, (7,), timeout_s=60) == {
        0: {"rank": 0, "world": 2, "value": 7},
        1: {"rank": 1, "world": 2, "value": 7},
    }
    assert not multiprocessing.active_children()


def test_a_failing_rank_stops_the_run_without_waiting_for_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose"):
        launch(_fail_on_rank_1, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # far below the 120 s the blocked rank would otherwise wait
    assert not multiprocessing.active_children()


def test_a_run_past_its_deadline_is_killed() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ran past"):
        launch(_hang, 1, timeout_s=3)
    assert time.monotonic() - start < 15
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 64])
def test_every_computing_process_gets_one_thread_whatever_the_cores(num_ranks: int) -> None:
    """The single-process reference runs on one thread: a rank with more would make speedups unfair."""
    assert threads_per_rank(num_ranks) == 1
    with pytest.raises(ValueError, match="num_ranks"):
        threads_per_rank(0)
