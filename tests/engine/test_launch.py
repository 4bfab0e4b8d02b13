"""Where a training runs (ddcnn/engine/launch.py): ddcnn's own cluster environment for every srun form, the precision
plugin, and a process left as it was after a launch. No cluster needed: the SLURM environment is faked."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from ddcnn.context import subdomain_seed
from ddcnn.engine.launch import (
    SrunEnvironment,
    _first_host,
    build_fabric,
    isolated_launch,
    rendezvous_port,
    seed_everything,
)

SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NUM_NODES",
    "SLURM_NNODES",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_JOB_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)

# What srun sets in task 1 of a step of 2 tasks, for each way of asking for them (seen on the CI cluster; srun sets
# SLURM_NTASKS_PER_NODE only when --ntasks-per-node was given).
FORMS = {
    "srun -n 2": {"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2"},
    "#SBATCH --ntasks=2 + srun": {"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2"},
    "srun --ntasks-per-node=2": {
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
    },
}


@pytest.fixture
def slurm(monkeypatch):
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)

    def task(form: str, rank: int = 1, **extra: str):
        env = {
            "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_NNODES": "1",
            "SLURM_STEP_NUM_NODES": "1",
            "SLURM_STEP_NODELIST": "node07",
            "SLURM_JOB_NODELIST": "node07",
            "SLURM_JOB_NAME": "ddcnn",
            **FORMS[form],
            **extra,
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return task


@pytest.mark.parametrize("form", list(FORMS))
def test_every_srun_form_gives_the_steps_world_and_ranks(slurm, form):
    slurm(form, rank=1)
    env = SrunEnvironment()
    assert env.detect() and env.creates_processes_externally
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (2, 1, 1, 0)
    assert env.main_address == "node07" and env.main_port == rendezvous_port("4242", "0")
    fabric = build_fabric("cpu", 2, "srun")  # builds; the ranks meet only at launch
    assert fabric.world_size == 2 and fabric.global_rank == 1 and fabric.strategy.cluster_environment is not None
    assert fabric.device == torch.device("cpu")


def test_fabrics_own_slurm_environment_refuses_the_n_form_which_is_why_ddcnn_has_its_own(slurm):
    from lightning_fabric.plugins.environments import SLURMEnvironment

    slurm("srun -n 2")
    with pytest.raises(RuntimeError, match="--ntasks-per-node"):
        SLURMEnvironment()
    build_fabric("cpu", 1, "local")  # a one-device training in such a task is not refused either


def test_several_nodes_meet_on_the_first_node_of_the_step(slurm, monkeypatch):
    slurm("srun -n 2", rank=3, SLURM_STEP_NUM_TASKS="4", SLURM_NODEID="1", SLURM_LOCALID="1")
    for nodes, first in (
        ("gpu[03-05,9]", "gpu03"),
        ("node07,node08", "node07"),
        ("a[1,3],b2", "a1"),
        ("c[0012-0013]", "c0012"),
        ("solo", "solo"),
    ):
        assert _first_host(nodes) == first
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[03-04]")
    env = SrunEnvironment()
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 3, 1, 1)
    assert env.main_address == "gpu03"
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # the user's choice wins
    monkeypatch.setenv("MASTER_PORT", "23456")
    assert (env.main_address, env.main_port) == ("10.0.0.1", 23456)


def test_the_steps_of_one_allocation_meet_on_different_ports_below_the_ephemeral_range():
    ports = {rendezvous_port("987654", str(step)) for step in range(20)}
    assert len(ports) == 20 and all(15000 <= p < 32768 for p in ports)
    assert rendezvous_port("987654", "3") == rendezvous_port("987654", "3")


def test_a_ddp_world_that_is_not_the_steps_task_count_is_refused_with_the_fix(slurm, monkeypatch):
    slurm("srun -n 2")
    with pytest.raises(ValueError, match="this srun step has 2 tasks: run srun -n 4"):
        build_fabric("cpu", 4, "srun")
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="not one of several tasks of an srun step"):
        build_fabric("cpu", 2, "srun")


def test_spawned_ranks_meet_on_this_machine_whatever_master_addr_says(monkeypatch):
    """A MASTER_ADDR/MASTER_PORT left in the shell (a torchrun habit, another job) must not send spawned ranks to
    another host or to one fixed port that two trainings on this machine would share."""
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "23456")
    envs = [build_fabric("cpu", 2, "spawn").strategy.cluster_environment for _ in range(2)]
    assert {env.main_address for env in envs} == {"127.0.0.1"}
    assert envs[0].main_port != 23456 and envs[0].main_port != envs[1].main_port


def test_launching_leaves_the_process_as_it_was(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    with isolated_launch():
        os.environ["MASTER_PORT"] = "12345"
        os.environ["OMP_NUM_THREADS"] = "7"
        torch.set_num_threads(threads + 1)
    assert "MASTER_PORT" not in os.environ and os.environ["OMP_NUM_THREADS"] == "1"
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize(
    ("precision", "plugin", "dtype"),
    [
        ("32-true", "Precision", None),
        ("bf16-mixed", "MixedPrecision", torch.bfloat16),
        ("16-mixed", "MixedPrecision", torch.float16),
    ],
)
def test_the_precision_plugin_is_what_was_asked_on_cpu_too(precision, plugin, dtype):
    fabric = build_fabric("cpu", 1, "local", precision)
    assert type(fabric.strategy.precision).__name__ == plugin
    if dtype is not None:
        with fabric.autocast():
            assert torch.nn.Linear(3, 2)(torch.randn(1, 3)).dtype == dtype
    assert (getattr(fabric.strategy.precision, "scaler", None) is not None) == (precision == "16-mixed")


def _draws() -> tuple:
    return (
        [random.random() for _ in range(3)],
        np.random.random(3).tolist(),
        np.random.randint(0, 2**31, 3).tolist(),
        torch.rand(3).tolist(),
        torch.randperm(10).tolist(),
        os.environ["PL_GLOBAL_SEED"],
    )


def _seed_everything_before_fabric(seed: int) -> None:
    """ddcnn's own seeding before it called Fabric's: every recorded run was trained from these streams."""
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@pytest.mark.parametrize("seed", [0, 1, 12345, subdomain_seed(0, 3), subdomain_seed(7, 15) + 104_729 * 5, 2**32 - 1])
def test_seeding_gives_the_streams_recorded_runs_were_trained_from(seed, monkeypatch):
    # Seeds ddcnn derives (stage and sub-domain seeds, cross-fitting folds) lie in [0, 2**32): Fabric's range.
    monkeypatch.setenv("PL_GLOBAL_SEED", "")  # both restored after the test
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    _seed_everything_before_fabric(seed)
    expected = _draws()
    random.seed(None), np.random.seed(None), torch.seed()
    assert seed_everything(seed) == seed
    assert _draws() == expected
