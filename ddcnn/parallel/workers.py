"""Where the local stage runs: in this process, in P worker processes on this machine, or as ``srun`` tasks.

:func:`run_local_stage` is the local-stage dispatch of :func:`ddcnn.pipeline.train`:

- one of several ``srun`` tasks (``SLURM_STEP_NUM_TASKS > 1``, or ``parallel.mode=srun``): train the share
  ``i % ntasks == rank`` in this process; rank 0 then waits for every other task's nets;
- ``parallel.workers=P > 1``: :func:`run_local_parallel` starts P processes (spawn: forking a process that
  has initialised torch's threads or CUDA is unsafe), each owning one device from
  :func:`ddcnn.parallel.devices.plan_workers`. Every worker takes the data the parent prepared
  (its tensors in shared memory, or the memory-mapped store entry: one copy), measures its speed
  (:func:`ddcnn.parallel.schedule.calibrate`), and trains the sub-domains the LPT placement gives it;
- otherwise: one sub-domain after another in this process.

A sub-domain that fails is recorded (which one, on which worker, why; the traceback in
``local/<NN>/error.log``), the other sub-domains still train, and the call then raises
:class:`LocalStageFailed` naming them. A worker that dies is named with its signal; one that stops
reporting, or whose main thread stops moving (:mod:`ddcnn.parallel.heartbeat`), is killed after
``parallel.heartbeat_timeout_s``. Finished sub-domains have ``done`` markers, so running the same
command again trains only what is missing. Why this is not ``concurrent.futures.ProcessPoolExecutor``
(measured): ``docs/slurm.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

from ddcnn import registry
from ddcnn.io import atomic_write_json, atomic_write_text
from ddcnn.parallel.devices import WorkerDevice, configure_process, plan_workers, process_device
from ddcnn.parallel.heartbeat import MainThreadWatch, beat
from ddcnn.rundir import RunDir
from ddcnn.runtime import WORKERS_ENV, quiet_process, run_generation, shard, srun_task
from ddcnn.settings import RunSettings

log = logging.getLogger(__name__)

__all__ = ["LocalStageFailed", "run_local_stage", "run_local_parallel", "wait_for_local"]

ERROR_LOG = "error.log"
# Seconds per local net that do not scale with its size (Trainer set-up, checkpoint and prediction files).
NET_OVERHEAD_S = 1.0


class LocalStageFailed(RuntimeError):
    """Some local nets failed; the others finished. ``failures`` holds one dict per failed sub-domain."""

    def __init__(self, failures: list[dict], run_root: Path) -> None:
        self.failures = sorted(failures, key=lambda f: f["subdomain"])
        lines = [
            f"  sub-domain {f['subdomain']} ({f['where']}): {f['error']}"
            + (f"  [traceback: {f['log']}]" if f.get("log") else "")
            for f in self.failures
        ]
        super().__init__(
            f"{len(self.failures)} local net(s) failed in {run_root}; the others finished:\n"
            + "\n".join(lines)
            + "\nFix the cause and run the same command again: finished sub-domains are skipped."
        )


def record_failure(run: RunDir, subdomain: int, text: str) -> Path:
    """Write the traceback of a failed local net to ``local/<NN>/error.log`` (removed when it later succeeds)."""
    path = run.stage_dir("local", subdomain) / ERROR_LOG
    atomic_write_text(path, text)
    return path


def _train_one(ctx, subdomain: int, device: str, where: str) -> tuple[dict | None, dict | None]:
    """Train one local net; return ``(meta, None)`` or ``(None, failure)`` instead of raising."""
    error_log = ctx.run.stage_dir("local", subdomain) / ERROR_LOG
    error_log.unlink(missing_ok=True)
    try:
        return registry.run("local", ctx, device, subdomain=subdomain), None
    except Exception as err:
        path = record_failure(ctx.run, subdomain, f"{where}\n{traceback.format_exc()}")
        log.error("local %d failed on %s: %s: %s (traceback in %s)", subdomain, where, type(err).__name__, err, path)
        return None, {"subdomain": subdomain, "where": where, "error": f"{type(err).__name__}: {err}", "log": str(path)}


# --- dispatch ------------------------------------------------------------------------------------
def run_local_stage(ctx, indices: list[int], pool: _Pool | None = None) -> list[dict]:
    """Train local nets ``indices`` of ``ctx`` where the configuration and the environment say (see module doc).

    ``indices``: sub-domains of the decomposition (:func:`ddcnn.pipeline.train` refuses any other before it claims
    the run directory). ``pool``: workers :func:`start_workers_early` started before the data was loaded.

    Returns:
        The metadata of the local nets this process trained or found finished (every one of ``indices``,
        except on ``srun`` ranks other than 0, which return their share).
    """
    settings = ctx.settings
    task = srun_task(settings.parallel.mode)
    if task is not None:
        # The tasks of this step on this node train side by side: their times say so (meta.json context).
        per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").split("(")[0].split(",")[0]
        os.environ[WORKERS_ENV] = per_node if per_node.isdigit() else str(task.ntasks)
        mine = shard(indices, task)
        device = process_device(settings.device, settings.parallel.threads_per_worker, task.local_rank)
        where = f"srun task {task.rank}/{task.ntasks} ({device})"
        log.info("%s: trains sub-domains %s", where, mine)
        started = time.time()
        trained = [_train_one(ctx, i, device, where) for i in mine]
        if failures := [failure for _, failure in trained if failure is not None]:
            raise LocalStageFailed(failures, ctx.run.root)
        if task.rank != 0:
            return [meta for meta, _ in trained]
        # With force=true only this generation's markers count: a peer may not have reached (and cleared) a net yet.
        generation = run_generation(settings.run_generation) if settings.force else None
        wait_for_local(ctx.run, indices, since=started, generation=generation)
        return [ctx.run.meta("local", i) for i in indices]
    if settings.parallel.workers > 1:
        return run_local_parallel(settings, ctx.run.root, indices, data=ctx.data, pool=pool)
    device = process_device(settings.device, settings.parallel.threads_per_worker)
    metas = []
    for i in indices:
        metas.append(registry.run("local", ctx, device, subdomain=i))
        (ctx.run.stage_dir("local", i) / ERROR_LOG).unlink(missing_ok=True)  # an earlier failure is history
    return metas


def wait_for_local(
    run: RunDir,
    indices: list[int],
    since: float = 0.0,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    generation: str | None = None,
) -> None:
    """Block until every local net of ``indices`` is done (rank 0 of an ``srun`` step waits for the others).

    With ``generation``, only ``done`` markers of that run generation count (``force=true``: a marker of the
    previous attempt is never taken for a new one).

    Raises:
        LocalStageFailed: As soon as a missing net has an ``error.log`` written after ``since``.
        TimeoutError: After ``timeout_s`` seconds, naming the nets still missing.
    """
    start = time.monotonic()
    while True:
        missing = [i for i in indices if not run.is_done("local", i, generation)]
        if not missing:
            return
        failed = []
        for i in missing:
            path = run.stage_dir("local", i) / ERROR_LOG
            if path.is_file() and path.stat().st_mtime >= since:
                first = path.read_text().splitlines()[-1] if path.stat().st_size else "failed"
                failed.append({"subdomain": i, "where": "another srun task", "error": first, "log": str(path)})
        if failed:
            raise LocalStageFailed(failed, run.root)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"local nets {missing} did not finish in {run.root} within {timeout_s:.0f} s.")
        time.sleep(poll_s)


# --- P workers on this machine -------------------------------------------------------------------
def _worker_costs(ctx) -> dict[int, float]:
    """Cost of every sub-domain of ``ctx`` in pixel-samples (:func:`ddcnn.parallel.schedule.local_costs`)."""
    from ddcnn.parallel.schedule import local_costs, train_samples_per_epoch

    dec, data, trainer = ctx.decomposition, ctx.data, ctx.settings.loop
    pixels = {i: math.prod(s.stop - s.start for s in dec.box(i)) for i in range(dec.num_subdomains)}
    n = {s: len(data.y[s]) for s in ("train", "val", "test")}
    per_epoch = train_samples_per_epoch(n["train"], ctx.settings.data.batch_size, trainer.limit_train_batches)
    return local_costs(pixels, per_epoch, n["val"], trainer.max_epochs, sum(n.values()))


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this worker when its parent dies, however it dies (Linux; elsewhere the heartbeat
    thread notices the new parent within a heartbeat)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _exit_now(result_q, heartbeat: threading.Thread, stop: threading.Event) -> None:
    """End a worker whose work is done and reported, without the interpreter's tear-down.

    Freeing the modules of a process that imported torch and the engine takes about 2 s of CPU (measured: 2.2 s on
    this project's 2-core machine), and the parent waits for it on the critical path of the local stage. Everything
    the worker wrote went through atomic writes and is on disk; what is left to flush (its last messages, its log
    lines) is flushed here first.
    """
    stop.set()
    heartbeat.join(timeout=5)
    result_q.close()
    result_q.join_thread()  # the feeder thread has written every message to the pipe
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _worker_main(
    wdev: WorkerDevice,
    settings: RunSettings,
    run_dir: str,
    calibration: dict,
    task_q,
    result_q,
    data=None,
    parent_pid: int = 0,
    heartbeat_s: float = 2.0,
) -> None:
    """Body of one worker process: set up, calibrate, report ready, then train what the parent sends.

    ``data`` is the parent's prepared data (its tensors in shared memory), or ``None`` to load it here. ``settings``
    are the parent's, checked there (the worker neither checks them again nor claims the run directory).
    """
    rank = wdev.rank
    _die_with_parent(parent_pid)
    stop, watch = threading.Event(), MainThreadWatch(wdev.device)
    heartbeat = threading.Thread(target=beat, args=(result_q, rank, parent_pid, heartbeat_s, stop, watch), daemon=True)
    heartbeat.start()
    try:
        configure_process(wdev)
        # log lines tagged with the worker; Fabric's per-run banners only at WARNING (P copies add nothing)
        logging.basicConfig(
            level=logging.INFO,
            format=f"[%(asctime)s][worker {rank}][%(name)s][%(levelname)s] - %(message)s",
            force=True,
        )
        quiet_process()
        import torch

        from ddcnn.context import build_local_net, open_context
        from ddcnn.parallel.schedule import calibrate

        if isinstance(data, str) and data == _FROM_QUEUE:
            # Started before the parent had the data: import the training side now, while the parent loads it.
            registry.load("local")
            with watch.waiting_for_parent():
                data = task_q.get()
        ctx = open_context(settings, run_dir, data=data, check=False)
        images_per_s = None
        if int(calibration.get("steps", 0)) > 0:
            net = build_local_net(ctx.settings, ctx.data)
            shape = (ctx.data.in_channels, *ctx.decomposition.sub_shape)
            batch = int(calibration["batch_size"])
            images_per_s = calibrate(net, shape, ctx.data.num_classes, batch, wdev.device, int(calibration["steps"]))
        ready = {
            "kind": torch.cuda.get_device_name(wdev.device) if wdev.device.startswith("cuda") else "cpu",
            "images_per_s": images_per_s,
            "pixels_per_image": math.prod(ctx.decomposition.sub_shape),
            "costs": _worker_costs(ctx),
            # The parent's prepared data: tensors in shared memory, or the store entry every worker maps.
            "data": "loaded" if data is None else "mapped" if getattr(data, "holding", None) == "mapped" else "shared",
        }
        result_q.put(("ready", rank, ready))
    except BaseException:
        result_q.put(("crashed", rank, traceback.format_exc()))
        return
    with watch.waiting_for_parent():
        subdomains = task_q.get()
    for i in subdomains:
        result_q.put(("start", rank, i))
        start = time.perf_counter()
        meta, failure = _train_one(ctx, i, wdev.device, wdev.describe())
        seconds = time.perf_counter() - start
        if failure is None:
            result_q.put(("done", rank, {"subdomain": i, "seconds": seconds, "time_s": meta["time_s"]}))
        else:
            result_q.put(("failed", rank, {**failure, "seconds": seconds}))
    result_q.put(("finished", rank, None))
    _exit_now(result_q, heartbeat, stop)


# The data argument of a worker started before the parent loaded the data: it comes through the task queue.
_FROM_QUEUE = "from-queue"


class _Pool:
    """The parent's view of the worker processes: start them, read their messages, notice deaths."""

    def __init__(
        self,
        devices: list[WorkerDevice],
        settings: RunSettings,
        run_dir: Path,
        calibration: dict,
        data=None,
        heartbeat_timeout_s: float = 300.0,
        startup_timeout_s: float = 600.0,
    ) -> None:
        import torch.multiprocessing as mp

        self.wall_start = time.perf_counter()
        self.handed = not (isinstance(data, str) and data == _FROM_QUEUE)  # the workers have (or load) their data
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        # Until it reports ready a worker is still starting (interpreter, torch, unpickling the data, calibration).
        self.startup_timeout_s = max(float(startup_timeout_s), self.heartbeat_timeout_s)
        self.ready: set[int] = set()
        heartbeat_s = max(0.2, min(5.0, self.heartbeat_timeout_s / 5))
        ctx = mp.get_context("spawn")
        self.result_q = ctx.Queue()
        self.task_qs = [ctx.Queue() for _ in devices]
        self.devices = devices
        self.started = time.perf_counter()
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(d, settings, str(run_dir), calibration, self.task_qs[d.rank], self.result_q, data),
                kwargs={"parent_pid": os.getpid(), "heartbeat_s": heartbeat_s},
                name=f"ddcnn-local-worker-{d.rank}",
                daemon=True,
            )
            for d in devices
        ]
        # Spawned children inherit the environment: every worker records how many trainings shared the machine.
        previous = os.environ.get(WORKERS_ENV)
        os.environ[WORKERS_ENV] = str(len(devices))
        try:
            for p in self.procs:
                p.start()
        finally:
            if previous is None:
                os.environ.pop(WORKERS_ENV, None)
            else:
                os.environ[WORKERS_ENV] = previous
        self.closed: set[int] = set()  # workers that said finished/crashed or died
        self.last_seen = {d.rank: time.monotonic() for d in devices}  # last message of any kind
        self.last_moved = dict(self.last_seen)  # last progress of the worker's main thread
        self.where: dict[int, str] = {}  # where its main thread was at the last heartbeat

    def messages(self, poll_s: float = 0.5):
        """Yield ``(kind, rank, payload)``; a worker that exits without a last word yields ``("died", rank, code)``."""
        while len(self.closed) < len(self.procs):
            yield from self._silent()
            try:
                msg = self.result_q.get(timeout=poll_s)
            except queue.Empty:
                for rank, p in enumerate(self.procs):
                    if rank not in self.closed and p.exitcode is not None:
                        # Its last messages may still be in flight: read them before declaring it dead.
                        time.sleep(poll_s)
                        yield from self._drain()
                        if rank not in self.closed:
                            self.closed.add(rank)
                            yield ("died", rank, p.exitcode)
                continue
            yield from self._handle(msg)

    def _drain(self):
        while True:
            try:
                msg = self.result_q.get_nowait()
            except queue.Empty:
                return
            yield from self._handle(msg)

    def _silent(self):
        """Workers silent, or whose main thread made no progress, for ``heartbeat_timeout_s`` (``startup_timeout_s``
        until they are ready): killed and reported as ``("hung", rank, reason)``."""
        now = time.monotonic()
        for rank, p in enumerate(self.procs):
            if rank in self.closed or p.exitcode is not None:
                continue
            limit = self.heartbeat_timeout_s if rank in self.ready else self.startup_timeout_s
            silent, stuck = now - self.last_seen[rank], now - self.last_moved[rank]
            if silent > limit:
                reason = f"worker stopped reporting for {silent:.0f} s (stopped or frozen) and was killed"
            elif stuck > limit:
                where = self.where.get(rank, "-")
                reason = f"worker's main thread made no progress for {stuck:.0f} s (hung at {where}) and was killed"
            else:
                continue
            p.kill()
            p.join(timeout=10)
            self.closed.add(rank)
            yield ("hung", rank, reason)

    def _handle(self, msg):
        kind, rank, payload = msg
        now = time.monotonic()
        self.last_seen[rank] = now
        if kind == "alive":
            self.last_moved[rank] = max(self.last_moved[rank], now - payload["stuck_s"])
            self.where[rank] = payload["where"]
            return
        self.last_moved[rank] = now
        if kind == "ready":
            self.ready.add(rank)
        if kind in ("finished", "crashed"):
            self.closed.add(rank)
        yield msg

    def close(self) -> None:
        if not self.handed:  # started early, and the caller failed before it had data for them: nothing to wait for
            for p in self.procs:
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        for p in self.procs:  # only ours, by handle: a worker stuck after its last message
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def _todo(settings: RunSettings, run: RunDir, indices: list[int]) -> list[int]:
    """The sub-domains of ``indices`` that must train (not done, or done in an earlier generation with force)."""
    generation = run_generation(settings.run_generation) if settings.force else None
    return [i for i in dict.fromkeys(indices) if not run.is_done("local", i, generation)]


def _start_pool(settings: RunSettings, run_dir: Path, todo: list[int], data) -> _Pool:
    parallel = settings.parallel
    devices = plan_workers(min(parallel.workers, len(todo)), parallel.accelerator, parallel.threads_per_worker)
    calibration = {"steps": parallel.calibration_steps, "batch_size": settings.data.batch_size}
    # No progress bars in workers: P bars on one terminal garble.
    settings = dataclasses.replace(settings, loop=dataclasses.replace(settings.loop, enable_progress_bar=False))
    pool = _Pool(
        devices,
        settings,
        run_dir,
        calibration,
        data,
        heartbeat_timeout_s=parallel.heartbeat_timeout_s,
        startup_timeout_s=parallel.startup_timeout_s,
    )
    pool.calibration = calibration
    return pool


def start_workers_early(settings: RunSettings, run_dir: str | Path, indices: list[int]) -> _Pool | None:
    """Start the worker processes of the local stage before the caller loads the data, or ``None`` when this
    process will not use workers (``parallel.workers`` <= 1, an ``srun`` task, nothing to train).

    Each worker's start-up (Python, torch, Lightning Fabric, the stage modules) then overlaps the parent's loading and
    preparing of the data; :func:`run_local_parallel` hands them the data through their queues.
    """
    if settings.parallel.workers <= 1 or srun_task(settings.parallel.mode) is not None:
        return None
    todo = _todo(settings, RunDir(run_dir), indices)
    if not todo:
        return None
    pool = _start_pool(settings, Path(run_dir), todo, _FROM_QUEUE)
    pool.todo = todo
    return pool


def run_local_parallel(
    settings: RunSettings,
    run_dir: str | Path,
    indices: list[int],
    data=None,
    pool: _Pool | None = None,
) -> list[dict]:
    """Train local nets ``indices`` in ``parallel.workers`` processes, each owning one device; see the module doc.

    Each worker builds its own context from ``data`` (the caller's prepared data, whose tensors move to shared
    memory: one copy for all workers, nothing read or prepared twice) or, when ``data`` is ``None``, by loading the
    data itself. It measures its images/s and reports the cost of every sub-domain; the parent then places the
    sub-domains (LPT on the calibrated speeds) and collects the results. ``parallel.json`` in the run directory
    records devices, speeds, the placement, predicted against actual time per worker, and failures.

    Returns:
        The metadata of every local net of ``indices`` (trained now or finished before).

    Raises:
        LocalStageFailed: When some sub-domains failed (after the others finished).
    """
    run = RunDir(run_dir)
    wall_start = time.perf_counter() if pool is None else pool.wall_start
    if pool is not None:  # started before the data was loaded: hand it over now
        todo, calibration, devices = pool.todo, pool.calibration, pool.devices
        for q in pool.task_qs:
            q.put(data)
        pool.handed = True
    else:
        todo = _todo(settings, run, indices)
        if not todo:
            log.info("local nets %s: all finished earlier, skipped (force=true recomputes)", list(indices))
            return [run.meta("local", i) for i in indices]
        pool = _start_pool(settings, run.root, todo, data)
        calibration, devices = pool.calibration, pool.devices
    log.info("local stage: %d sub-domains on %s", len(todo), ", ".join(d.describe() for d in devices))
    session = _Session(devices, todo, run)
    try:
        for kind, rank, payload in pool.messages():
            session.handle(kind, rank, payload, pool)
    finally:
        pool.close()
    report = session.report(time.perf_counter() - wall_start, calibration)
    atomic_write_json(run.root / "parallel.json", report)
    for w in report["workers"]:
        log.info(
            "%s: sub-domains %s, predicted %s s, actual %.1f s (start-up %s s)",
            w["describe"],
            w["subdomains"],
            _fmt(w["predicted_s"]),
            w["actual_s"],
            _fmt(w["startup_s"]),
        )
    if session.failures:
        raise LocalStageFailed(session.failures, run.root)
    return [run.meta("local", i) for i in indices]


def _exit_reason(exitcode: int | None) -> str:
    """A worker's exit code in words: the signal that killed it, by name."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"worker process was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"worker process exited with code {exitcode}"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


class _Session:
    """The parent's bookkeeping of one parallel local stage: readiness, placement, progress, failures."""

    def __init__(self, devices: list[WorkerDevice], todo: list[int], run: RunDir) -> None:
        self.devices, self.todo, self.run = devices, todo, run
        self.ready: dict[int, dict] = {}
        self.gone: set[int] = set()  # crashed or died
        self.placed: dict[int, list[int]] | None = None  # rank -> sub-domains still to train, in order
        self.assignment: dict[int, list[int]] = {}  # rank -> sub-domains placed on it
        self.predicted: dict[int, float] = {}
        self.current: dict[int, int] = {}
        self.done: dict[int, list[int]] = {d.rank: [] for d in devices}
        self.busy_s: dict[int, float] = {d.rank: 0.0 for d in devices}
        self.failures: list[dict] = []
        self.costs: dict[int, float] = {}

    def handle(self, kind: str, rank: int, payload, pool: _Pool) -> None:
        where = self.devices[rank].describe()
        if kind == "ready":
            self.ready[rank] = {**payload, "startup_s": time.perf_counter() - pool.started}
            log.info(
                "%s ready after %.1f s, %s images/s",
                where,
                self.ready[rank]["startup_s"],
                _fmt(payload["images_per_s"]),
            )
        elif kind == "crashed":
            log.error("%s could not start:\n%s", where, payload)
            self.gone.add(rank)
        elif kind == "start":
            self.current[rank] = payload
        elif kind in ("done", "failed"):
            self.current.pop(rank, None)
            self.busy_s[rank] += payload["seconds"]
            self.placed[rank].remove(payload["subdomain"])
            if kind == "done":
                self.done[rank].append(payload["subdomain"])
            else:
                self.failures.append({k: v for k, v in payload.items() if k != "seconds"})
        elif kind == "died":
            self._died(rank, where, _exit_reason(payload))
        elif kind == "hung":
            self._died(rank, where, payload)
        if self.placed is None and len(self.ready) + len(self.gone) == len(self.devices):
            self._place(pool)

    def _died(self, rank: int, where: str, reason: str) -> None:
        self.gone.add(rank)
        log.error("%s: %s", where, reason)
        if self.placed is None or rank not in self.placed:
            return
        current = self.current.pop(rank, None)
        for i in self.placed[rank]:
            if i == current:
                path = record_failure(self.run, i, f"{where}\n{reason} while training this sub-domain\n")
                self.failures.append({"subdomain": i, "where": where, "error": reason, "log": str(path)})
            else:
                self.failures.append({"subdomain": i, "where": where, "error": f"not started: {reason}", "log": None})
        self.placed[rank] = []

    def _place(self, pool: _Pool) -> None:
        """LPT placement on the workers that came up, then send each its list."""
        from ddcnn.parallel.schedule import lpt

        self.placed = {}
        ranks = sorted(self.ready)
        if not ranks:
            self.failures += [
                {"subdomain": i, "where": "no worker", "error": "no worker process started", "log": None}
                for i in self.todo
            ]
            return
        self.costs = {i: self.ready[ranks[0]]["costs"][i] for i in self.todo}
        speeds = self._speeds(ranks)
        # Every worker starts training when it receives its list, all at once: no ready-time offsets.
        placement = lpt(self.costs, [speeds[r] for r in ranks], overhead_s=NET_OVERHEAD_S if speeds else 0.0)
        for k, r in enumerate(ranks):
            self.placed[r] = list(placement.assignment[k])
            if any(self.ready[q]["images_per_s"] for q in ranks):
                self.predicted[r] = placement.predicted_s[k]
            pool.task_qs[r].put(list(placement.assignment[k]))
        self.assignment = {r: list(placement.assignment[k]) for k, r in enumerate(ranks)}
        log.info("placement (LPT): %s", {self.devices[r].describe(): a for r, a in self.assignment.items()})

    def _speeds(self, ranks: list[int]) -> dict[int, float]:
        """Pixel-samples/s of each worker (the unit of the costs) from its calibrated images/s.

        Workers of one kind (same device model, threads and number of workers sharing the device) are the same
        device as far as placement can tell: they get their mean speed, so that measurement noise does not
        hand one of two identical CPU workers more nets than the other. A worker without a calibration
        counts as the mean of all (all alike when calibration is off).
        """
        sharing = Counter(self.devices[r].device for r in ranks)
        groups: dict[tuple, list[float]] = {}
        kind = {r: (self.ready[r]["kind"], self.devices[r].threads, sharing[self.devices[r].device]) for r in ranks}
        for r in ranks:
            if self.ready[r]["images_per_s"]:
                groups.setdefault(kind[r], []).append(self.ready[r]["images_per_s"])
        measured = [v for vs in groups.values() for v in vs]
        overall = sum(measured) / len(measured) if measured else 1.0
        mean = {k: sum(v) / len(v) for k, v in groups.items()}
        return {r: mean.get(kind[r], overall) * self.ready[r]["pixels_per_image"] for r in ranks}

    def report(self, wall_s: float, calibration: dict) -> dict:
        workers = [
            {
                **d.as_dict(),
                "describe": d.describe(),
                "images_per_s": self.ready.get(d.rank, {}).get("images_per_s"),
                "startup_s": self.ready.get(d.rank, {}).get("startup_s"),
                "data": self.ready.get(d.rank, {}).get("data"),
                "subdomains": self.assignment.get(d.rank, []),
                "predicted_s": self.predicted.get(d.rank),
                "actual_s": self.busy_s[d.rank],
                "finished": self.done[d.rank],
            }
            for d in self.devices
        ]
        return {
            "placement": "lpt",
            "net_overhead_s": NET_OVERHEAD_S,
            "calibration": calibration,
            "cost_pixel_samples": {str(i): c for i, c in self.costs.items()},
            "workers": workers,
            "wall_s": wall_s,
            "failures": sorted(self.failures, key=lambda f: f["subdomain"]),
        }
