"""P worker processes on one machine (CPU, P=2): placement, failures, reruns; the parent's bookkeeping."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ddcnn.context import subdomain_seed
from ddcnn.parallel.devices import WorkerDevice
from ddcnn.parallel.workers import LocalStageFailed, _Session, record_failure, wait_for_local
from ddcnn.pipeline import train
from ddcnn.rundir import RunDir


@pytest.mark.slow
def test_two_workers_train_all_report_a_failure_and_a_rerun_trains_only_it(make_cfg):
    cfg = make_cfg("stage=local", "parallel.workers=2", "parallel.threads_per_worker=1")
    run = RunDir(cfg.paths.run_dir)
    # Sub-domain 1 cannot save its predictions (a directory sits where the file goes): it must fail, alone.
    blocker = run.stage_dir("local", 1) / "probs_train.pt"
    blocker.mkdir(parents=True)
    with pytest.raises(LocalStageFailed, match=r"sub-domain 1 \(worker [01] \(cpu, 1 thread\)\)") as info:
        train(cfg)
    assert "local/01/error.log" in str(info.value) and "run the same command again" in str(info.value)
    assert run.missing_local(4) == [1]
    assert "Traceback" in (run.stage_dir("local", 1) / "error.log").read_text()

    report = json.loads((run.root / "parallel.json").read_text())
    workers = report["workers"]
    assert [(w["device"], w["threads"]) for w in workers] == [("cpu", 1), ("cpu", 1)]
    assert sorted(i for w in workers for i in w["subdomains"]) == [0, 1, 2, 3]
    assert sorted(i for w in workers for i in w["finished"]) == [0, 2, 3]
    for w in workers:
        assert w["images_per_s"] > 0 and w["predicted_s"] > 0 and w["actual_s"] > 0 and w["startup_s"] > 0
        assert w["data"] == "shared"  # the parent's prepared tensors, not read and prepared again
    assert [f["subdomain"] for f in report["failures"]] == [1]
    metas = {i: run.meta("local", i) for i in (0, 2, 3)}
    assert {m["subdomain"] for m in metas.values()} == {0, 2, 3}

    # Fixed: the same command (here in this process) trains sub-domain 1 only.
    blocker.rmdir()
    stamps = {i: (run.stage_dir("local", i) / "done").stat().st_mtime_ns for i in (0, 2, 3)}
    out = train(make_cfg("stage=local"))
    assert [m["subdomain"] for m in out["local"]] == [0, 1, 2, 3]
    assert run.missing_local(4) == []
    assert stamps == {i: (run.stage_dir("local", i) / "done").stat().st_mtime_ns for i in (0, 2, 3)}
    assert not (run.stage_dir("local", 1) / "error.log").exists()
    # The results do not depend on where a net trained: same seed per sub-domain in every process.
    assert out["local"][0]["seed"] == metas[0]["seed"]


@pytest.mark.slow
def test_workers_map_the_parents_store_entry_and_train_the_same_nets(make_cfg, tmp_path):
    mapped = make_cfg("stage=local", "parallel.workers=2", "parallel.threads_per_worker=1", "data.memory.mode=mapped")
    train(mapped)
    run = RunDir(mapped.paths.run_dir)
    workers = json.loads((run.root / "parallel.json").read_text())["workers"]
    assert [w["data"] for w in workers] == ["mapped", "mapped"]  # the entry's files, not a copy of the tensors
    meta = run.meta("local", 0)
    assert meta["data"]["holding"] == "mapped" and meta["data"]["store_entry"]
    # In memory, in this process (with the same number of threads: reductions depend on it): the same numbers.
    memory = make_cfg(
        "stage=local",
        "subdomain=[0,3]",
        "data.memory.mode=memory",
        "parallel.threads_per_worker=1",
        run_dir=tmp_path / "m",
    )
    threads = torch.get_num_threads()
    try:
        train(memory)
    finally:
        torch.set_num_threads(threads)  # parallel.threads_per_worker applies to this process: later tests keep theirs
    for i in (0, 3):
        a = RunDir(memory.paths.run_dir).load_probs("local", "test", i)["logits"]
        assert torch.equal(a, run.load_probs("local", "test", i)["logits"])


@pytest.mark.slow
def test_a_worker_whose_main_thread_hangs_is_named_and_stopped_within_the_timeout(make_cfg):
    """Its heartbeat thread still beats; the parent sees that the main thread no longer moves."""
    timeout_s = 5
    cfg = make_cfg(
        "stage=local",
        "subdomain=[0,1]",
        "parallel.workers=2",
        "parallel.threads_per_worker=1",
        "parallel.calibration_steps=0",
        f"parallel.heartbeat_timeout_s={timeout_s}",
        "seed=0",
        "model._target_=tests.parallel.hanging_net.vgg_tiny_hanging_on",
        f"+model.hang_seed={subdomain_seed(0, 1)}",
    )
    run = RunDir(cfg.paths.run_dir)
    with pytest.raises(LocalStageFailed, match=r"sub-domain 1 \(worker [01]") as info:
        train(cfg)
    assert [f["subdomain"] for f in info.value.failures] == [1]
    error = info.value.failures[0]["error"]
    assert "main thread made no progress" in error and "hanging_net.py" in error, error
    assert "while training this sub-domain" in (run.stage_dir("local", 1) / "error.log").read_text()
    assert run.is_done("local", 0) and not run.is_done("local", 1)  # the other worker finished its share
    # Killed within the timeout plus a look at the main thread (1 s) and a poll of the parent (0.5 s) of the hang.
    stuck_s = int(re.search(r"no progress for (\d+) s", error).group(1))
    assert timeout_s <= stuck_s <= timeout_s + 3, error


class _FakePool:
    def __init__(self, n: int) -> None:
        self.started = time.perf_counter()
        self.task_qs = [queue.Queue() for _ in range(n)]


def _ready(images_per_s: float, kind: str = "cpu") -> dict:
    costs = {i: 81.0 * 1000 for i in range(6)}
    return {"kind": kind, "images_per_s": images_per_s, "pixels_per_image": 81, "costs": costs}


def test_identical_workers_split_evenly_whatever_the_calibration_noise(tmp_path):
    devices = [WorkerDevice(0, "cpu", 1), WorkerDevice(1, "cpu", 1)]
    session, pool = _Session(devices, list(range(6)), RunDir(tmp_path)), _FakePool(2)
    session.handle("ready", 0, _ready(1000.0), pool)
    session.handle("ready", 1, _ready(1400.0), pool)
    assert len(pool.task_qs[0].get_nowait()) == len(pool.task_qs[1].get_nowait()) == 3


def test_placement_follows_calibrated_speed_and_a_dead_worker_is_reported(tmp_path):
    devices = [WorkerDevice(0, "cuda:0", 4), WorkerDevice(1, "cuda:1", 4)]
    session, pool = _Session(devices, list(range(6)), RunDir(tmp_path)), _FakePool(2)
    session.handle("ready", 0, _ready(1000.0, "an older GPU"), pool)
    assert session.placed is None  # waits for every worker before placing
    session.handle("ready", 1, _ready(3000.0, "a newer GPU"), pool)
    fast, slow = pool.task_qs[1].get_nowait(), pool.task_qs[0].get_nowait()
    assert len(fast) > len(slow) and sorted(fast + slow) == list(range(6))

    first = slow[0]
    session.handle("start", 0, first, pool)
    session.handle("died", 0, -9, pool)
    lost = {f["subdomain"]: f for f in session.failures}
    assert set(lost) == set(slow)
    assert "killed by SIGKILL" in lost[first]["error"] and lost[first]["log"]  # the signal, by name
    assert "while training" in (tmp_path / "local" / f"{first:02d}" / "error.log").read_text()
    assert all(lost[i]["error"].startswith("not started") for i in slow[1:])
    report = session.report(1.0, {"steps": 5})
    assert report["workers"][1]["subdomains"] == fast and report["workers"][1]["predicted_s"] > 0


def test_a_worker_that_cannot_start_leaves_the_work_to_the_others(tmp_path):
    devices = [WorkerDevice(0, "cpu", 1), WorkerDevice(1, "cpu", 1)]
    session, pool = _Session(devices, list(range(6)), RunDir(tmp_path)), _FakePool(2)
    session.handle("crashed", 0, "Traceback ...", pool)
    session.handle("ready", 1, _ready(1000.0), pool)
    assert sorted(pool.task_qs[1].get_nowait()) == list(range(6))
    assert pool.task_qs[0].empty() and session.failures == []


def test_no_worker_at_all_fails_every_subdomain(tmp_path):
    session, pool = _Session([WorkerDevice(0, "cpu", 1)], [3, 5], RunDir(tmp_path)), _FakePool(1)
    session.handle("died", 0, 1, pool)
    assert [f["subdomain"] for f in session.failures] == [3, 5]
    message = str(LocalStageFailed(session.failures, tmp_path))
    assert "2 local net(s) failed" in message and "sub-domain 3 (no worker)" in message


def test_rank_zero_waits_for_the_other_srun_tasks_and_stops_at_their_failure(tmp_path):
    run = RunDir(tmp_path)
    for i in (0, 2):
        run.stage_dir("local", i).mkdir(parents=True)
        run.mark_done("local", i, {"subdomain": i})
    wait_for_local(run, [0, 2], poll_s=0.01)  # all there: returns at once
    with pytest.raises(TimeoutError, match=r"local nets \[1, 3\] did not finish"):
        wait_for_local(run, [0, 1, 2, 3], poll_s=0.01, timeout_s=0.05)
    since = time.time() - 1
    record_failure(run, 3, "srun task 1/2 (cpu)\nTraceback ...\nRuntimeError: out of memory")
    with pytest.raises(LocalStageFailed, match=r"sub-domain 3 \(another srun task\): RuntimeError: out of memory"):
        wait_for_local(run, [0, 1, 2, 3], since=since, poll_s=0.01, timeout_s=5)
    # A failure log older than this wait belongs to an earlier attempt that is being retried.
    with pytest.raises(TimeoutError):
        wait_for_local(run, [0, 1, 2, 3], since=time.time() + 10, poll_s=0.01, timeout_s=0.05)


@pytest.mark.slow
def test_the_parent_of_the_workers_never_imports_the_training_engine(tmp_path):
    """The coordinating process only checks, places and collects: it starts in seconds, without Fabric's import."""
    script = textwrap.dedent(
        f"""
        import sys
        from tests.conftest import compose_config
        from ddcnn.pipeline import train
        cfg = compose_config(["stage=local", "subdomain=[0,1]", "parallel.workers=2",
                              "parallel.threads_per_worker=1"], run_dir={str(tmp_path / "run")!r})
        metas = train(cfg)["local"]
        engine = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "lightning_fabric", "torchmetrics"))
        print("trained", sorted(m["subdomain"] for m in metas), engine)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained [0, 1] []" in proc.stdout
    assert RunDir(tmp_path / "run").is_done("local", 1)
