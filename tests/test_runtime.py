"""Reading the SLURM environment: job ids, srun ranks and shares, requeue ownership (no cluster needed)."""

from __future__ import annotations

import pytest

from ddcnn.runtime import SrunTask, shard, slurm_info, srun_task

SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_RESTART_COUNT",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_JOB_NAME",
)


@pytest.fixture
def no_slurm(monkeypatch):
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_outside_slurm_nothing_is_recorded_or_sharded(no_slurm):
    assert slurm_info() is None
    assert srun_task() is None
    with pytest.raises(ValueError, match="srun -n G"):
        srun_task("srun")


def test_array_task_ids_and_restarts_are_recorded(no_slurm):
    no_slurm.setenv("SLURM_JOB_ID", "17")
    no_slurm.setenv("SLURM_ARRAY_JOB_ID", "15")
    no_slurm.setenv("SLURM_ARRAY_TASK_ID", "2")
    no_slurm.setenv("SLURM_RESTART_COUNT", "1")
    info = slurm_info()
    assert (info["job_id"], info["array_job_id"], info["array_task_id"], info["restart_count"]) == (17, 15, 2, 1)


def test_a_batch_script_with_several_tasks_is_not_an_srun_rank(no_slurm):
    # sbatch -n 4 runs its script once with SLURM_NTASKS=4: that process must train everything asked of it.
    no_slurm.setenv("SLURM_JOB_ID", "3")
    no_slurm.setenv("SLURM_NTASKS", "4")
    no_slurm.setenv("SLURM_PROCID", "0")
    assert srun_task() is None


def test_srun_ranks_shard_the_subdomains(no_slurm):
    no_slurm.setenv("SLURM_JOB_ID", "3")
    no_slurm.setenv("SLURM_STEP_NUM_TASKS", "3")
    no_slurm.setenv("SLURM_NTASKS", "3")
    no_slurm.setenv("SLURM_PROCID", "1")
    no_slurm.setenv("SLURM_LOCALID", "1")
    task = srun_task()
    assert task == SrunTask(rank=1, ntasks=3, local_rank=1)
    assert srun_task("single") is None
    assert shard(list(range(8)), task) == [1, 4, 7]
    shares = [shard(list(range(8)), SrunTask(r, 3)) for r in range(3)]
    assert sorted(i for s in shares for i in s) == list(range(8))


def test_no_training_owns_requeueing_under_slurm(no_slurm):
    """submitit owns requeueing: the Fabric of every training gets ddcnn's cluster environments, which never requeue
    (Fabric's SLURMEnvironment, which would be detected from SLURM_NTASKS, is never built)."""
    from lightning_fabric.plugins.environments import SLURMEnvironment

    from ddcnn.engine.launch import SrunEnvironment, build_fabric

    no_slurm.setenv("SLURM_JOB_ID", "3")
    no_slurm.setenv("SLURM_NTASKS", "1")
    no_slurm.setenv("SLURM_PROCID", "0")
    no_slurm.setenv("SLURM_LOCALID", "0")
    no_slurm.setenv("SLURM_NODEID", "0")
    no_slurm.setenv("SLURM_JOB_NAME", "ddcnn")
    for fabric in (build_fabric("cpu"), build_fabric("cpu", 2, "spawn")):
        env = fabric._connector.cluster_environment
        assert not isinstance(env, SLURMEnvironment) and not hasattr(env, "auto_requeue")
    no_slurm.setenv("SLURM_STEP_NUM_TASKS", "2")
    no_slurm.setenv("SLURM_NTASKS", "2")
    env = build_fabric("cpu", 2, "srun").strategy.cluster_environment
    assert isinstance(env, SrunEnvironment) and not hasattr(env, "auto_requeue")


def test_ddcnn_slurm_plans_one_array_task_per_subdomain_then_the_rest(tmp_path, capsys):
    from ddcnn.cli import slurm_main

    slurm_main([str(tmp_path / "run"), "--print", "decomposition=4x4", "--launcher", "local_slurm"])
    local, final = [line for line in capsys.readouterr().out.splitlines() if line.startswith("+ ")]
    run_dir = str((tmp_path / "run").resolve())
    assert "hydra/launcher=local_slurm" in local and f"paths.run_dir={run_dir}" in local
    assert f"subdomain={','.join(map(str, range(16)))}" in local and "stage=local" in local
    assert "stage=all" in final and f"hydra.sweep.dir={run_dir}" in final and "decomposition=4x4" in final
    assert not (tmp_path / "run").exists()  # --print submits nothing


@pytest.mark.parametrize(
    ("overrides", "shared"),
    [
        (["stage=local", "subdomain=0,1,2,3"], True),
        (["stage=local", "subdomain=range(4)", "decomposition=4x4"], True),
        (["stage=all", "seed=0,1"], False),  # separate runs: each its own directory
        (["subdomain=0,1", "paths.run_dir=/elsewhere"], False),  # the user's choice wins
    ],
)
def test_a_slurm_sweep_over_subdomains_shares_one_run_directory(tmp_path, overrides, shared):
    from omegaconf import OmegaConf

    from ddcnn.parallel.hydra_callbacks import SharedRunDir

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}, "overrides": {"task": overrides}}})
    OmegaConf.set_readonly(config.hydra, True)
    SharedRunDir().on_multirun_start(config)
    added = [o for o in config.hydra.overrides.task if o.startswith("paths.run_dir=")]
    expected = [f"paths.run_dir={tmp_path / 'sweep'}"] if shared else [o for o in overrides if o.startswith("paths.")]
    assert added == expected


def test_ddcnn_slurm_gives_the_array_and_the_final_job_one_run_generation(tmp_path):
    """With force=true the final job then finds the array's local nets done in this generation: never retrains them."""
    from ddcnn.cli import slurm_commands

    local, final = slurm_commands(tmp_path / "run", ["force=true", "decomposition=2x2"], launcher="local_slurm")
    generations = [[a for a in cmd if a.startswith("run_generation=")] for cmd in (local, final)]
    assert len(generations[0]) == 1 and generations[0] == generations[1]
    assert "force=true" in local and "force=true" in final
    explicit = slurm_commands(tmp_path / "run", ["run_generation=g7"], launcher="local_slurm")
    assert all(a != "run_generation=" and not a.startswith("run_generation=slurm-") for cmd in explicit for a in cmd)


def test_force_skips_a_stage_recomputed_in_this_generation(make_cfg):
    from ddcnn.pipeline import train
    from ddcnn.rundir import RunDir

    train(make_cfg("stage=local", "subdomain=0"))
    run = RunDir(make_cfg().paths.run_dir)
    first = run.done_generation("local", 0)
    train(make_cfg("stage=local", "subdomain=0", "force=true", "run_generation=attempt-2"))
    assert run.done_generation("local", 0) == "attempt-2" != first
    stamp = (run.stage_dir("local", 0) / "done").stat().st_mtime_ns
    train(make_cfg("stage=local", "subdomain=0", "force=true", "run_generation=attempt-2"))  # a peer of attempt 2
    assert (run.stage_dir("local", 0) / "done").stat().st_mtime_ns == stamp


def test_a_timing_context_records_the_load_and_the_code_it_timed(no_slurm):
    """What ddcnn.report.results.timing_contexts compares besides devices and threads: the machine's load when the
    time was recorded (1, 5 and 15 minutes) and the hash of the package's sources (the store's reuse key uses it
    too)."""
    import os

    import torch

    from ddcnn.runtime import execution_context, source_hash
    from ddcnn.stages.reuse import source_hash as reuse_hash

    context = execution_context("cpu")
    assert context["code"] == source_hash() == reuse_hash() and len(context["code"]) == 16
    # the instructions torch's CPU kernels use: machines of one model name differ in them, and so do their times
    assert context["cpu_capability"] == str(torch.backends.cpu.get_cpu_capability())
    if hasattr(os, "getloadavg"):
        load = context["load_avg"]
        assert len(load) == 3 and all(isinstance(v, float) and v >= 0 for v in load)


_STEPS = """
import json, resource, subprocess, sys
import torch
from ddcnn.runtime import host_allocator, keep_freed_host_memory

if sys.argv[1] == "keep":
    keep_freed_host_memory()
torch.set_num_threads(1)
torch.manual_seed(0)
# A 3D net whose first activations (20 x 16 x 32^3 floats, 40 MiB) pass glibc's largest own-mapping threshold
net = torch.nn.Sequential(
    torch.nn.Conv3d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool3d(4), torch.nn.Flatten(),
    torch.nn.Linear(16 * 512, 2),
)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counted = 0
for step in range(7):
    before = faults()
    x, y = torch.randn(20, 1, 32, 32, 32), torch.randint(2, (20,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    counted += (faults() - before) if step >= 2 else 0  # after the first steps' warm-up
out = {"faults": counted, "allocator": host_allocator()}
if sys.argv[1] == "keep":  # a process this one starts (a worker, a DDP rank) keeps it too
    child = subprocess.run([sys.executable, "-c", sys.argv[2], "none", ""], capture_output=True, text=True, check=True)
    out["child"] = json.loads(child.stdout)
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").confstr("CS_GNU_LIBC_VERSION").startswith("glibc"), reason="glibc only")
def test_freed_host_memory_is_kept_for_the_next_step_in_this_process_and_those_it_starts():
    """glibc returns each freed block above 32 MiB to the OS at once, so every training step of a large net faults its
    activations in anew. After keep_freed_host_memory (pipeline.train calls it first) the steps reuse the memory:
    after a few steps' warm-up (the heap grows to the steps' peak), at least 4x fewer page faults (measured: 0 to 3%
    of glibc's own), in this process and in a process it starts (a worker, a DDP rank); DDCNN_HOST_MEMORY=return
    opts out, there and in the processes it starts, and so measures glibc as it comes (four processes in all)."""
    import json
    import os
    import subprocess
    import sys

    def steps(opt_out: bool) -> dict:
        env = {**os.environ, "DDCNN_HOST_MEMORY": "return" if opt_out else ""}
        env.pop("GLIBC_TUNABLES", None)
        args = [sys.executable, "-c", _STEPS, "keep", _STEPS]
        return json.loads(subprocess.run(args, capture_output=True, text=True, check=True, env=env).stdout)

    kept, glibc = steps(opt_out=False), steps(opt_out=True)
    assert glibc["allocator"] == glibc["child"]["allocator"] == "glibc"
    assert kept["allocator"] == kept["child"]["allocator"] == "glibc, freed memory kept"
    # as glibc comes: at least the first activation (10,240 pages) faulted in again at each of the 5 counted steps
    assert glibc["faults"] >= 5 * (40 << 20) // os.sysconf("SC_PAGE_SIZE"), glibc
    assert glibc["child"]["faults"] >= glibc["faults"] / 2, glibc
    assert kept["faults"] * 4 < glibc["faults"] and kept["child"]["faults"] * 4 < glibc["faults"], (kept, glibc)
