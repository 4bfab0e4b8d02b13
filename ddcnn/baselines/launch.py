"""Start, join and always clean up a group of ``torch.distributed`` processes on one machine.

Every baseline runs as ``P`` (or ``P + 1``) fresh processes (forked from a forkserver that has imported torch once,
or spawned where there is none) that meet through a ``file://`` rendezvous in a fresh temporary folder, so no port has
to be guessed and two runs never collide. The parent waits with a deadline: a rank that fails makes :func:`launch`
terminate the others and re-raise the error of the rank that failed first (the cause, not a peer that failed because
of it), and a run past its deadline is killed and reported as a ``TimeoutError``, so no rank is ever left hanging.
Inside a rank, :func:`process_group` opens the group with a timeout on every collective and closes it whatever
happens.

This module (like the rest of :mod:`ddcnn.baselines`) imports neither Lightning nor Hydra: every rank imports it, and
a lighter import keeps the start-up of each rank short.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from ddcnn.io import load_run_file

__all__ = [
    "THREAD_POLICY",
    "RankInfo",
    "available_cores",
    "backend_for",
    "device_for",
    "launch",
    "process_group",
    "threads_per_rank",
]

# Gloo picks the interface the host name resolves to, which in containers can be unreachable; every rank runs on this
# machine, so the loopback interface always works.
_LOOPBACK = {"linux": "lo", "darwin": "lo0"}


class RankInfo:
    """Where one spawned process stands: its rank, the world size, the rendezvous and its scratch folder.

    Args:
        rank: Rank of this process, ``0 .. world_size - 1``.
        world_size: Number of processes in the group.
        init_method: The ``file://`` rendezvous shared by the group.
        workdir: A scratch folder shared by the group, removed when :func:`launch` returns.
        timeout_s: Timeout of every collective and of the rendezvous.
    """

    def __init__(self, rank: int, world_size: int, init_method: str, workdir: str, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.init_method = init_method
        self.workdir = Path(workdir)
        self.timeout_s = timeout_s

    def save_result(self, result: Any) -> None:
        """Hand ``result`` (anything ``torch.save`` takes) back to :func:`launch`, atomically."""
        path = self.workdir / f"result_{self.rank}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(result, tmp)
        os.replace(tmp, path)


def backend_for(device: str) -> str:
    """``"nccl"`` for a CUDA device, ``"gloo"`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def device_for(device: str, rank: int) -> torch.device:
    """The device of ``rank``: ``cuda:<rank mod #GPUs>`` for ``"cuda"``, else ``device`` itself."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return dev


# The thread policy of every baseline and of the single-process reference they are measured against.
THREAD_POLICY = "1 intra-op thread per computing process"


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_per_rank(num_ranks: int) -> int:
    """CPU threads of each of ``num_ranks`` computing processes: one, whatever ``num_ranks`` and the core count.

    The single-process reference gets one thread too (:data:`THREAD_POLICY`), so a speedup with ``P`` processes is
    that of ``P`` cores over one core on every machine. Dividing the cores instead (``cores // P`` threads per rank
    against one thread for the reference) made the speedups fair only where the cores equal ``P``, and mixed the
    scaling of a method with that of the library's intra-op threads. With more processes than
    :func:`available_cores` they share cores, and the speedups say nothing about the method.

    Raises:
        ValueError: If ``num_ranks`` is not positive.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}.")
    return 1


@contextlib.contextmanager
def process_group(info: RankInfo, backend: str = "gloo") -> Iterator[None]:
    """Open the default process group for this rank and always destroy it on the way out."""
    if backend == "gloo" and sys.platform in _LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _LOOPBACK[sys.platform])
    dist.init_process_group(
        backend,
        init_method=info.init_method,
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=info.timeout_s),
    )
    try:
        yield
    except BaseException:
        # Mark when this rank failed, before closing the group makes its peers fail too: launch() reports the
        # rank that failed first, the cause, rather than a victim.
        (info.workdir / f"failed_{info.rank}").write_text(f"{time.time_ns()}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def _entry(
    rank: int, fn: Callable[..., None], world_size: int, init_method: str, workdir: str, timeout_s: float, args: tuple
) -> None:
    fn(RankInfo(rank, world_size, init_method, workdir, timeout_s), *args)


def launch(fn: Callable[..., None], world_size: int, args: tuple = (), timeout_s: float = 300.0) -> dict[int, Any]:
    """Run ``fn(info, *args)`` in ``world_size`` new processes, wait for all of them and collect their results.

    ``fn`` must be a module-level function (the ranks import it by name) and gets a :class:`RankInfo`; it usually
    opens :func:`process_group` and hands back what it found with :meth:`RankInfo.save_result`.

    Args:
        fn: The per-rank entry point.
        world_size: Number of processes.
        args: Further (picklable) arguments of ``fn``; tensors travel through shared memory.
        timeout_s: Deadline of the whole run; also the timeout of every collective inside it.

    Returns:
        ``{rank: result}`` for every rank that called :meth:`RankInfo.save_result`.

    Raises:
        torch.multiprocessing.ProcessRaisedException: A rank raised (the others are terminated); the message is that
            of the rank that failed first.
        torch.multiprocessing.ProcessExitedException: A rank died without raising (the others are terminated).
        TimeoutError: The run did not finish within ``timeout_s`` (every rank is killed).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}.")
    with tempfile.TemporaryDirectory(prefix="ddcnn-dist-") as workdir:
        # The rendezvous file must not exist yet; it lives in a fresh folder, so two runs never meet.
        init_method = f"file://{Path(workdir) / 'rendezvous'}"
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, init_method, workdir, float(timeout_s), tuple(args)),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout_s
        try:
            # The grace period lets a failing rank finish its error report before the others are terminated.
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())), grace_period=2.0):
                if time.monotonic() >= deadline:
                    name = getattr(fn, "__name__", repr(fn))
                    raise TimeoutError(f"{name} with {world_size} processes ran past {timeout_s} s; all were killed.")
        except ProcessException as err:
            # A rank that raises brings the others down (their collectives fail, or gloo aborts them), and the
            # first failure noticed may be such a victim: report the error that came first, the cause.
            raised = _first_error(context, Path(workdir))
            if raised is not None and raised.error_index != err.error_index:
                raise raised from err
            raise
        finally:
            _terminate(context.processes)
        results = {}
        for rank in range(world_size):
            path = Path(workdir) / f"result_{rank}.pt"
            if path.is_file():
                results[rank] = load_run_file(path, map_location="cpu")
        return results


def _start_method() -> str:
    """``"forkserver"`` where there is one, with torch and this package imported once in the server, else spawn.

    Every rank is then forked from a process that has imported torch already (seconds of start-up saved per rank
    and per run: what makes a test suite of several P=2 runs fast); the server starts with the first run and exits
    with this process. Like spawn, it hands each rank a fresh interpreter state without the parent's threads.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # Only takes effect when the server is not running yet, and is ignored by one already started (then slower).
    multiprocessing.get_context("forkserver").set_forkserver_preload(["__main__", "torch", "ddcnn.baselines"])
    return "forkserver"


def _first_error(context: Any, workdir: Path) -> mp.ProcessRaisedException | None:
    """The exception of the rank that failed first (by the marks :func:`process_group` leaves), if one did."""
    _terminate(context.processes)
    marks = []
    for rank in range(len(context.processes)):
        try:
            written, _, trace = (workdir / f"failed_{rank}").read_text().partition("\n")
            marks.append((int(written), rank, trace))
        except (OSError, ValueError):
            continue
    if not marks:
        return None
    _, rank, trace = min(marks)
    others = sorted(r for _, r, _ in marks if r != rank)
    after = f" (then rank(s) {others} failed too)" if others else ""
    message = f"\n\n-- Process {rank} failed first{after}, with the following error:\n{trace}"
    return mp.ProcessRaisedException(message, rank, context.processes[rank].pid)


def _terminate(processes: list[Any], grace_s: float = 5.0) -> None:
    """Terminate, then kill, every process still alive, and reap them all."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    end = time.monotonic() + grace_s
    for p in alive:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(timeout=grace_s)
