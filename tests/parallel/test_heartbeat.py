"""What a worker's heartbeat reports: how long its main thread has not moved, and where it is stuck."""

from __future__ import annotations

import threading
import time

from filelock import FileLock

from ddcnn.parallel.heartbeat import MainThreadWatch
from ddcnn.rundir import RunDir


def _watched(watch: MainThreadWatch, seconds: float, body) -> list[tuple[float, str]]:
    """Run ``body`` in this (the main) thread while another thread samples the watch every 0.1 s."""
    samples, stop = [], threading.Event()

    def sampler() -> None:
        while not stop.wait(0.1):
            samples.append(watch.sample())

    thread = threading.Thread(target=sampler)
    thread.start()
    try:
        body(seconds)
    finally:
        stop.set()
        thread.join()
    return samples


def _compute(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(1000))


def _deadlock(seconds: float) -> None:
    threading.Event().wait(seconds)  # a lock nobody releases (for ``seconds``)


def test_a_main_thread_at_work_moves_and_a_blocked_one_is_stuck_at_its_line():
    watch = MainThreadWatch()
    moving = _watched(watch, 1.0, _compute)
    assert max(s for s, _ in moving) < 0.5
    stuck = _watched(watch, 1.5, _deadlock)
    stuck_s, where = stuck[-1]
    assert stuck_s > 1.0
    # The lock's line in the standard library, and the line of this file that waits on it.
    assert "threading.py" in where and "test_heartbeat.py" in where and "(_deadlock)" in where, where


def test_waiting_for_the_parent_or_for_another_process_s_stage_lock_is_not_stuck(tmp_path):
    watch = MainThreadWatch()

    def wait_for_parent(seconds: float) -> None:
        with watch.waiting_for_parent():
            _deadlock(seconds)

    assert max(s for s, _ in _watched(watch, 1.0, wait_for_parent)) < 0.5

    run = RunDir(tmp_path)
    held, release = threading.Event(), threading.Event()

    def other_owner() -> None:  # another holder of local 0's lock (an flock conflicts across file descriptors)
        lock = run.lock("local", 0)
        with FileLock(lock.path, thread_local=False):
            held.set()
            release.wait()

    owner = threading.Thread(target=other_owner)
    owner.start()
    held.wait()

    def wait_for_lock(seconds: float) -> None:
        threading.Timer(seconds, release.set).start()
        with run.lock("local", 0):
            pass

    samples = _watched(watch, 1.0, wait_for_lock)
    owner.join()
    assert max(s for s, _ in samples) < 0.5
