"""The pre-flight check of the networks and the memory plan (ddcnn/context.py check_networks, memory_plan)."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import ddcnn.context as context
from ddcnn.context import Context, build_context, check_networks
from ddcnn.data.memory import peak_rss_bytes
from ddcnn.decomposition import Decomposition
from ddcnn.rundir import RunDir
from ddcnn.settings import RunSettings
from tests.conftest import compose_config


def _volume_context(tmp_path: Path, side: int, *overrides: str, overlap: int = 0) -> Context:
    """A context of 3D volumes of ``side``³ (one channel, 2 classes) cut 2x2x2, with data that hold no voxels:
    check_networks reads only their shape and counts."""
    cfg = compose_config(["model=vgg_small", "data.batch_size=2", *overrides], tmp_path / "run")
    settings = RunSettings.from_config(cfg).with_data_counts(2, 1)
    data = SimpleNamespace(
        image_shape=(side,) * 3, in_channels=1, spatial_dims=3, num_classes=2, y={"train": range(100)}
    )
    dec = Decomposition((2, 2, 2), (side,) * 3, (overlap,) * 3)
    return Context(RunDir(tmp_path / "run"), data, dec, settings)


def test_plan_at_256_cubed_runs_no_full_size_forward(tmp_path: Path, monkeypatch) -> None:
    """A real forward of the global vgg_small at 256³, batch 2, would hold 13 GiB; the plan holds next to nothing."""
    monkeypatch.setattr(context, "device_memory_bytes", lambda device: 1 << 50)  # whatever this machine has
    check_networks(_volume_context(tmp_path, 32))  # the first meta trace of a process imports torch._dynamo
    ctx = _volume_context(tmp_path, 256)
    peak, cpu = peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF)
    began = time.perf_counter()
    check_networks(ctx)
    elapsed = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    assert peak_rss_bytes() - peak < 1 << 30
    assert cpu_s < 2.0 and elapsed < 10.0  # the wall clock of a loaded machine
    plan = ctx.memory_plan
    assert plan["global"]["method"] == "meta" and plan["global"]["activation_bytes"] > 12 << 30
    assert 8 * plan["local"]["activation_bytes"] == pytest.approx(plan["global"]["activation_bytes"], rel=0.01)


def test_a_local_net_that_does_not_fit_refuses_the_run(tmp_path: Path, monkeypatch) -> None:
    ctx = _volume_context(tmp_path, 128)
    monkeypatch.setattr(context, "device_memory_bytes", lambda device: 200 << 20)
    with pytest.raises(ValueError, match=r"one local net does not fit the memory of cpu.*needs [\d.]+ GiB") as err:
        check_networks(ctx)
    message = str(err.value)
    for fix in (
        "data.batch_size",
        "trainer.precision=bf16-mixed",
        "engine.activation_checkpointing=all",
        "more sub-domains (decomposition.grid)",
    ):
        assert fix in message
    assert "0.20 GiB are available" in message
    for i in range(ctx.decomposition.num_subdomains):  # finished local nets train no more: the run is not refused
        (ctx.run.stage_dir("local", i)).mkdir(parents=True)
        (ctx.run.stage_dir("local", i) / "done").write_text("")
    with pytest.raises(ValueError, match="the global CNN does not fit"):
        check_networks(ctx)


def test_a_global_cnn_that_does_not_fit_is_refused_with_its_numbers(tmp_path: Path, monkeypatch) -> None:
    ctx = _volume_context(tmp_path, 128)
    monkeypatch.setattr(context, "device_memory_bytes", lambda device: 1 << 50)
    check_networks(ctx)
    enough_for_local = ctx.memory_plan["local"]["peak_bytes"] + (1 << 20)
    monkeypatch.setattr(context, "device_memory_bytes", lambda device: enough_for_local)
    with pytest.raises(ValueError, match="the global CNN does not fit.*engine.activation_checkpointing=global"):
        check_networks(ctx)


def test_checkpointing_is_planned_and_a_net_that_cannot_be_cut_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(context, "device_memory_bytes", lambda device: 1 << 50)
    plain = _volume_context(tmp_path, 64)
    check_networks(plain)
    cut = _volume_context(tmp_path, 64, "engine.activation_checkpointing=global")
    check_networks(cut)
    assert cut.memory_plan["global"]["checkpointing"] and not cut.memory_plan["local"]["checkpointing"]
    assert cut.memory_plan["global"]["activation_bytes"] < plain.memory_plan["global"]["activation_bytes"]
    assert cut.memory_plan["local"] == plain.memory_plan["local"]


def test_memory_plan_json_in_the_run_directory(tmp_path: Path, caplog) -> None:
    cfg = compose_config([], tmp_path / "run")
    with caplog.at_level("INFO", logger="ddcnn.context"):
        ctx = build_context(cfg)
    plan = json.loads((ctx.run.root / "memory_plan.json").read_text())
    assert set(plan) == {"global", "local", "coarse", "device_memory_bytes", "device"} | (
        {"overlap_cost"} if any(ctx.decomposition.overlap) else set()
    )
    keys = {"params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "batch_bytes", "peak_bytes"}
    for role in ("global", "local", "coarse"):
        assert keys | {"flops_per_step", "method"} <= set(plan[role])
        assert plan[role]["peak_bytes"] == sum(plan[role][k] for k in keys - {"peak_bytes"})
    assert plan["device"] == "cpu" and plan["device_memory_bytes"] > 0
    assert plan["global"]["flops_per_step"] > plan["local"]["flops_per_step"] > 0
    (block,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan")]
    assert all(role in block for role in ("local", "global", "coarse"))


def test_the_run_directory_gets_its_split_manifest_once(tmp_path):
    """Issue #45 item 7: ``RUN_DIR/splits.csv`` (file, split, class), written by the first process that prepared the
    data and left as it is by the next; digits ship as arrays, so each sample is its row in the source's split."""
    import csv

    cfg = compose_config([], tmp_path / "run")
    ctx = build_context(cfg)
    manifest = ctx.run.root / "splits.csv"
    with open(manifest, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [sum(r["split"] == s for r in rows) for s in ("train", "val", "test")] == [
        len(ctx.data.y[s]) for s in ("train", "val", "test")
    ]
    assert {r["class"] for r in rows} <= set(ctx.data.class_names)
    assert {r["file_is"] for r in rows if r["split"] == "test"} == {"row of the source's test split"}
    written = manifest.stat().st_mtime_ns
    build_context(compose_config([], tmp_path / "run"))  # the next stage's process
    assert manifest.stat().st_mtime_ns == written


def test_the_plan_names_what_an_overlap_costs_beyond_its_voxels(tmp_path: Path, monkeypatch, caplog) -> None:
    """vgg_small's pooling rounds a side up at every stage: at 32³ 2x2x2 overlap 2, the 17³ sub-domains cost 1.72x the
    FLOPs of 16³ for 1.2x the voxels (docs/cost.md, issue #47); the plan says so and records it. Overlap 16 gives
    24³ sides, multiples of the net's total stride 8: they cost what their voxels cost, and the plan says nothing."""
    monkeypatch.setattr(context, "device_memory_bytes", lambda device: 1 << 50)
    ctx = _volume_context(tmp_path, 32, overlap=2)
    with caplog.at_level("INFO", logger="ddcnn.context"):
        check_networks(ctx)
    cost = ctx.memory_plan["overlap_cost"]
    assert cost["sub_shape"] == [17] * 3 and cost["overlap_free_shape"] == [16] * 3
    assert cost["voxel_ratio"] == pytest.approx(17**3 / 16**3)
    assert cost["flops_ratio"] == pytest.approx(1.72, abs=0.01)
    assert "overlap 2: a local step on 17x17x17 costs 1.72x the FLOPs of the overlap-free 16x16x16" in caplog.text
    caplog.clear()
    multiple = _volume_context(tmp_path, 32, overlap=16)
    with caplog.at_level("INFO", logger="ddcnn.context"):
        check_networks(multiple)
    cost = multiple.memory_plan["overlap_cost"]
    assert cost["sub_shape"] == [24] * 3 and cost["flops_ratio"] <= 1.1 * cost["voxel_ratio"]
    assert "overlap 16:" not in caplog.text
    plain = _volume_context(tmp_path, 32)
    check_networks(plain)
    assert "overlap_cost" not in plain.memory_plan
