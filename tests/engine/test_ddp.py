"""One net over several devices with DDP in ddcnn's loop (spawned ranks, gloo on CPU, 2 processes)."""

from __future__ import annotations

import os

import pytest
import torch

from ddcnn.engine.loop import shard_order
from ddcnn.pipeline import train
from ddcnn.rundir import RunDir


def test_the_loop_shards_one_permutation_across_ranks():
    order = torch.randperm(11, generator=torch.Generator().manual_seed(3))
    shards = [shard_order(order, rank, 2) for rank in range(2)]
    assert len(shards[0]) == len(shards[1]) == 6  # 11 samples padded to 12: same number of steps on both ranks
    assert set(torch.cat(shards).tolist()) == set(range(11))
    # Batch k of rank r holds samples of one-device batch k: the same global batches, split over the ranks.
    one_device = order[:8]
    assert sorted(torch.cat([s[:4] for s in shards]).tolist()) == sorted(one_device.tolist())
    assert torch.equal(shard_order(order, 0, 1), order)


@pytest.mark.slow
def test_global_and_local_nets_train_with_ddp_on_two_cpu_processes(make_cfg):
    cfg = make_cfg("engine.num_devices=2", "stage=local", "subdomain=0")
    meta = train(cfg)["local"][0]
    assert 0.0 <= meta["accuracy"]["test"] <= 1.0
    cfg = make_cfg("engine.num_devices=2", "stage=global")
    meta = train(cfg)["global"]
    run = RunDir(cfg.paths.run_dir)
    assert run.is_done("global") and (run.stage_dir("global") / "last.ckpt").is_file()
    assert meta["fit_time_s"] > 0 and meta["startup_s"] > 0  # spawning the ranks: start-up, outside the clock
    assert not (run.stage_dir("global") / ".spawned_result.pt").exists()
    probs = run.load_probs("global", "test")["probs"]
    assert probs.shape[0] == 100 and torch.allclose(probs.sum(-1), torch.ones(100), atol=1e-5)


def test_global_batch_norm_matches_one_batch_norm_over_the_whole_batch():
    """Two gloo ranks, each with half a batch: outputs, running statistics and input gradients equal one device's."""
    import torch.multiprocessing as mp

    x = torch.randn(8, 3, 5, 5) * 3 + 1
    reference = torch.nn.BatchNorm2d(3)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    xr = x.clone().requires_grad_()
    out = reference(xr)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_bn_rank, args=(x, reference.state_dict(), results), nprocs=2, join=True)
    torch.testing.assert_close(torch.cat([results[0]["out"], results[1]["out"]]), out.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([results[0]["grad"], results[1]["grad"]]), xr.grad, atol=1e-4, rtol=1e-4)
    for key in ("running_mean", "running_var"):
        torch.testing.assert_close(results[0][key], reference.state_dict()[key], atol=1e-6, rtol=1e-5)


def _bn_rank(rank: int, x: torch.Tensor, state: dict, results) -> None:
    import os

    import torch.distributed as dist

    from ddcnn.engine.sync_norm import convert_batch_norm

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    bn = torch.nn.BatchNorm2d(3)
    bn.load_state_dict({k: v for k, v in state.items()})
    bn.running_mean.zero_()
    bn.running_var.fill_(1)
    bn.num_batches_tracked.zero_()
    bn = convert_batch_norm(torch.nn.Sequential(bn)).train()
    part = x[rank * 4 : (rank + 1) * 4].clone().requires_grad_()
    out = bn(part)
    index = torch.arange(x.numel()).view_as(x)[rank * 4 : (rank + 1) * 4]
    (out * index).sum().backward()
    results[rank] = {
        "out": out.detach(),
        "grad": part.grad,
        "running_mean": bn[0].running_mean.clone(),
        "running_var": bn[0].running_var.clone(),
    }
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_global_cnn_follows_the_one_device_run(make_cfg):
    """Same initial weights, same global batch, batch norm over the global batch: the same optimizer steps.

    Tolerance 1e-5 (absolute and relative) on every weight and buffer after 4 SGD steps with momentum: the two runs
    differ only in the order of floating-point sums (gradients averaged over 2 ranks, batch statistics reduced over
    them), about 1e-7 relative per step. SGD rather than AdamW: Adam divides each gradient by its own running
    magnitude, so a weight whose true gradient is zero (the bias of a convolution followed by batch norm) moves by
    +-lr on rounding noise alone, in either run; that is the optimizer's, not DDP's, inexactness.
    """
    common = ("optimizer=sgd", "trainer.limit_train_batches=4", "methods.global_ddp.num_devices=2")  # 4 batches of 32
    train(make_cfg("stage=global", *common))
    train(make_cfg("stage=global_ddp", *common))
    run = RunDir(make_cfg().paths.run_dir)
    meta = run.meta("global_ddp")
    assert meta["num_devices"] == 2 and meta["batch_per_device"] == 16 and meta["ddp_launcher"] == "spawn"
    one = torch.load(run.stage_dir("global") / "net.pt", weights_only=True)
    ddp = torch.load(run.stage_dir("global_ddp") / "net.pt", weights_only=True)
    assert one.keys() == ddp.keys() and int(one["features.1.num_batches_tracked"]) == 4
    for key in one:
        torch.testing.assert_close(ddp[key], one[key], atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.slow
def test_a_refusal_in_the_spawned_ranks_reaches_the_caller_as_itself(tmp_path):
    """A last.ckpt of Lightning's Trainer is refused in every rank; the caller gets that ValueError and its message
    (not a multiprocessing error with a traceback in it), as on one device."""
    from ddcnn.data.datamodule import TensorDataModule
    from ddcnn.engine.loop import fit_batches
    from ddcnn.settings import LoopSettings

    x = {s: torch.randn(24, 1, 6, 6) for s in ("train", "val", "test")}
    y = {s: torch.randint(3, (24,)) for s in x}
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 3))
    tmp_path.mkdir(exist_ok=True)
    torch.save({"epoch": 1, "state_dict": {}, "pytorch-lightning_version": "2.5.1"}, tmp_path / "last.ckpt")
    sgd = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}
    with pytest.raises(ValueError, match=r"Lightning's Trainer .* Delete"):
        fit_batches(net, TensorDataModule(x, y, 8), tmp_path, LoopSettings(optimizer=sgd, max_epochs=1, num_devices=2))
    assert not (tmp_path / ".spawned_result.pt").exists()


def _ddp_data(batch_size: int):
    """44 training images (3 batches of 16 on one device: the last one partial, 12), 30 for validation; the class is
    the brighter half of the image, plus noise."""
    from ddcnn.data.datamodule import TensorDataModule

    gen = torch.Generator().manual_seed(5)
    x, y = {}, {}
    for split, n in (("train", 44), ("val", 30), ("test", 10)):
        labels = torch.randint(2, (n,), generator=gen)
        images = torch.randn(n, 1, 6, 6, generator=gen)
        images[labels == 1, :, :3] += 1.0
        x[split], y[split] = images, labels
    return TensorDataModule(x, y, batch_size=batch_size, eval_batch_size=8, seed=0)


def _ddp_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(  # batch norm (global under DDP) after a convolution without bias
        torch.nn.Conv2d(1, 4, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 2),
    )


@pytest.mark.slow
@pytest.mark.parametrize("precise_bn", [0, 2])
def test_two_ddp_ranks_train_as_one_device_in_float64(tmp_path, precise_bn):
    """Two gloo ranks against one device, 3 epochs of AdamW in float64 (``64-true``), a partial last batch (44 samples
    in global batches of 16) and batch norm: the same training and validation history to float64 rounding, the same
    selected epoch and the same weights; with ``precise_bn`` too (the statistics recomputed before each validation
    from the first 2 global batches: each rank's halves, reduced by the synchronised batch norm). The ranks differ
    from one device only in the order of floating-point sums (gradients averaged over 2 ranks, batch statistics and
    metric sums reduced over them): about 1e-16 relative per operation, far below the 1e-9 asked here, where float32
    (1e-7 per operation, amplified by Adam's normalisation of near-zero gradients) could not promise it."""
    from ddcnn.engine.loop import fit_batches
    from ddcnn.settings import LoopSettings

    adamw = {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 0.05, "weight_decay": 0.01}
    common = {"optimizer": adamw, "max_epochs": 3, "precision": "64-true", "monitor": "val_loss", "monitor_mode": "min"}
    common["precise_bn"] = precise_bn
    one = fit_batches(_ddp_net(), _ddp_data(16), tmp_path / "one", LoopSettings(**common))
    two = fit_batches(_ddp_net(), _ddp_data(8), tmp_path / "two", LoopSettings(num_devices=2, **common))
    assert two.world_size == 2 and one.world_size == 1 and two.precision == one.precision == "64-true"
    assert [row["step"] for row in one.history] == [row["step"] for row in two.history] == [3, 6, 9]
    for key in ("train_loss", "train_acc", "val_loss", "val_acc", "lr"):
        a, b = [row[key] for row in one.history], [row[key] for row in two.history]
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12), key
    assert len({row["val_loss"] for row in one.history}) == 3  # the weights moved: the history says something
    assert one.best_epoch == two.best_epoch and one.best_metric == pytest.approx(two.best_metric, rel=1e-9)
    # Handed back in the dtype they came in (float32): predictions and exports read them so.
    a, b = one.net.state_dict(), two.net.state_dict()
    assert a.keys() == b.keys() and a["0.weight"].dtype == torch.float32
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")
    # The selected weights themselves, in float64 (best.ckpt keeps them as trained).
    best = [torch.load(tmp_path / d / "best.ckpt", weights_only=False)["net"] for d in ("one", "two")]
    assert best[0]["0.weight"].dtype == torch.float64
    for key in best[0]:
        torch.testing.assert_close(best[1][key], best[0][key], rtol=1e-10, atol=1e-12, msg=lambda m, k=key: f"{k}: {m}")
    # recomputed statistics: the exact average of 2 batches (update_bn counts them), not 3 steps' running averages
    assert int(a["1.num_batches_tracked"]) == int(b["1.num_batches_tracked"]) == (2 if precise_bn else 9)


class _FailsOnRank1(torch.nn.Module):
    """A small net whose training forward raises in DDP rank 1 from its second call on (the first is the loop's
    warm-up): rank 1 fails inside epoch 0 while rank 0 waits for it in the step's gradient all-reduce, as a CUDA
    out-of-memory error on one GPU would."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 3))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.training:
            self.calls += 1
            if self.calls >= 2 and dist.is_initialized() and dist.get_rank() == 1:
                raise RuntimeError("rank 1 ran out of memory (test)")
        return self.body(x)


@pytest.mark.slow
def test_a_failure_in_one_spawned_rank_stops_every_rank_with_its_message(tmp_path, caplog):
    """Rank 1 raises in a training step while rank 0 waits for it in the gradient all-reduce: the run stops within
    seconds (not the process group's 30-minute timeout) with rank 1's error and its traceback in the log."""
    import logging
    import time

    from ddcnn.data.datamodule import TensorDataModule
    from ddcnn.engine.loop import fit_batches
    from ddcnn.settings import LoopSettings

    x = {s: torch.randn(24, 1, 6, 6) for s in ("train", "val", "test")}
    y = {s: torch.randint(3, (24,)) for s in x}
    sgd = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}
    began = time.perf_counter()
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match=r"^rank 1 ran out of memory \(test\)$"):
        settings = LoopSettings(optimizer=sgd, max_epochs=3, num_devices=2)
        fit_batches(_FailsOnRank1(), TensorDataModule(x, y, 4), tmp_path, settings)
    assert time.perf_counter() - began < 60  # spawning two interpreters included
    assert "DDP rank 1 of the training" in caplog.text and "in forward" in caplog.text  # rank 1's traceback
    assert not list(tmp_path.glob(".spawned_*"))


class _AbortsAtExit(torch.nn.Module):
    """A small net that, once trained in DDP rank ``rank``, has that rank's process abort at its interpreter's end
    (SIGABRT, no core file), after the training finished: as gloo's worker threads rarely do when the process group
    the DDP module keeps is released there ("terminate called without an active exception")."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 3))
        self.rank, self.armed = rank, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import atexit
        import resource

        import torch.distributed as dist

        if self.training and not self.armed and dist.is_initialized() and dist.get_rank() == self.rank:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            atexit.register(os.abort)
            self.armed = True
        return self.body(x)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_that_dies_at_its_exit_after_the_training_finished_keeps_the_result(tmp_path, caplog, rank):
    """A spawned rank whose process aborts at its interpreter's end, after every rank finished training: the training
    stands (rank 0's result, saved before the ranks parted), with a warning naming the signal; nothing is left behind.
    Before, the parent raised "ended without reporting an error" for a finished training (a CI flake, rank 1)."""
    import logging

    from ddcnn.data.datamodule import TensorDataModule
    from ddcnn.engine.loop import fit_batches
    from ddcnn.settings import LoopSettings

    gen = torch.Generator().manual_seed(0)
    x = {s: torch.randn(24, 1, 6, 6, generator=gen) for s in ("train", "val", "test")}
    y = {s: torch.randint(3, (24,), generator=gen) for s in x}
    sgd = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}
    with caplog.at_level(logging.WARNING, logger="ddcnn.engine.launch"):
        settings = LoopSettings(optimizer=sgd, max_epochs=2, num_devices=2)
        out = fit_batches(_AbortsAtExit(rank), TensorDataModule(x, y, 4), tmp_path, settings)
    assert out.world_size == 2 and len(out.history) == 2
    assert f"process {rank} terminated with signal SIGABRT" in caplog.text, caplog.text
    assert "the result rank 0 saved is kept" in caplog.text
    assert not list(tmp_path.glob(".spawned_*"))


# One srun task of a 2-task DDP training: argv[1] the folder, argv[2] the net (``fails``: rank 1 raises in a training
# step; ``aborts``: rank 1's process aborts at its interpreter's end); it ends as ddcnn-train ends a finished run.
_SRUN_TASK = """
import sys, torch
from ddcnn.data.datamodule import TensorDataModule
from ddcnn.engine.launch import exit_past_a_lingering_process_group
from ddcnn.engine.loop import fit_batches
from ddcnn.settings import LoopSettings
from tests.engine.test_ddp import _AbortsAtExit, _FailsOnRank1

torch.manual_seed(0)
x = {s: torch.randn(24, 1, 6, 6) for s in ("train", "val", "test")}
y = {s: torch.randint(3, (24,)) for s in x}
sgd = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}
settings = LoopSettings(optimizer=sgd, max_epochs=3, num_devices=2, launcher="srun")
net = {"fails": _FailsOnRank1, "aborts": lambda: _AbortsAtExit(1)}[sys.argv[2]]()
out = fit_batches(net, TensorDataModule(x, y, 4), sys.argv[1], settings)
print(f"trained {len(out.history)} epochs", flush=True)
exit_past_a_lingering_process_group()
"""


def _start_srun_tasks(script: str, *args: str) -> list:
    """The two tasks of an srun step, started here as srun starts them (the SLURM step's variables)."""
    import os
    import subprocess
    import sys

    from lightning_fabric.plugins.environments.lightning import find_free_network_port

    from tests.conftest import REPO

    port = str(find_free_network_port())
    tasks = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, "-c", script, *args]
        tasks.append(
            subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return tasks


@pytest.mark.slow
def test_an_srun_task_that_trained_in_ddp_leaves_before_a_teardown_that_would_abort_it(tmp_path):
    """An srun task whose process would abort at its interpreter's end (as gloo's lingering process group rarely
    makes it), after the DDP training finished: ddcnn-train's exit skips that teardown, so the task ends with status
    0 and srun --kill-on-bad-exit=1 has no reason to end the others (rank 0 still evaluating). Without it rank 1 ends
    with SIGABRT."""
    tasks = _start_srun_tasks(_SRUN_TASK, str(tmp_path), "aborts")
    outs = [task.communicate(timeout=240) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outs
    assert all("trained 3 epochs" in out for out, _ in outs), outs


@pytest.mark.slow
def test_a_failure_in_one_srun_task_stops_every_task_with_its_message(tmp_path):
    """The two tasks of an srun step (started here as srun starts them: the SLURM step's variables): rank 1 raises in
    a training step; rank 0, waiting for it in the all-reduce, exits non-zero too, within seconds, with rank 1's
    message, and neither waits for the other at the end."""
    import time

    began = time.perf_counter()
    tasks = _start_srun_tasks(_SRUN_TASK, str(tmp_path), "fails")
    outs = [task.communicate(timeout=240) for task in tasks]
    elapsed = time.perf_counter() - began
    assert all(task.returncode != 0 for task in tasks), outs
    assert "RuntimeError: rank 1 ran out of memory (test)" in outs[1][1]
    assert "rank 1 of the DDP training failed: RuntimeError: rank 1 ran out of memory (test)" in outs[0][1], outs[0][1]
    assert elapsed < 90  # two interpreters' start-up included; the process group's timeout is 30 minutes


def _watched_rank(rank: int, port: str, stderr_path: str) -> None:
    """Rank 1 fails and stays alive without joining the collective (an NCCL peer that hangs); rank 0 waits for it in
    a barrier that never completes, and must be ended by its watcher."""
    import os
    import sys
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from ddcnn.engine.launch import failures_stop_every_rank

    sys.stderr = open(stderr_path.format(rank), "w")  # noqa: SIM115  (what the watcher writes before it ends the process)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=30))

    class _Ranks:  # what failures_stop_every_rank reads of a Fabric
        global_rank, world_size = rank, 2

    try:
        with failures_stop_every_rank(_Ranks(), poll_s=0.1, grace_s=1.0):
            if rank == 1:
                raise RuntimeError("rank 1 failed and hangs (test)")
            dist.barrier()
    except RuntimeError:
        time.sleep(120)


@pytest.mark.slow
def test_a_rank_blocked_in_a_collective_is_ended_by_its_watcher(tmp_path):
    import time

    import torch.multiprocessing as mp
    from lightning_fabric.plugins.environments.lightning import find_free_network_port

    port = str(find_free_network_port())
    began = time.perf_counter()
    with pytest.raises(mp.ProcessExitedException) as info:
        mp.spawn(_watched_rank, args=(port, str(tmp_path / "rank{}.err")), nprocs=2, join=True)
    elapsed = time.perf_counter() - began
    assert info.value.error_index == 0 and info.value.exit_code == 1
    said = (tmp_path / "rank0.err").read_text()
    assert "rank 1 of the DDP training failed: RuntimeError: rank 1 failed and hangs (test)" in said
    assert elapsed < 60
