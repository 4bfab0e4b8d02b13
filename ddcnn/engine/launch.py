"""Where and how one training runs: a Lightning Fabric for one device, for DDP spawned on this machine, or for DDP
across the tasks of an ``srun`` step, with its precision plugin and ddcnn's own cluster environments.

Every Fabric is given its cluster environment explicitly. Fabric would otherwise detect SLURM from ``SLURM_NTASKS``
and build its ``SLURMEnvironment``, which refuses a step started with ``srun -n G`` or ``--ntasks=G`` ("HINT: Use
``--ntasks-per-node``") even for a training on one device, and reads the job's task count rather than the step's.
:class:`SrunEnvironment` takes the world, the ranks and the rendezvous from the ``srun`` step itself, so every
``srun`` form works, on one node or several. Neither environment requeues: under SLURM, submitit owns requeueing
(:mod:`ddcnn.runtime`).

The precision plugin is built here too, so that ``16-mixed`` means float16 autocast with a loss scaler on every
device (Fabric, asked by name, silently runs ``bf16-mixed`` instead on CPU), and ``64-true`` keeps the network's
outputs in float64 for the loss.

A failure of one rank stops every rank (:func:`failures_stop_every_rank`): the failing rank records its error in the
process group's store, and every other rank, whether it is computing or waiting in a collective for the rank that is
gone, stops within seconds with that rank's message and traceback, instead of waiting out the process-group timeout
(10-30 minutes), spawned and ``srun`` alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

# lightning_utilities' compare_version imports a package to read its version, and lightning_fabric asks for
# torchmetrics' at import: torchmetrics imports torchvision's models and SciPy, about 2.5 s of CPU per process on the
# development machine (measured with -X importtime), for a flag only Fabric's SpikeDetection reads. Hidden while
# Fabric is imported, torchmetrics counts as absent; a later `import torchmetrics` works as usual.
if "torchmetrics" not in sys.modules and "lightning_fabric" not in sys.modules:
    sys.modules["torchmetrics"] = None  # type: ignore[assignment]
    try:
        import lightning_fabric  # noqa: F401
    finally:
        if sys.modules.get("torchmetrics", 0) is None:
            del sys.modules["torchmetrics"]

from lightning_fabric import Fabric  # noqa: E402
from lightning_fabric.plugins import Precision  # noqa: E402
from lightning_fabric.plugins.environments import ClusterEnvironment, LightningEnvironment  # noqa: E402
from lightning_fabric.plugins.environments.lightning import find_free_network_port  # noqa: E402
from lightning_fabric.plugins.precision import DoublePrecision, MixedPrecision  # noqa: E402
from lightning_fabric.strategies import DDPStrategy, SingleDeviceStrategy  # noqa: E402
from lightning_fabric.utilities.seed import seed_everything as _fabric_seed_everything  # noqa: E402

from ddcnn.engine.state import FitResult, cpu_state  # noqa: E402
from ddcnn.io import atomic_torch_save, load_run_file  # noqa: E402

__all__ = [
    "LAUNCHERS",
    "RankFailed",
    "SrunEnvironment",
    "build_fabric",
    "failures_stop_every_rank",
    "precision_plugin",
    "rendezvous_port",
    "isolated_launch",
    "fit_spawned",
    "fit_here",
    "exit_past_a_lingering_process_group",
    "seed_everything",
]

log = logging.getLogger(__name__)

# What a spawned DDP rank 0 hands back to the parent, in the training's folder (removed once read).
_SPAWN_RESULT = ".spawned_result.pt"
# What a failing spawned DDP rank hands to the parent, in the training's folder (removed once read).
_SPAWN_ERROR = ".spawned_error.{}.pt"

# How a training's processes start: this process on one device, DDP ranks spawned by this process, or the tasks of
# the srun step this process is one of.
LAUNCHERS = ("local", "spawn", "srun")
# Environment variables that launching (Fabric's spawn launcher, the process-group set-up) writes in this process.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")
# Whether this process took part in a DDP training across srun tasks (fit_here): its gloo process group then lingers
# to the interpreter's end (see _leave_process_group), where its release can abort the process.
_joined_srun_group = False


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,9],gpu1`` -> ``node03``, ``a,b`` -> ``a``."""
    head = ""
    depth = 0
    for ch in nodelist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            break
        head += ch
    if "[" not in head:
        return head.strip()
    prefix, _, rest = head.partition("[")
    first = rest.rstrip("]").split(",")[0].split("-")[0]
    return prefix + first


def seed_everything(seed: int) -> int:
    """Fabric's ``seed_everything`` without its log line: seeds Python's ``random``, NumPy's and torch's global
    generators with ``seed`` (0 to 2**32 - 1; Fabric refuses others) and sets ``PL_GLOBAL_SEED`` for spawned ranks."""
    return _fabric_seed_everything(seed, verbose=False)


def rendezvous_port(job_id: str | None, step_id: str | None) -> int:
    """The port the ranks of one ``srun`` step meet on: fixed by job and step, so every task computes the same one,
    and distinct for the steps of one allocation; below Linux's ephemeral range (32768-60999)."""
    job = int(job_id) if job_id and job_id.isdigit() else 0
    step = int(step_id) if step_id and step_id.isdigit() else 0
    return 15000 + (job * 97 + step) % 17000


class SrunEnvironment(ClusterEnvironment):
    """The tasks of the ``srun`` step this process is one of, as the ranks of one DDP training.

    World size, ranks and nodes come from the step (``SLURM_STEP_NUM_TASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``,
    ``SLURM_NODEID``), never from ``--ntasks-per-node``, so ``srun -n G``, ``--ntasks=G`` (``#SBATCH --ntasks=G``) and
    ``--ntasks-per-node=G`` work alike, on one node or several; the ranks meet on the step's first node at
    :func:`rendezvous_port` (``MASTER_ADDR`` / ``MASTER_PORT`` win when set). No requeueing (submitit owns it).
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True  # srun started them

    @property
    def main_address(self) -> str:
        if os.environ.get("MASTER_ADDR"):
            return os.environ["MASTER_ADDR"]
        nodes = (
            os.environ.get("SLURM_STEP_NODELIST")
            or os.environ.get("SLURM_JOB_NODELIST")
            or os.environ.get("SLURM_NODELIST")
            or "127.0.0.1"
        )
        return _first_host(nodes)

    @property
    def main_port(self) -> int:
        if os.environ.get("MASTER_PORT"):
            return int(os.environ["MASTER_PORT"])
        return rendezvous_port(os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID"))

    @staticmethod
    def detect() -> bool:
        return int(os.environ.get("SLURM_STEP_NUM_TASKS", "0") or 0) > 1 and "SLURM_PROCID" in os.environ

    def world_size(self) -> int:
        return int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ["SLURM_NTASKS"])

    def set_world_size(self, size: int) -> None:
        pass  # srun decided it

    def global_rank(self) -> int:
        return int(os.environ["SLURM_PROCID"])

    def set_global_rank(self, rank: int) -> None:
        pass  # srun decided it

    def local_rank(self) -> int:
        return int(os.environ.get("SLURM_LOCALID", "0") or 0)

    def node_rank(self) -> int:
        return int(os.environ.get("SLURM_NODEID", "0") or 0)


class _SpawnEnvironment(LightningEnvironment):
    """The ranks this process spawns: they live on this machine and meet on ``127.0.0.1`` at a free port, whatever
    ``MASTER_ADDR``/``MASTER_PORT`` the shell holds (a torchrun habit, another job's), so that neither sends them to
    another host nor makes two trainings on this machine (workers, each with DDP) meet on one port."""

    def __init__(self) -> None:
        super().__init__()
        self._port = find_free_network_port()

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return self._port


class _TaskDDPStrategy(DDPStrategy):
    """DDP whose rank trains on the one device ddcnn chose for this task (:func:`ddcnn.parallel.devices.process_device`:
    ``cuda:<local rank % visible GPUs>``, or the GPU ``--gpus-per-task`` left visible), not on the local rank's
    index into a list of the node's devices."""

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0]


class _Float64(DoublePrecision):
    """``64-true``: the network in float64, its inputs cast to float64, and its outputs left in float64 (Fabric's
    plugin casts them back to float32), so that the loss is computed in the network's dtype."""

    def convert_output(self, data: Any) -> Any:
        return data


def precision_plugin(precision: str, device: torch.device) -> Precision:
    """Fabric's plugin for ``32-true``, ``bf16-mixed``, ``16-mixed`` (with its loss scaler) or ``64-true`` on
    ``device``."""
    if precision == "32-true":
        return Precision()
    if precision == "64-true":
        if device.type == "mps":
            raise ValueError("trainer.precision=64-true: MPS has no float64; use device=cpu or a CUDA device for it.")
        return _Float64()
    if precision == "bf16-mixed":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"trainer.precision=bf16-mixed: {torch.cuda.get_device_name(device)} has no bfloat16 support; use "
                f"trainer.precision=16-mixed (float16 with a loss scaler) or 32-true."
            )
        return MixedPrecision("bf16-mixed", device=device.type)
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler(device.type)
        return MixedPrecision("16-mixed", device=device.type, scaler=scaler)
    raise ValueError(f"precision must be 32-true, bf16-mixed, 16-mixed or 64-true, got {precision!r}.")


def build_fabric(
    device: str | torch.device | None,
    num_devices: int = 1,
    launcher: str = "local",
    precision: str = "32-true",
) -> Fabric:
    """A Fabric for one training.

    Args:
        device: This process's device (``local``, ``srun``), or the first of the spawned ranks' devices (``spawn``:
            ``cuda:i`` .. ``cuda:i+P-1``, or ``P`` CPU processes).
        num_devices: DDP ranks (``spawn``: processes to start; ``srun``: must be this step's task count).
        launcher: ``local`` (one device, this process), ``spawn`` or ``srun`` (DDP, see :data:`LAUNCHERS`).
        precision: ``32-true``, ``bf16-mixed``, ``16-mixed`` or ``64-true``.
    """
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}.")
    plugin = precision_plugin(precision, device)
    if launcher == "local":
        if num_devices != 1:
            raise ValueError(f"the local launcher trains on one device, got num_devices={num_devices}.")
        return Fabric(
            accelerator=device.type,
            devices=1,
            strategy=SingleDeviceStrategy(device=device),
            plugins=[plugin, LightningEnvironment()],
        )
    if launcher == "spawn":
        if device.type == "cuda":
            first = device.index or 0
            devices: list[torch.device] = [torch.device("cuda", first + k) for k in range(num_devices)]
            missing = [d for d in devices if d.index >= torch.cuda.device_count()]
            if missing:
                raise ValueError(
                    f"DDP on {num_devices} GPUs from {device} needs {devices[-1]}, but torch sees "
                    f"{torch.cuda.device_count()} GPU(s): lower engine.num_devices (or methods.global_ddp.num_devices) "
                    f"or start from another device."
                )
        else:
            devices = [device] * num_devices
        strategy = DDPStrategy(parallel_devices=devices, cluster_environment=_SpawnEnvironment(), start_method="spawn")
        return Fabric(strategy=strategy, plugins=[plugin])
    environment = SrunEnvironment()
    if not environment.detect():
        raise ValueError(
            "DDP across srun tasks, but this process is not one of several tasks of an srun step; start it with "
            "srun -n G (one task per device) inside an allocation."
        )
    if environment.world_size() != num_devices:
        raise ValueError(
            f"DDP on {num_devices} devices, but this srun step has {environment.world_size()} tasks: run srun -n "
            f"{num_devices}, or train on {environment.world_size()} devices."
        )
    strategy = _TaskDDPStrategy(parallel_devices=[device], cluster_environment=environment, start_method="popen")
    nodes = int(os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    return Fabric(strategy=strategy, plugins=[plugin], num_nodes=nodes)


@contextlib.contextmanager
def isolated_launch() -> Iterator[None]:
    """Leave this process as it was after a launch: Fabric's launchers and the process-group set-up write
    ``MASTER_ADDR``/``MASTER_PORT``/``OMP_NUM_THREADS`` and set torch's threads to ``cores // processes``; the threads
    of this process are ddcnn's choice (:mod:`ddcnn.parallel.devices`), and a later training must not meet on a port
    an earlier one chose."""
    saved = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --- one rank's failure stops every rank ---------------------------------------------------------------------------
# The store key under which the first failing rank of a DDP training records itself; numbered per process, so that the
# trainings an srun step runs one after the other (the same sequence in every task) each have their own.
_FAILURE_KEY = "ddcnn.rank_failed/{}"
_trainings = itertools.count()


class RankFailed(RuntimeError):
    """Another rank of this DDP training failed first; its rank, message and traceback are here, so the run stops
    with them rather than with this rank's consequence (a collective whose peer is gone).

    Attributes:
        rank: The rank that failed first.
        traceback: Its traceback, as text.
    """

    def __init__(self, message: str, rank: int, traceback: str) -> None:
        super().__init__(message)
        self.rank, self.traceback = int(rank), traceback

    def __reduce__(self):  # picklable (a spawned rank raises it to the parent)
        return (type(self), (str(self), self.rank, self.traceback))


def _decode(value: bytes | str) -> tuple[int, str, str]:
    text = value.decode() if isinstance(value, bytes) else value
    rank, message, trace = text.split("\n", 2)
    return int(rank), message, trace


class _Failures:
    """The record of the first failing rank in the store of this process's default process group, and a watcher
    thread that stops this rank when another one failed (see :func:`failures_stop_every_rank`)."""

    def __init__(self, store, rank: int, world: int, key: str, poll_s: float, grace_s: float) -> None:
        self.store, self.rank, self.world, self.key = store, rank, world, key
        self.poll_s, self.grace_s = float(poll_s), float(grace_s)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="ddcnn-rank-watch", daemon=True)

    def first(self) -> tuple[int, str, str] | None:
        """``(rank, message, traceback)`` of the first failing rank, ``None`` while none failed."""
        if not self.store.check([self.key]):
            return None
        return _decode(self.store.get(self.key))

    def other_failed_first(self) -> bool:
        """Whether another rank's failure is on record (``False`` when the store cannot say: gone with rank 0)."""
        try:
            first = self.first()
        except Exception:
            return False
        return first is not None and first[0] != self.rank

    def record(self, err: BaseException) -> tuple[int, str, str]:
        """Record ``err`` as this rank's failure unless another rank's came first; the first one either way."""
        trace = "".join(traceback.format_exception(err))
        payload = f"{self.rank}\n{_one_line(err)}\n{trace}"
        return _decode(self.store.compare_set(self.key, "", payload))

    def _stop_rank(self, why: str) -> None:
        """Give the main thread ``grace_s`` to end the training on its own (a collective whose peer is gone raises
        on gloo), then end this process: it may be blocked in a collective that never returns (NCCL)."""
        if self.done.wait(self.grace_s):
            return
        sys.stderr.write(f"{why}\nrank {self.rank} stops.\n")
        sys.stderr.flush()
        logging.shutdown()
        os._exit(1)

    def _watch(self) -> None:
        unreachable_since = None
        while not self.done.wait(self.poll_s):
            try:
                first = self.first()
                unreachable_since = None
            except Exception as err:  # the store lives in rank 0's process: gone with it
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since >= self.grace_s:
                    self._stop_rank(f"the DDP training's store (rank 0's process) is unreachable: {err}")
                    return
                continue
            if first is not None and first[0] != self.rank:
                rank, message, trace = first
                log.error("rank %d of %d of the DDP training failed: %s\n%s", rank, self.world, message, trace)
                self._stop_rank(f"rank {rank} of the DDP training failed: {message}\n{trace}")
                return


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".replace("\n", " ")


@contextlib.contextmanager
def failures_stop_every_rank(fabric, poll_s: float = 0.5, grace_s: float = 5.0) -> Iterator[_Failures | None]:
    """Within the block (one DDP training in this rank), a failure of any rank stops every rank within seconds.

    An exception that leaves the block is recorded in the process group's store unless another rank's failure came
    first; then this rank raises :class:`RankFailed` with that rank's message and traceback (this rank's own error,
    typically a collective whose peer is gone, is its cause). Meanwhile a thread polls the store every ``poll_s``
    seconds: when another rank failed, it logs that rank's traceback, gives the training ``grace_s`` seconds to end on
    its own and then ends this process with exit status 1 (a rank blocked in a collective with a rank that is gone may
    never return). Yields the record (``None`` on one device or without a process group: nothing to stop).
    """
    import torch.distributed as dist

    if fabric.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        yield None
        return
    from torch.distributed.distributed_c10d import _get_default_store

    failures = _Failures(
        _get_default_store(),
        fabric.global_rank,
        fabric.world_size,
        _FAILURE_KEY.format(next(_trainings)),
        poll_s,
        grace_s,
    )
    failures.thread.start()
    try:
        yield failures
    except Exception as err:
        failures.done.set()
        first = None
        with contextlib.suppress(Exception):  # the store may be gone with rank 0: then the error stands as it is
            first = failures.first()
            if first is None:
                first = failures.record(err)
        if first is not None and first[0] != failures.rank:
            rank, message, trace = first
            raise RankFailed(f"rank {rank} of the DDP training failed: {message}", rank, trace) from err
        raise
    finally:
        failures.done.set()
        # No store call of the watcher may outlive the block: the process group (and its store) may go next.
        failures.thread.join(timeout=poll_s + 5.0)


# --- a training in DDP ranks: spawned by this process, or this srun task's rank --------------------------------
def run_spawned(fabric, training, prefit_s: float) -> str | None:
    """Body of a spawned DDP rank: rank 0 hands its result back to the parent (the weights as a CPU state dict).

    Through a file whose path is returned: Fabric's launcher reads rank 0's return value only after every rank
    exited, so a large one would block rank 0 on the full pipe forever, and a tensor sent through multiprocessing
    would be a handle to the memory of a process that is gone.

    A rank that fails writes its error to ``.spawned_error.<rank>.pt`` (unless another rank failed first: then its
    own error is that one's consequence) before the failure is recorded for the other ranks, and raises: its process
    ends with status 1, the launcher ends the others, and the parent raises the error of the rank that failed first
    (:func:`_spawned_failure`). The others stop within seconds anyway (:func:`failures_stop_every_rank`)."""
    with torch.no_grad():
        # The network arrived through multiprocessing, its tensors in memory shared with the other ranks (torch shares
        # what it sends): each rank must train its own copy, or every rank's step lands on the same weights.
        for tensor in itertools.chain(training.net.parameters(), training.net.buffers()):
            tensor.data = tensor.data.clone()
    path = Path(training.folder) / _SPAWN_RESULT
    with failures_stop_every_rank(fabric) as failures:
        try:
            result = training.run(fabric, prefit_s=prefit_s)
        except Exception as err:
            if failures is None or not failures.other_failed_first():
                _save_error(err, Path(training.folder) / _SPAWN_ERROR.format(fabric.global_rank), fabric.global_rank)
            raise
    if fabric.global_rank == 0:
        # Saved before the ranks part: a rank that dies after the barrier (below) cannot cost a finished training.
        # Plain values and tensors only, read back with weights_only=True.
        plain = dataclasses.asdict(dataclasses.replace(result, net=None))
        atomic_torch_save({"state": cpu_state(result.net), "result": plain}, path)
    # Every rank leaves the process group while its interpreter is whole. That is not enough: once a DDP module was
    # built, gloo's process group (and its worker threads) outlives it and destroy_process_group to the interpreter's
    # end, where its release can abort the process (SIGABRT, "terminate called without an active exception"),
    # rarely; the parent then finds rank 0's saved result and keeps it (fit_spawned).
    _leave_process_group(fabric)
    return str(path) if fabric.global_rank == 0 else None


def _save_error(err: Exception, path: Path, rank: int) -> None:
    """A rank's error for the parent: the exception itself (a ``RuntimeError`` with its message when it does not
    pickle) and its traceback."""
    trace = "".join(traceback.format_exception(err))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_torch_save({"error": err, "rank": rank, "traceback": trace}, path)
    except Exception:
        atomic_torch_save(
            {"error": RuntimeError(f"{type(err).__name__}: {err}"), "rank": rank, "traceback": trace}, path
        )


def _spawned_failure(folder: Path, launch_error: Exception) -> Exception:
    """What the parent raises when spawned ranks failed: the error of the rank that failed first (its traceback
    logged), as it was raised there; the error files are removed."""
    found = []
    for path in sorted(folder.glob(_SPAWN_ERROR.format("*"))):
        # The exceptions themselves (pickled): written by this training's own ranks after the stale files of earlier
        # trainings were removed (fit_spawned), so never a file a received run directory brought.
        with contextlib.suppress(Exception):
            found.append(torch.load(path, map_location="cpu", weights_only=False))
        path.unlink(missing_ok=True)
    (folder / _SPAWN_RESULT).unlink(missing_ok=True)  # rank 0 may have finished when another rank raised: not kept
    # The rank that failed first left its own error; a rank that met the same refusal did too (the lowest wins).
    found.sort(key=lambda out: (isinstance(out["error"], RankFailed), int(out["rank"])))
    if not found:
        return RuntimeError(
            f"a spawned DDP rank of the training in {folder} ended without reporting an error ({launch_error}); it "
            f"was likely killed (out of memory?). Run it again on fewer devices, or see the system log."
        )
    first = found[0]
    log.error("DDP rank %d of the training in %s failed:\n%s", first["rank"], folder, first["traceback"].rstrip())
    return first["error"]


def fit_spawned(fabric, training, net: nn.Module, start: float) -> FitResult:
    """:func:`fit_batches` in DDP ranks spawned by this process: rank 0's result, its weights loaded into ``net``."""
    folder = Path(training.folder)
    prefit = time.perf_counter() - start
    path = folder / _SPAWN_RESULT
    for stale in (*folder.glob(_SPAWN_ERROR.format("*")), path):  # an earlier attempt's: never taken for this one's
        stale.unlink(missing_ok=True)
    try:
        with isolated_launch():
            fabric.launch(run_spawned, training, prefit)
    except Exception as err:  # raised in a rank: here as there, its message intact
        if not path.exists() or any(folder.glob(_SPAWN_ERROR.format("*"))):
            raise _spawned_failure(folder, err) from None
        # Rank 0 saved its result only after every rank's training had finished (each took part in every collective
        # up to the last), and no rank reported an error: a rank died on its way out. The training stands.
        log.warning(
            "the DDP training in %s finished on every rank, then a rank's process ended abnormally (%s), at its "
            "exit, as gloo's process group is released there; the result rank 0 saved is kept",
            folder,
            err,
        )
    out = load_run_file(path, map_location="cpu")
    path.unlink(missing_ok=True)
    result = FitResult(**out["result"])
    net.load_state_dict(out["state"])
    # Spawning the ranks (interpreters, imports, the data), their rendezvous and tear-down: start-up, apart.
    wall = time.perf_counter() - start
    own = result.fit_time_s - result.previous_time_s
    result.startup_s = max(0.0, wall - own - result.warmup_s - result.hook_time_s - result.report_time_s)
    return dataclasses.replace(result, net=net)


def fit_here(fabric, training, launcher: str, began: float) -> FitResult:
    """:func:`fit_batches` in this process: on one device, or as this task's rank of DDP across ``srun`` tasks."""
    global _joined_srun_group
    with isolated_launch():
        fabric.launch()  # DDP across srun tasks: the ranks meet here
    _joined_srun_group = _joined_srun_group or (launcher == "srun" and fabric.world_size > 1)
    # Fabric's set-up and (srun) the rendezvous of the ranks: start-up, left out of the clock.
    training.startup_s = time.perf_counter() - began
    finished = False
    try:
        with failures_stop_every_rank(fabric):
            result = training.run(fabric)
        finished = True
        return result
    finally:
        if launcher == "srun":
            _leave_process_group(fabric, wait=finished)


def exit_past_a_lingering_process_group() -> None:
    """End this process now, with status 0, when it took part in a DDP training across srun tasks; else return.

    For ``ddcnn-train`` once its work is done and written: such a process's gloo process group lingers to the
    interpreter's end, and its release there can abort the process (SIGABRT, "terminate called without an active
    exception"; seen with spawned ranks, see :func:`fit_spawned`). Under ``srun --kill-on-bad-exit=1`` a task
    other than 0 that dies so after its share would end rank 0's evaluation, and rank 0 dying so fails the step of a
    finished run. The logs and standard streams are flushed first; the interpreter's teardown (``atexit`` handlers,
    C++ destructors) is skipped, which the library's callers never get: only the command line calls this.
    """
    if not _joined_srun_group:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _leave_process_group(fabric, wait: bool = True) -> None:
    """End this rank's part in the DDP training (an srun task's or a spawned rank's): the ranks wait for each other
    (``wait``: not after a failure, the others may never come), then the group is destroyed (a rank that goes on
    alone, rank 0 predicting, must not meet the others' collectives)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if wait:
            with contextlib.suppress(Exception):
                fabric.barrier()
        with contextlib.suppress(Exception) if not wait else contextlib.nullcontext():
            dist.destroy_process_group()
