"""On a real SLURM cluster: Hydra's submitit launcher, a requeued job, and the multi-task ``srun`` mode.

CI starts a single-node cluster first (``tools/slurm/start.sh``, from ``.ci/run``); elsewhere these tests skip at once
when no controller answers ``scontrol ping`` (tests/conftest.py), and in CI that is an error.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddcnn.rundir import RunDir
from tests.conftest import TINY_OVERRIDES

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
]

BIN = Path(sys.executable).parent
TRAIN = str(BIN / "ddcnn-train")


def _tiny(**replace: str) -> list[str]:
    keep = [o for o in TINY_OVERRIDES if o.split("=", 1)[0] not in replace]
    return keep + [f"{k}={v}" for k, v in replace.items()]


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60).stdout


def test_tiny_2x2_run_through_the_submitit_launcher_records_job_ids(tmp_path):
    run_dir = tmp_path / "run"
    _run([str(BIN / "ddcnn-slurm"), str(run_dir), "--launcher", "local_slurm", *_tiny()], cwd=tmp_path)
    run = RunDir(run_dir)
    metas = [run.meta("local", i) for i in range(4)]
    jobs = [m["slurm"] for m in metas]
    assert all(j is not None for j in jobs), "local nets did not run under SLURM"
    # One array, task i trained sub-domain i, each task its own SLURM job id; all in the one run directory.
    assert len({j["array_job_id"] for j in jobs}) == 1 and isinstance(jobs[0]["array_job_id"], int)
    assert [j["array_task_id"] for j in jobs] == [0, 1, 2, 3]
    assert len({j["job_id"] for j in jobs}) == 4
    assert all(j["restart_count"] == 0 for j in jobs)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["accuracy"]["cnn_dnn"] is not None and results["accuracy"]["global"] is not None
    # Each job keeps its own Hydra record below the run directory.
    assert sorted(p.name for p in (run_dir / "hydra").iterdir()) == ["final", *(f"local_{i}" for i in range(4))]
    assert f"paths.run_dir={run_dir}" in (run_dir / "hydra" / "local_2" / ".hydra" / "overrides.yaml").read_text()


def _wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _release_requeued(job: str) -> None:
    """Start a requeued job now rather than after its begin time (1-2 min on SLURM 22.05).

    slurmd refuses a batch launch whose credential is not newer than the job's last kill, at one-second resolution
    ("Job credential revoked"; the job then ends with exit 1 and is not retried). Releasing the job within the second
    of the requeue lost that race once in CI, so wait for it to be pending and for the clock to pass the next second.
    """
    _wait_for(lambda: "JobState=PENDING" in _scontrol("show", "job", job), 120, f"requeued job {job} to be pending")
    time.sleep(2.0)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, timeout=60)


def test_a_local_job_requeued_mid_training_resumes_and_completes(tmp_path):
    run_dir = tmp_path / "run"
    # Long enough to be caught mid-training: `scontrol requeue` sends SIGTERM, which submitit's job process passes
    # over, and SIGKILL after KillWait (10 s in tools/slurm/start.sh), so training must outlast that: 800 short epochs
    # (about 22 s in the one loop). last.ckpt is written after every epoch.
    cmd = [
        TRAIN, "-m", "hydra/launcher=local_slurm", "stage=local", "subdomain=0,1", f"hydra.sweep.dir={run_dir}",
        *_tiny(**{"trainer.max_epochs": "800", "trainer.limit_train_batches": "2", "engine.checkpoint_every_s": "0"}),
        "engine.patience=null",  # every one of the 800 epochs: the default early stopping would end it before
    ]  # fmt: skip
    sweep = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        folder = RunDir(run_dir).stage_dir("local", 1)
        _wait_for(lambda: (folder / "last.ckpt").is_file(), 300, "local net 1 to write its first checkpoint")
        assert not (folder / "done").exists(), "local net 1 finished before it could be requeued"
        task = _wait_for(lambda: [p.name for p in (run_dir / ".submitit").glob("*_1")], 10, "the array task")[0]
        subprocess.run(["scontrol", "requeue", task], check=True, timeout=60)
        _release_requeued(task)
        out, _ = sweep.communicate(timeout=400)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, out[-4000:]
    run = RunDir(run_dir)
    assert [i for i in range(4) if run.is_done("local", i)] == [0, 1]
    requeued, other = run.meta("local", 1), run.meta("local", 0)
    assert requeued["slurm"]["restart_count"] >= 1 and other["slurm"]["restart_count"] == 0
    assert requeued["resumed_from_epoch"] is not None  # resumed from local/01/last.ckpt, not from scratch
    # Lightning did not requeue or checkpoint on its own (submitit/SLURM own requeueing).
    assert not list(folder.rglob("hpc_ckpt_*.ckpt"))


def test_srun_tasks_share_the_subdomains_and_rank_zero_finishes_the_run(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        "srun", "-n", "2", "--kill-on-bad-exit=1", "--time=10", TRAIN, "stage=all", f"paths.run_dir={run_dir}",
        f"hydra.run.dir={run_dir}/hydra/rank${{oc.env:SLURM_PROCID}}", *_tiny(),
    ]  # fmt: skip
    _run(cmd, cwd=tmp_path)
    run = RunDir(run_dir)
    metas = [run.meta("local", i) for i in range(4)]
    assert [m["slurm"]["procid"] for m in metas] == [0, 1, 0, 1]  # i % ntasks == rank
    assert {m["slurm"]["ntasks"] for m in metas} == {2}
    assert len({m["slurm"]["job_id"] for m in metas}) == 1  # one allocation
    results = json.loads((run_dir / "results.json").read_text())
    assert results["accuracy"]["cnn_dnn"] is not None
    assert sorted(p.name for p in (run_dir / "hydra").iterdir()) == ["rank0", "rank1"]


def test_srun_with_force_retrains_every_subdomain_once_and_the_coarse_dnn_reads_only_new_outputs(tmp_path):
    run_dir = tmp_path / "run"

    def srun(*extra: str, tag: str) -> None:
        cmd = [
            "srun", "-n", "2", "--kill-on-bad-exit=1", "--time=10", TRAIN, "stage=all", f"paths.run_dir={run_dir}",
            f"hydra.run.dir={run_dir}/hydra/{tag}${{oc.env:SLURM_PROCID}}", *_tiny(), *extra,
        ]  # fmt: skip
        _run(cmd, cwd=tmp_path)

    srun(tag="first")
    run = RunDir(run_dir)
    before = {i: run.meta("local", i)["generation"] for i in range(4)}
    srun("force=true", tag="forced")
    metas = [run.meta("local", i) for i in range(4)]
    generations = {m["generation"] for m in metas}
    assert len(generations) == 1 and generations.isdisjoint(before.values()), (before, generations)
    assert run.meta("coarse")["generation"] in generations  # the coarse DNN of the same attempt
    # Exactly once per sub-domain: one "local i: test acc" line over both ranks' logs of the forced run.
    logs = "".join(p.read_text() for p in (run_dir / "hydra").glob("forced*/*.log"))
    for i in range(4):
        assert logs.count(f"local {i}: test acc") == 1, logs[-3000:]
    # The coarse DNN trained after the last new local net was done, on their outputs.
    newest_local = max((run.stage_dir("local", i) / "done").stat().st_mtime for i in range(4))
    assert (run.stage_dir("coarse") / "done").stat().st_mtime >= newest_local


def _ddp_overrides(**replace: str) -> list[str]:
    # SGD and whole batches: the DDP weights can then be compared with the one-device run (tests/engine/test_ddp.py).
    return _tiny(**{"optimizer": "sgd", "trainer.limit_train_batches": "4", **replace})


# The ways users ask srun for 2 tasks: most SLURM users write -n (or #SBATCH --ntasks); Fabric's own SLURMEnvironment
# accepts only --ntasks-per-node, ddcnn's cluster environment reads the step and takes all of them.
SRUN_FORMS = {
    "ntasks-per-node": ["-N", "1", "--ntasks-per-node=2"],
    "n": ["-n", "2"],
    "ntasks": ["--ntasks=2"],
}


@pytest.mark.parametrize("form", ["ntasks-per-node", "n"])
def test_one_allocation_runs_the_comparison_with_slurm_launched_ddp(tmp_path, form):
    """srun with 2 tasks: local nets sharded, coarse + global CNN on rank 0, global_ddp across both tasks."""
    run_dir = tmp_path / "run"
    cmd = [
        "srun", *SRUN_FORMS[form], "--kill-on-bad-exit=1", "--time=10", TRAIN, "stage=all",
        "methods.enabled.global_ddp=true", "methods.global_ddp.num_devices=2", f"paths.run_dir={run_dir}",
        f"hydra.run.dir={run_dir}/hydra/rank${{oc.env:SLURM_PROCID}}", *_ddp_overrides(),
    ]  # fmt: skip
    _run(cmd, cwd=tmp_path)
    run = RunDir(run_dir)
    meta = run.meta("global_ddp")
    assert meta["num_devices"] == 2 and meta["world_size"] == 2 and meta["ddp_launcher"] == "srun"
    assert meta["slurm"]["ntasks"] == 2 and meta["batch_per_device"] == 16
    results = json.loads((run_dir / "results.json").read_text())
    (row,) = [r for r in results["methods"] if r["key"] == "global_ddp"]
    assert row["devices"] == 2 and row["projected_time_s"] > 0 and row["accuracy"] is not None
    import torch

    one = torch.load(run.stage_dir("global") / "net.pt", weights_only=True)
    ddp = torch.load(run.stage_dir("global_ddp") / "net.pt", weights_only=True)
    for key in one:
        torch.testing.assert_close(ddp[key], one[key], atol=1e-5, rtol=1e-5)


def test_an_srun_step_whose_tasks_are_not_the_ddp_world_is_refused_before_any_training(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        "srun", *SRUN_FORMS["ntasks"], "--kill-on-bad-exit=1", "--time=5", TRAIN, "stage=all",
        "methods.enabled.global_ddp=true", "methods.global_ddp.num_devices=4", f"paths.run_dir={run_dir}",
        f"hydra.run.dir={run_dir}/hydra/rank${{oc.env:SLURM_PROCID}}", *_ddp_overrides(),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "this srun step has 2 tasks" in proc.stderr and "srun -n 4" in proc.stderr, proc.stderr[-2000:]
    assert not (run_dir / "local").exists() or not any((run_dir / "local").rglob("last.ckpt"))


def test_a_requeued_one_job_run_resumes_the_ddp_baseline(tmp_path):
    run_dir = tmp_path / "run"
    overrides = _ddp_overrides(
        **{"trainer.max_epochs": "12", "trainer.limit_train_batches": "2", "engine.checkpoint_every_s": "0"}
    )
    _run(
        [str(BIN / "ddcnn-slurm"), str(run_dir), "--one-job", "--ntasks-per-node", "2", "--print", *overrides], tmp_path
    )
    script = run_dir / "slurm" / "one_job.sh"
    job = _run(["sbatch", "--parsable", str(script)], cwd=tmp_path).stdout.strip().split(";")[0]
    folder = RunDir(run_dir).stage_dir("global_ddp")
    try:
        _wait_for(lambda: (folder / "last.ckpt").is_file(), 600, "the DDP baseline's first checkpoint", poll=0.05)
        assert not (folder / "done").exists(), "global_ddp finished before it could be requeued"
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
        _release_requeued(job)
        finished = lambda: (run_dir / "results.json").is_file() or "JobState=FAILED" in _scontrol("show", "job", job)  # noqa: E731
        _wait_for(finished, 600, "the requeued job to finish the run")
        assert (run_dir / "results.json").is_file(), (
            f"the requeued job failed:\n{_scontrol('show', 'job', job)}\n"
            + "".join(p.read_text()[-3000:] for p in (run_dir / "slurm").glob("*.out"))
        )
    finally:
        subprocess.run(["scancel", job], timeout=60)
    meta = RunDir(run_dir).meta("global_ddp")
    assert meta["resumed_from_epoch"] is not None, "the DDP baseline restarted instead of resuming"
    assert meta["slurm"]["restart_count"] >= 1 and meta["world_size"] == 2
