"""bench/gpu_check.py: its tiny mode runs the GPU check's whole path on CPU (stacking probe, bare loop, ddcnn's loop,
channels_last_3d, synchronised batch norm in DDP, ddcnn-train, the cost by image size, parallel.workers)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("bench/gpu_check.py", "gpu_check")


# The sections of issue 34's second part, run by their own test (each starts processes).
LATER_SECTIONS = ("cl3d", "syncbn", "workers")


@pytest.mark.slow
def test_tiny_mode_runs_every_section_and_reads_the_stages(gpu_check, tmp_path):
    out = tmp_path / "gpu_check.json"
    threads = torch.get_num_threads()
    sections = [name for name in gpu_check.SECTIONS if name not in LATER_SECTIONS]
    args = ["--tiny", "--out", str(out), "--rows", "mnist_2x2", "--sections", ",".join(sections)]
    assert gpu_check.main(args) == 0
    assert torch.get_num_threads() == threads  # the tiny mode's single thread does not leak into the test process
    report = json.loads(out.read_text())
    assert report["failures"] == []
    assert {name: s["status"] for name, s in report["sections"].items()} == dict.fromkeys(sections, "ok")

    stacking = report["sections"]["stacking"]["result"]
    check = stacking["check"]
    assert stacking["nets"] == 4 and check["ok"] and check["compared_grads"]
    assert check["weight_abs_diff"] < gpu_check.WEIGHT_ATOL and check["grad_rel_diff"] < gpu_check.GRAD_TOL
    assert stacking["timings"][0]["ratio"] > 0
    assert report["sections"]["bare"]["result"]["rows"][0]["images_per_s"] > 0
    loop = {row["variant"]: row for row in report["sections"]["loop"]["result"]["rows"]}
    assert all(row["status"] == "ok" and row["host_syncs"] == 0 and row["step_ms"] > 0 for row in loop.values())
    assert loop["2d-device-fp32"]["placement"] == "device" and loop["3d-pinned-bf16"]["placement"] == "host"  # cpu
    assert loop["3d-pinned-bf16"]["spatial_dims"] == 3 and loop["2d-device-fp32"]["step_ratio"] > 0
    # the loss scaler's pair: on CPU neither is made fused (the node's optimizer exactly), on CUDA the first is
    sgd, unfused = loop["2d-device-16mixed-sgd"], loop["2d-device-16mixed-unfused"]
    assert (sgd["optimizer"], sgd["fused"], unfused["fused"]) == ("SGD", False, False)
    assert sgd["precision"] == "16-mixed" and sgd["steps_per_s"] > 0 and sgd["host_syncs_per_step"] == 0

    # the cost curve on this device: bench/size_cost.py's quick rows, each step timed (CPU time on the CPU)
    size_cost = {(r["spatial_dims"], r["overlap"]): r for r in report["sections"]["size_cost"]["result"]["rows"]}
    assert sorted(size_cost) == [(2, 0), (2, 2), (3, 0), (3, 2)]
    assert all(r["time_global_s"] > 0 and r["time_ratio"] > 0 for r in size_cost.values())
    assert size_cost[3, 0]["flop_ratio"] == pytest.approx(8.0, rel=0.01)

    (row,) = report["sections"]["e2e"]["result"]["rows"]
    assert row["status"] == "ok" and "decomposition=2x2" in row["overrides"]
    stages = {s["stage"]: s for s in row["stages"]}
    assert list(stages) == ["local 0", "local 1", "local 2", "local 3", "coarse", "coarse_val", "stacker", "global"]
    for name in ("local 0", "global"):
        # digits, batch 32, trainer.limit_train_batches=2, 1 epoch: 2 steps of 32 of the 200 training images
        assert (stages[name]["epochs"], stages[name]["steps"], stages[name]["samples_per_epoch"]) == (1, 2, 64)
        assert stages[name]["images_per_s"] == pytest.approx(64 / stages[name]["fit_time_s"])
        assert stages[name]["step_ms"] == pytest.approx(1e3 * stages[name]["fit_time_s"] / 2)
        assert stages[name]["device"] == "cpu" and stages[name]["peak_mib"] is None


@pytest.mark.slow
def test_tiny_mode_runs_channels_last_3d_synchronised_batch_norm_and_parallel_workers(gpu_check, tmp_path):
    """The sections that measure what only a GPU can settle (3D channels-last, SyncBatchNorm's kernels in DDP, local
    nets in worker processes sharing a device) run on CPU with tiny settings, with the same code: the 2-rank DDP
    step equals one process on the whole batch, and 2 workers train every sub-domain."""
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--tiny", "--out", str(out), "--sections", ",".join(LATER_SECTIONS)]) == 0
    report = json.loads(out.read_text())
    assert report["failures"] == []
    assert {name: s["status"] for name, s in report["sections"].items()} == dict.fromkeys(LATER_SECTIONS, "ok")
    sections = {name: s["result"] for name, s in report["sections"].items()}

    cl3d = sections["cl3d"]
    assert [(r["model"], r["precision"]) for r in cl3d["rows"]] == [("vgg_tiny", "fp32"), ("resnet_tiny", "fp32")]
    assert all(r["contiguous_step_ms"] > 0 and r["cl3d_step_ms"] > 0 and r["ratio"] > 0 for r in cl3d["rows"])
    assert cl3d["verdict"] and cl3d["shape"] == [8, 8, 8]

    syncbn = sections["syncbn"]
    assert syncbn["ok"] and syncbn["norm"] == ["GlobalBatchNorm"] and syncbn["world"] == 2  # SyncBatchNorm on CUDA
    assert syncbn["grad_rel_diff"] < gpu_check.SYNCBN_TOL and syncbn["ddp_step_ms"] > 0

    rows = {row["workers"]: row for row in sections["workers"]["rows"]}
    assert sorted(rows) == [1, 2] and all(row["status"] == "ok" for row in rows.values())
    assert all(row["subdomains"] == 4 and row["devices"] == ["cpu"] for row in rows.values())  # decomposition 2x2
    assert rows[2]["training_s"] <= rows[2]["stage_s"] and rows[2]["speedup"] > 0
    assert rows[1]["device_peak_mib"] is None  # polled on CUDA only


def test_stacked_training_is_the_sequential_training_and_the_check_sees_a_difference(gpu_check):
    """Two float64 steps of 3 nets with batch norm: the stacked weights, running statistics and gradients are the
    sequential ones (the buffers pass through vmap batched, so batch norm updates each net's own); a running
    statistic that drifted, or gradients of another scale (which Adam alone would hide), fail the check."""
    from ddcnn.config import compose
    from ddcnn.models import vgg_tiny

    cfg = compose([])
    nets = []
    for i in range(3):
        torch.manual_seed(i)
        nets.append(vgg_tiny(2, 1, 5).double())
    base, params, buffers = gpu_check.stack(nets)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 1, 6, 6, generator=gen, dtype=torch.float64)  # (batches, nets, batch, C, H, W)
    y = torch.randint(5, (2, 8), generator=gen)
    fp32 = gpu_check.autocast(torch.device("cpu"), "fp32")
    gpu_check.train_sequential(nets, [gpu_check.make_optimizer(cfg, n.parameters()) for n in nets], x, y, 2, 0, fp32)
    opt = gpu_check.make_optimizer(cfg, list(params.values()))
    gpu_check.train_stacked(gpu_check.stacked_loss(base), params, buffers, opt, x, y, 2, 0, fp32)
    check = gpu_check.mismatch(nets, params, buffers)
    assert check["ok"] and check["compared_grads"]
    assert int(buffers["features.1.num_batches_tracked"][1]) == 2
    assert not torch.equal(buffers["features.1.running_mean"][0], buffers["features.1.running_mean"][1])

    params["head.3.weight"].grad[1] /= 3
    check = gpu_check.mismatch(nets, params, buffers)
    assert not check["ok"] and check["grad_tensor"] == "net 1 head.3.weight"
    params["head.3.weight"].grad[1] *= 3
    buffers["features.1.running_mean"][2, 0] += 1e-4
    check = gpu_check.mismatch(nets, params, buffers)
    assert not check["ok"] and check["weight_tensor"] == "net 2 features.1.running_mean"


def test_peak_memory_is_read_from_whatever_key_meta_json_gives_it(gpu_check):
    assert gpu_check.peak_memory_from_meta({"gpu": {"peak_memory_bytes": 3 * 2**20}}) == (3.0, "gpu.peak_memory_bytes")
    assert gpu_check.peak_memory_from_meta({"gpu_peak_mem_mib": 5, "time_s": 1.0}) == (5.0, "gpu_peak_mem_mib")
    assert gpu_check.peak_memory_from_meta({"time_s": 1.0, "peak_memory_ok": True}) == (None, None)


def test_prepare_copies_what_the_gpu_machine_lacks_so_that_ddcnn_imports_without_site_packages(gpu_check, tmp_path):
    """--prepare for a machine with torch but not hydra/omegaconf/antlr4: they import from the copies alone (a fresh
    interpreter without site-packages: -S), and the printed command carries them."""
    import subprocess
    import sys
    from pathlib import Path

    vendor = tmp_path / "_vendor"
    lines = gpu_check.prepare_machine(vendor, tmp_path / "data")
    assert all((vendor / name / "__init__.py").is_file() for name in gpu_check.VENDORED)
    assert "--budget-s 360" in lines[-1] and "carry=" in lines[-1]
    import shutil

    import yaml

    yaml_dir = tmp_path / "image"  # PyYAML alone: the GPU machine's image has it
    shutil.copytree(Path(yaml.__file__).parent, yaml_dir / "yaml")
    code = (
        "import sys; sys.path += sys.argv[1:]; import hydra, omegaconf, antlr4; "
        "from hydra import compose, initialize; print(hydra.__file__)"
    )
    cmd = [sys.executable, "-S", "-c", code, str(vendor), str(yaml_dir)]
    proc = subprocess.run(cmd, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith(str(vendor))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_the_loop_makes_no_host_sync_in_its_steps(gpu_check, tmp_path):
    """Every loop variant (2D/3D, on the device and pinned, precisions, compile, augmentation) under CUDA's sync
    debug mode: no host synchronisation in a training step (16-mixed included: its optimizer is fused), except the
    variant that measures an unfused optimizer's loss scaler, which reads found_inf on the host every step."""
    out = tmp_path / "gpu_check.json"
    args = ["--sections", "loop", "--loop-images", "3000", "--loop-epochs", "1", "--out", str(out)]
    assert gpu_check.main(args) == 0
    report = json.loads(out.read_text())
    rows = report["sections"]["loop"]["result"]["rows"]
    assert {row["variant"] for row in rows} == set(gpu_check.LOOP_VARIANTS)
    for row in rows:
        assert row["status"] == "ok" and row["placement"] == ("device" if "device" in row["variant"] else "pinned")
        assert row["variant"] in gpu_check.SYNCING_VARIANTS or row["host_syncs"] == 0, row["first_sync"]
        assert row["memory_format"] == ("channels_last" if row["variant"].startswith("2d") else "contiguous_format")
        assert row["fused"] == (row["variant"] != "2d-device-16mixed-unfused")  # AdamW's node, or made fused
    unfused = next(row for row in rows if row["variant"] == "2d-device-16mixed-unfused")
    assert unfused["host_syncs_per_step"] >= 1  # what the fused optimizer removes: GradScaler's found_inf read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_sync_batch_norm_in_ddp_is_one_process_on_the_whole_batch_and_3d_layouts_are_timed(
    gpu_check, tmp_path
):
    """torch.nn.SyncBatchNorm (ddcnn's conversion on CUDA) in a 2-rank DDP step gives one process's gradients and
    running statistics on the whole batch; both 3D layouts train and are timed."""
    out = tmp_path / "gpu_check.json"
    args = ["--sections", "cl3d,syncbn", "--cl3d-steps", "3", "--cl3d-shape", "16,32,32", "--syncbn-steps", "3"]
    assert gpu_check.main([*args, "--out", str(out)]) == 0
    sections = {name: s["result"] for name, s in json.loads(out.read_text())["sections"].items()}
    assert sections["syncbn"]["ok"] and sections["syncbn"]["norm"] == ["SyncBatchNorm"]
    assert all(row["contiguous_step_ms"] > 0 and row["cl3d_step_ms"] > 0 for row in sections["cl3d"]["rows"])
