"""Fault injection on one run directory: duplicate processes, killed and stopped workers, a killed parent.

Each test checks that nothing is lost or mixed: every sub-domain ends trained once, its ``net.pt`` reproduces its
``probs_test.pt``, and a rerun trains only what is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from ddcnn.context import build_context, build_local_net
from ddcnn.data.datamodule import TensorDataModule
from ddcnn.engine.common import predict_logits
from ddcnn.pipeline import train
from ddcnn.rundir import RunDir
from tests.conftest import compose_config

pytestmark = pytest.mark.slow

# Long enough to be interrupted (a few seconds per net), small enough for CI.
FAULT_OVERRIDES = [
    "model=vgg_tiny",
    "trainer.max_epochs=8",
    "trainer.limit_train_batches=null",
    "data.train_subset=500",
    "data.test_subset=100",
    "engine.checkpoint_every_s=0",
    "parallel.threads_per_worker=1",
    "report.plots=false",
    "report.export=false",
]


def _command(run_dir: Path, *overrides: str) -> list[str]:
    code = "import sys; from ddcnn.cli import train_main; sys.argv[0] = 'ddcnn-train'; train_main()"
    return [sys.executable, "-c", code, *FAULT_OVERRIDES, *overrides, f"hydra.run.dir={run_dir}"]


def _rerun_here(run_dir: Path, *overrides: str) -> None:
    """Run the same command again in this process (a rerun needs no process of its own: what it reads is on disk)."""
    train(compose_config([*FAULT_OVERRIDES, *overrides], run_dir, tiny=False))


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"ended before {path} appeared: {proc.communicate()[0].decode()[-3000:]}"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def _owner_pid(run: RunDir, subdomain: int) -> int:
    folder = run.stage_dir("local", subdomain)
    return int(json.loads((folder.parent / f".{folder.name}.owner").read_text())["pid"])


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _assert_consistent(run_dir: Path, subdomains: range) -> None:
    """Every local net is done and its saved weights reproduce its saved test predictions."""
    cfg = compose_config([*FAULT_OVERRIDES], run_dir, tiny=True)
    ctx = build_context(cfg, run_dir, claim=False)
    run = RunDir(run_dir)
    for i in subdomains:
        assert run.is_done("local", i), f"local {i} not done"
        net = build_local_net(ctx.settings, ctx.data)
        net.load_state_dict(torch.load(run.stage_dir("local", i) / "net.pt", weights_only=True))
        box = (slice(None), slice(None), *ctx.decomposition.box(i))
        x = {"test": ctx.data.x["test"][box].contiguous()}
        logits, _ = predict_logits(net, TensorDataModule(x, {"test": ctx.data.y["test"]}, 64), "test")
        saved = run.load_probs("local", "test", i)
        assert torch.allclose(logits, saved["logits"], atol=1e-5), f"net.pt of local {i} is not the one of its probs"


def test_two_identical_commands_on_one_subdomain_train_it_once(tmp_path):
    run_dir = tmp_path / "run"
    command = _command(run_dir, "stage=local", "subdomain=0")
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()[-3000:]
    logs = [out.decode() + err.decode() for out, err in outs]
    # One trains it; the other skips it: after waiting for the first when the two overlap, or at once when the first
    # had finished before the second got there (a loaded machine starts one process many seconds after the other).
    skipped = [log for log in logs if "finished earlier, skipped" in log]
    assert len(skipped) == 1, "exactly one of the two trains the sub-domain"
    trainer = next(log for log in logs if log not in skipped)
    assert "waiting for pid" not in trainer
    meta = RunDir(run_dir).meta("local", 0)
    assert meta["resumed_from_epoch"] is None  # trained in one piece by one process
    _assert_consistent(run_dir, range(1))


def test_killing_the_parent_of_two_workers_leaves_no_worker_and_a_rerun_trains_only_the_rest(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _command(run_dir, "stage=local", "parallel.workers=2"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _wait_for(run_dir / "local" / "00" / "last.ckpt", proc)
    workers = [pid for pid in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 2, workers
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if _alive(pid)], "workers outlived their parent by 10 s"
    run = RunDir(run_dir)
    finished = [i for i in range(4) if run.is_done("local", i)]
    _rerun_here(run_dir, "stage=local", "parallel.workers=2")
    report = json.loads((run_dir / "parallel.json").read_text())
    assert sorted(i for w in report["workers"] for i in w["subdomains"]) == [i for i in range(4) if i not in finished]
    _assert_consistent(run_dir, range(4))


def test_a_killed_worker_is_named_with_its_signal_and_its_subdomain_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _command(run_dir, "stage=local", "parallel.workers=2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    run = RunDir(run_dir)
    _wait_for(run_dir / "local" / "00" / "last.ckpt", proc)
    os.kill(_owner_pid(run, 0), signal.SIGKILL)
    err, _ = proc.communicate(timeout=900)
    assert proc.returncode == 2
    err = err.decode()
    assert "sub-domain 0" in err and "killed by SIGKILL" in err, err[-3000:]
    assert not run.is_done("local", 0)
    assert [i for i in range(1, 4) if not run.is_done("local", i)] == [] or "not started" in err
    _rerun_here(run_dir, "stage=local", "parallel.workers=2")
    assert run.meta("local", 0)["resumed_from_epoch"] is not None, "sub-domain 0 restarted instead of resuming"
    _assert_consistent(run_dir, range(4))


def test_a_stopped_worker_is_detected_within_the_heartbeat_timeout(tmp_path):
    run_dir = tmp_path / "run"
    timeout_s = 4
    proc = subprocess.Popen(
        _command(run_dir, "stage=local", "parallel.workers=2", f"parallel.heartbeat_timeout_s={timeout_s}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    run = RunDir(run_dir)
    _wait_for(run_dir / "local" / "00" / "last.ckpt", proc)
    pid = _owner_pid(run, 0)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    try:
        err, _ = proc.communicate(timeout=900)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    err = err.decode()
    assert proc.returncode == 2
    assert "sub-domain 0" in err and "stopped reporting" in err, err[-3000:]
    detected = [line for line in err.splitlines() if "stopped reporting" in line and line.startswith("[")]
    assert detected, err[-3000:]
    when = datetime.strptime(detected[0][1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    # The parent's verdict came within the timeout plus a heartbeat and a poll.
    assert when - stopped < timeout_s + 3, f"detected {when - stopped:.1f} s after SIGSTOP"
    assert not run.is_done("local", 0)
