"""The one place that decides which device and how many CPU threads each local-stage process uses.

Stages receive a device, they never pick one. :func:`plan_workers` gives each of ``P`` worker processes
one device: ``cuda:i`` round-robin over the visible GPUs when CUDA exists and ``parallel.accelerator``
allows it (several workers may then share a GPU), otherwise a share of the CPU cores.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from ddcnn.runtime import resolve_device

__all__ = ["WorkerDevice", "available_cores", "plan_workers", "configure_process", "process_device"]

ACCELERATORS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class WorkerDevice:
    """Device and intra-op thread count of one worker process (``rank`` 0..P-1)."""

    rank: int
    device: str
    threads: int

    def describe(self) -> str:
        return f"worker {self.rank} ({self.device}, {self.threads} thread{'s' if self.threads != 1 else ''})"

    def as_dict(self) -> dict:
        return asdict(self)


def available_cores() -> int:
    """Cores this process may run on (its affinity mask: SLURM and taskset restrict it, ``os.cpu_count`` does not)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _use_cuda(accelerator: str, cuda_count: int) -> bool:
    accelerator = {"gpu": "cuda"}.get(str(accelerator).lower(), str(accelerator).lower())
    if accelerator not in ACCELERATORS:
        raise ValueError(f"parallel.accelerator must be one of {', '.join(ACCELERATORS)}, got {accelerator!r}.")
    if accelerator == "cuda" and cuda_count == 0:
        raise ValueError(
            "parallel.accelerator=cuda but torch sees no CUDA device here; use parallel.accelerator=auto or cpu."
        )
    return accelerator != "cpu" and cuda_count > 0


def plan_workers(
    workers: int,
    accelerator: str = "auto",
    threads_per_worker: int | None = None,
    cores: int | None = None,
    cuda_count: int | None = None,
) -> list[WorkerDevice]:
    """Device and threads of each of ``workers`` processes.

    Args:
        workers: Number of worker processes P.
        accelerator: ``auto`` (GPUs when present), ``cpu`` or ``cuda``.
        threads_per_worker: Intra-op threads per worker; default ``max(1, cores // P)`` so that P workers
            together use the cores once (more threads than cores only adds contention).
        cores, cuda_count: Override what this machine reports (for tests and planning).
    """
    if workers < 1:
        raise ValueError(f"parallel.workers must be >= 1, got {workers}.")
    cores = available_cores() if cores is None else int(cores)
    cuda_count = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if cuda_count is None else cuda_count
    if threads_per_worker is not None and int(threads_per_worker) < 1:
        raise ValueError(f"parallel.threads_per_worker must be >= 1 or null, got {threads_per_worker}.")
    threads = int(threads_per_worker) if threads_per_worker is not None else max(1, cores // workers)
    if _use_cuda(accelerator, cuda_count):
        return [WorkerDevice(r, f"cuda:{r % cuda_count}", threads) for r in range(workers)]
    return [WorkerDevice(r, "cpu", threads) for r in range(workers)]


def configure_process(device: WorkerDevice | str, threads: int | None = None) -> None:
    """Apply a device and thread count to the current process (call it first thing in a worker)."""
    if isinstance(device, WorkerDevice):
        device, threads = device.device, device.threads
    if threads is not None:
        torch.set_num_threads(int(threads))
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)


def process_device(device: str | None, threads_per_worker: int | None = None, local_rank: int = 0) -> str:
    """The device of a process that trains in place (``parallel.workers=1``, a SLURM task, an ``srun`` rank).

    ``device`` (the run's ``device``) resolved (:func:`ddcnn.runtime.resolve_device`: ``auto`` is ``cuda`` when CUDA
    exists), and a bare ``cuda`` picks ``cuda:<local_rank % GPUs>`` so that the
    ``srun`` tasks of one node spread over its GPUs. ``threads_per_worker`` (``parallel.threads_per_worker``), when
    set, is applied; else the tasks of one ``srun`` step on a node take ``--cpus-per-task`` threads each, or an equal
    share of the cores.
    """
    device = resolve_device(device)
    threads = threads_per_worker
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").split("(")[0].split(",")[0]
    if threads is None and per_node.isdigit() and int(per_node) > 1:
        # Tasks of one srun step share the node: each takes its CPUs (--cpus-per-task) or an equal share, never all
        # of them (G tasks x all cores oversubscribes and OpenMP's spinning makes every task many times slower).
        threads = int(os.environ.get("SLURM_CPUS_PER_TASK") or max(1, available_cores() // int(per_node)))
    if device == "cuda" and torch.cuda.is_available():
        device = f"cuda:{local_rank % torch.cuda.device_count()}"
    configure_process(device, None if threads is None else int(threads))
    return device
