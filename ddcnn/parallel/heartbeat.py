"""A worker's heartbeat, and what it says: whether the worker's main thread still makes progress.

A heartbeat thread that only says "this process exists" keeps beating while the main thread is stuck (a deadlock, a
forward pass that never returns, a blocked read): the parent never learns. :class:`MainThreadWatch` therefore looks at
the main thread from the heartbeat thread, once a second: the CPU time it used (computing in Python or in torch's
operators, which run on the calling thread), its Python stack (every frame's code and instruction) and, on a CUDA
device, the caching allocator's count of allocation requests (every forward pass allocates). While any of them
changes, the main thread moves; when none has for ``parallel.heartbeat_timeout_s``, the parent kills the worker and
names its sub-domain and the line the main thread was stuck at. A thread blocked on a lock, a queue, a read or a sleep
uses no CPU and stays on one line; a single call that blocks longer than the timeout (no training step does) counts
as hung, a busy loop that never ends does not. Waits that are not the worker's own (for its task list or its data
from the parent, for another process that holds a stage's lock) do not count.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import threading
import time

from ddcnn.rundir import StageLock

__all__ = ["MainThreadWatch", "beat"]

# CPU seconds the main thread must use between two looks to count as moving (a blocked thread's wake-ups use less).
CPU_MOVES_S = 0.01


class MainThreadWatch:
    """Seconds since the main thread last moved, and where it is, as seen from another thread."""

    def __init__(self, device: str = "cpu") -> None:
        self.main = threading.main_thread().ident
        self.device = device
        self.waiting = 0  # > 0 while the main thread waits for the parent
        self._key: tuple | None = None
        self._since = time.monotonic()
        try:
            self._clock: int | None = time.pthread_getcpuclockid(self.main)
        except (AttributeError, OSError):  # not on Linux: the stack and the allocations only
            self._clock = None
        self._cpu_s = self._cpu()

    def _cpu(self) -> float:
        return time.clock_gettime(self._clock) if self._clock is not None else 0.0

    @contextlib.contextmanager
    def waiting_for_parent(self):
        """A wait on the parent (task list, data): the parent knows why the worker does not move."""
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1
            self._since = time.monotonic()

    def _allocations(self) -> int | None:
        torch = sys.modules.get("torch")
        if torch is None or not self.device.startswith("cuda") or not torch.cuda.is_initialized():
            return None
        return torch.cuda.memory_stats(self.device).get("allocation.all.allocated")

    def sample(self) -> tuple[float, str]:
        """``(seconds the main thread has not moved, where it is)``: its innermost frame ``file:line (function)`` and,
        when that is in Python's standard library (a lock, a queue), the innermost frame outside it."""
        now = time.monotonic()
        frame = sys._current_frames().get(self.main)
        stack, frames = [], []
        while frame is not None:
            stack.append((id(frame.f_code), frame.f_lasti))
            frames.append(frame)
            frame = frame.f_back
        where = " called from ".join(_describe(f) for f in _innermost(frames)) or "-"
        key, cpu_s = (tuple(stack), self._allocations()), self._cpu()
        if key != self._key or cpu_s - self._cpu_s >= CPU_MOVES_S or self.waiting or StageLock.waiting:
            self._since = now
        self._key, self._cpu_s = key, cpu_s
        return now - self._since, where


_STDLIB = sysconfig.get_paths()["stdlib"]


def _describe(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _in_stdlib(frame) -> bool:
    name = frame.f_code.co_filename
    return name.startswith(_STDLIB) and "-packages" not in name


def _innermost(frames: list) -> list:
    """The innermost frame, and the innermost one outside the standard library when that one is in it."""
    if not frames or not _in_stdlib(frames[0]):
        return frames[:1]
    return frames[:1] + [f for f in frames if not _in_stdlib(f)][:1]


def beat(result_q, rank: int, parent_pid: int, interval_s: float, stop: threading.Event, watch: MainThreadWatch):
    """Send the parent ``("alive", rank, {"stuck_s", "where"})`` every ``interval_s`` (the main thread is looked at
    every second in between) until ``stop`` is set; a stopped (SIGSTOP) or frozen process stops beating. Exits the
    worker when the parent is gone."""
    sent = 0.0
    while not stop.is_set():
        if os.getppid() != parent_pid:
            os._exit(1)
        stuck_s, where = watch.sample()
        if time.monotonic() - sent >= interval_s:
            try:
                result_q.put(("alive", rank, {"stuck_s": stuck_s, "where": where}))
            except (OSError, ValueError):
                os._exit(1)
            sent = time.monotonic()
        stop.wait(min(interval_s, 1.0))
