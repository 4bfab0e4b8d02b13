"""Where and how this process runs: its SLURM job and ``srun`` rank, and the execution context of its timings.

Plain Python, no torch or Lightning import at module level: the coordinating processes, the executors in
:mod:`ddcnn.parallel`, the engine and the stages all read the environment through this one module.

Requeueing under SLURM has exactly one owner: submitit (through Hydra's submitit launcher). On preemption or
time-out submitit catches its signal (``USR2``), re-pickles the job and requeues it; a job requeued by any other
means (``scontrol requeue``, a preempting partition) simply starts again. Either way the local stage skips the
sub-domains whose ``done`` marker exists and resumes the interrupted one from ``local/<NN>/last.ckpt``. Lightning's own
SLURM auto-requeue does not exist in ddcnn's loop: its Fabric gets ddcnn's own cluster environments
(:mod:`ddcnn.engine.launch`), which never requeue, so there is one owner.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = [
    "SrunTask",
    "slurm_info",
    "srun_task",
    "shard",
    "execution_context",
    "load_average",
    "source_hash",
    "WORKERS_ENV",
    "GENERATION_ENV",
    "run_generation",
    "HARMLESS_WARNINGS",
    "quiet_process",
    "resolve_device",
    "HOST_MEMORY_ENV",
    "keep_freed_host_memory",
    "host_allocator",
]


def resolve_device(device: str | None, cuda_count: int | None = None) -> str:
    """The device a ``device`` setting names: ``auto`` is ``cuda`` when torch sees a CUDA device, else ``cpu``.

    ``auto`` never picks MPS (Apple GPUs): its kernels and numbers differ enough that it is opt-in (``device=mps``).
    The rule is :func:`ddcnn.parallel.devices.plan_workers`'s for ``parallel.accelerator=auto`` (a GPU when
    ``cuda_count > 0``), so that the local nets of parallel workers and the one-device stages (coarse DNN, global
    CNN) train on the same kind of device. ``None`` is ``cpu``; anything else is returned
    as given (``cpu``, ``cuda``, ``cuda:1``, ``mps``).

    Args:
        device: The setting (``cfg.device``).
        cuda_count: CUDA devices torch sees (default: asks torch); for tests and planning.
    """
    spec = "cpu" if device is None else str(device).strip()
    if spec.lower() != "auto":
        return spec
    if cuda_count is None:
        import torch

        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "cuda" if int(cuda_count) > 0 else "cpu"


# Set by the executors of ddcnn.parallel in each worker: how many trainings share this machine at once.
WORKERS_ENV = "DDCNN_CONCURRENT_TRAININGS"
# The run generation of this process and the processes it starts (see run_generation).
GENERATION_ENV = "DDCNN_RUN_GENERATION"

_INFO_KEYS = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "restart_count": "SLURM_RESTART_COUNT",
    "procid": "SLURM_PROCID",
    "ntasks": "SLURM_NTASKS",
    "partition": "SLURM_JOB_PARTITION",
    "nodelist": "SLURM_JOB_NODELIST",
}


def slurm_info() -> dict | None:
    """The SLURM job this process runs in (ids, restart count, rank), or ``None`` outside SLURM.

    ``restart_count`` is 0 on the first run and counts requeues, so a local net's meta shows whether it
    survived a preemption.
    """
    if "SLURM_JOB_ID" not in os.environ:
        return None
    info: dict = {"host": socket.gethostname()}
    for key, env in _INFO_KEYS.items():
        value = os.environ.get(env)
        info[key] = int(value) if value is not None and value.isdigit() else value
    info["restart_count"] = info["restart_count"] or 0
    return info


@dataclass(frozen=True)
class SrunTask:
    """Rank of this process among the tasks of one ``srun`` step."""

    rank: int
    ntasks: int
    local_rank: int = 0


def srun_task(mode: str = "auto") -> SrunTask | None:
    """This process's rank when it is one of several tasks of an ``srun`` step, else ``None``.

    Args:
        mode: ``auto`` detects ``srun`` with more than one task from ``SLURM_STEP_NUM_TASKS`` (set by ``srun``
            for its tasks, not in a batch script that merely asked for ``-n G``, whose single process must
            not train only a 1/G share); ``srun`` requires it; ``single`` never shards.
    """
    if mode not in ("auto", "srun", "single"):
        raise ValueError(f"parallel.mode must be auto, srun or single, got {mode!r}.")
    if mode == "single":
        return None
    ntasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "0") or 0)
    if ntasks > 1 and "SLURM_PROCID" in os.environ:
        return SrunTask(int(os.environ["SLURM_PROCID"]), ntasks, int(os.environ.get("SLURM_LOCALID", "0") or 0))
    if mode == "srun":
        raise ValueError(
            "parallel.mode=srun but this process is not one of several srun tasks (SLURM_STEP_NUM_TASKS is "
            f"{ntasks or 'unset'}); start it as `srun -n G ddcnn-train ...` inside an allocation."
        )
    return None


def shard(indices: Sequence[int], task: SrunTask) -> list[int]:
    """The sub-domains task ``rank`` of ``ntasks`` trains: those with ``i % ntasks == rank``."""
    return [i for i in indices if i % task.ntasks == task.rank]


def cpu_capability() -> str:
    """The vector instructions torch's CPU kernels use here (``AVX512``, ``AVX2``, ``DEFAULT``...): two machines that
    report one CPU model name may differ in them, and then so do their times and the rounding of their floats."""
    import torch

    get = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return str(get()) if get is not None else "unknown"


def execution_context(device: str | None = None, num_devices: int = 1, threads_by_design: str | None = None) -> dict:
    """The context a stage's time was measured in, recorded in its ``meta.json`` beside ``time_s``.

    Two times are comparable only when these agree: a local net trained on one thread beside another worker is
    not timed like a global CNN that had the machine's two cores to itself. What ddcnn chose by design is recorded as
    such and not held against the comparison (the coarse DNN's one thread, ``coarse.num_threads``).

    Args:
        device: The device the stage trained on (``cpu``, ``cuda:0``).
        num_devices: Devices one training spans (DDP), 1 otherwise.
        threads_by_design: The setting that chose this stage's CPU threads as part of the method, if any.
    """
    import torch

    workers = int(os.environ.get(WORKERS_ENV, "1") or 1)
    load = load_average()
    kind = torch.device(str(device or "cpu")).type
    context = {
        "device": str(device or "cpu"),
        "device_kind": kind,
        "num_devices": int(num_devices),
        "torch_threads": int(torch.get_num_threads()),
        "concurrent_trainings": workers,
        "cpu_count": os.cpu_count(),
        "cpu_capability": cpu_capability(),
        "host_allocator": host_allocator(),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        # What else ran: the machine's load average when the time was recorded (the end of the stage), over the last
        # 1, 5 and 15 minutes; other trainings beside this one (any process) show here. ``None`` where the OS has none.
        "load_avg": load,
        # The code that was timed (the package's source hash): a time of other code is another measurement.
        "code": source_hash(),
    }
    if threads_by_design:
        context["threads_by_design"] = str(threads_by_design)
    if kind == "cuda" and torch.cuda.is_available():
        index = torch.device(device).index or 0
        context["device_name"] = torch.cuda.get_device_name(index)
        context["device_kind"] = f"cuda ({context['device_name']})"
    task = srun_task("auto")
    if task is not None:
        context["srun_tasks"] = task.ntasks
    return context


def load_average() -> list[float] | None:
    """The machine's load average over the last 1, 5 and 15 minutes (rounded to 0.01), ``None`` where the OS has none
    (Windows)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


@functools.cache
def source_hash() -> str:
    """A hash of the ``ddcnn`` package's Python sources (their paths and contents), computed once per process: the
    version string stays 0.1.0 while the code changes, and a changed loop or model must not reuse older results nor be
    timed as the same code."""
    from pathlib import Path

    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


# --- a quiet console, set once per process entry (CLI, worker process, test session), never per training ---------
# Message patterns (regular expressions matched at the start) of warnings that say nothing for ddcnn's runs.
HARMLESS_WARNINGS = (
    # SLURM runs go through submitit or srun (ddcnn.parallel); an installed srun alone means nothing.
    r".*The `srun` command is available on your system",
    r".*isinstance\(treespec, LeafSpec\)",
    # GlobalBatchNorm's differentiable all-reduce (ddcnn.engine.sync_norm): its replacement has no autograd yet.
    r"torch.distributed.nn.functional.all_reduce is deprecated",
)
# Spawned DDP ranks start fresh interpreters: they read filters from PYTHONWARNINGS (a literal prefix each).
_ENV_PREFIXES = ("The `srun` command is available", "torch.distributed.nn.functional.all_reduce is deprecated")
# Lightning Fabric's info banners (the precision in use, the ranks of a process group) come through these; Fabric never
# sets their levels, so setting them before or after its import holds.
_BANNER_LOGGERS = (
    "lightning_fabric.utilities.rank_zero",
    "lightning_fabric.utilities.distributed",
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
)


def quiet_process(env: bool = True) -> None:
    """Lightning Fabric's info banners at WARNING and the harmless warnings off, for this whole process (idempotent).

    The console keeps what users read: progress bars on a terminal (one line per epoch in a log file), the one-line
    stage summaries and the results table.

    Args:
        env: Also add the filters to ``PYTHONWARNINGS``, so that processes this one spawns (DDP) inherit them.
    """
    for name in _BANNER_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for pattern in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    if env:
        current = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
        ours = [f"ignore:{prefix}" for prefix in _ENV_PREFIXES]
        os.environ["PYTHONWARNINGS"] = ",".join(dict.fromkeys(current + ours))


# ``DDCNN_HOST_MEMORY=return``: leave glibc's allocator as it is (:func:`keep_freed_host_memory`).
HOST_MEMORY_ENV = "DDCNN_HOST_MEMORY"
# glibc's malloc settings that keep freed memory in the process: no block of its own mapping (which ``free`` gives
# back to the OS at once), and up to 1 GiB free at the heap's top before it is trimmed.
_TRIM_BYTES = 1 << 30
_KEEP_TUNABLES = {"glibc.malloc.mmap_max": "0", "glibc.malloc.trim_threshold": str(_TRIM_BYTES)}
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (malloc.h)
_kept = False


@functools.cache
def _glibc():
    """The C library as a ``ctypes`` handle when it is glibc (``mallopt`` exists), else ``None``."""
    import ctypes

    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
        return ctypes.CDLL(None)
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), no such name (musl, macOS)
        return None


def keep_freed_host_memory() -> bool:
    """Have this process, and every process it starts from now on, keep the host memory it frees for reuse.

    glibc's ``malloc`` gives a block of 32 MiB or more (and above a threshold that starts at 128 KiB) its own mapping
    and returns it to the OS on ``free``; a training step frees its activations and allocates them again at the next
    step, so each step page-faults them back in, zeroed by the kernel. Measured on the CPU alone
    (``bench/host_memory.py``, the results page's nets, one thread): the kernel's share of a step was 30% for the 3D
    global CNN at 28³, 36% at 64³ (kept: 1.48x and 1.68x faster), 6-13% for the 2D and small 3D nets. Kept, the freed
    memory is reused; the price is a higher resident size (the peak stays resident, up to 1 GiB more is kept free at
    the heap's top).

    Called by :func:`ddcnn.pipeline.train` before anything starts: this process through ``mallopt``, the processes it
    starts (workers, spawned DDP ranks) through ``GLIBC_TUNABLES``, which glibc reads at their start, so that every
    stage of a run is timed under the same allocator (:func:`host_allocator`, in each stage's timing context). Only
    on glibc (Linux); elsewhere, or with ``DDCNN_HOST_MEMORY=return``, nothing changes.

    Returns:
        Whether freed memory is kept now.
    """
    global _kept
    if os.environ.get(HOST_MEMORY_ENV, "").strip().lower() == "return":
        return False
    libc = _glibc()
    if libc is None:
        return False
    if not _kept:
        _kept = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES))
    if _kept:
        given = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t]
        ours = [f"{k}={v}" for k, v in _KEEP_TUNABLES.items()]
        os.environ["GLIBC_TUNABLES"] = ":".join([t for t in given if t.split("=")[0] not in _KEEP_TUNABLES] + ours)
    return _kept


def host_allocator() -> str:
    """How this process's host allocator treats freed memory: ``glibc, freed memory kept`` (this process called
    :func:`keep_freed_host_memory`, or it was started with its ``GLIBC_TUNABLES``), ``glibc`` (as it comes), or
    ``other`` (not glibc): the same training differs in CPU time by up to 1.7x between the first two."""
    if _glibc() is None:
        return "other"
    tunables = dict(t.split("=", 1) for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if "=" in t)
    started_kept = all(tunables.get(k) == v for k, v in _KEEP_TUNABLES.items())
    return "glibc, freed memory kept" if _kept or started_kept else "glibc"


def run_generation(configured: str | None = None) -> str:
    """The id of this attempt at a run: ``done`` markers record it, so that ``force=true`` never takes a marker of
    an earlier attempt for one of this one.

    From, in order: ``configured`` (the run's ``run_generation``; ``ddcnn-slurm`` sets one for all its jobs), the
    ``DDCNN_RUN_GENERATION`` environment variable, the SLURM step (every ``srun`` task of one step shares it), the
    SLURM array (every task of one array shares it), else a fresh id: :func:`ddcnn.pipeline.train` draws one per call
    and puts it into the configuration that its worker processes receive.
    """
    import uuid

    if configured:
        return str(configured)
    if os.environ.get(GENERATION_ENV):
        return os.environ[GENERATION_ENV]
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job and srun_task("auto") is not None:
        generation = f"slurm-{job}.{os.environ.get('SLURM_STEP_ID', '0')}"
    elif os.environ.get("SLURM_ARRAY_JOB_ID"):
        generation = f"slurm-array-{os.environ['SLURM_ARRAY_JOB_ID']}"
    else:
        generation = uuid.uuid4().hex[:12]
    return generation
