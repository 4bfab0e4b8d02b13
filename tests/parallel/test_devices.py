"""The one place that decides devices and threads."""

from __future__ import annotations

import pytest

from ddcnn.parallel.devices import plan_workers


def test_cpu_workers_share_the_cores():
    plan = plan_workers(2, "auto", cores=8, cuda_count=0)
    assert [(w.rank, w.device, w.threads) for w in plan] == [(0, "cpu", 4), (1, "cpu", 4)]
    assert [w.threads for w in plan_workers(3, cores=2, cuda_count=0)] == [1, 1, 1]
    assert [w.threads for w in plan_workers(2, threads_per_worker=3, cores=2, cuda_count=0)] == [3, 3]


def test_gpu_workers_round_robin_and_may_share():
    plan = plan_workers(5, "auto", cores=10, cuda_count=2)
    assert [w.device for w in plan] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert {w.threads for w in plan} == {2}
    assert {w.device for w in plan_workers(2, "cpu", cores=4, cuda_count=2)} == {"cpu"}


def test_bad_device_requests_say_what_to_do():
    with pytest.raises(ValueError, match="no CUDA device"):
        plan_workers(2, "cuda", cores=2, cuda_count=0)
    with pytest.raises(ValueError, match="parallel.accelerator"):
        plan_workers(2, "tpu", cores=2, cuda_count=0)
    with pytest.raises(ValueError, match="parallel.workers"):
        plan_workers(0, cores=2, cuda_count=0)
    with pytest.raises(ValueError, match="threads_per_worker"):
        plan_workers(2, threads_per_worker=0, cores=2, cuda_count=0)


def test_srun_tasks_sharing_a_node_take_a_share_of_its_cores(monkeypatch):
    import torch

    from ddcnn.parallel.devices import available_cores, process_device

    threads = torch.get_num_threads()
    try:
        monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2")
        monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
        process_device("cpu")
        assert torch.get_num_threads() == max(1, available_cores() // 2)
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
        process_device("cpu")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
