"""The choice of the training loop (engine.loop) and the plain loop's promises: same artifacts, no Lightning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddcnn.engine.tensor_fit import num_batches
from ddcnn.engine.train import choose_loop
from ddcnn.pipeline import train
from ddcnn.rundir import RunDir


def test_auto_trains_one_device_with_the_plain_loop_and_ddp_with_lightning(make_cfg):
    assert choose_loop(make_cfg())[0] == "plain"
    assert choose_loop(make_cfg("engine.num_devices=2"))[0] == "lightning"
    assert choose_loop(make_cfg("engine.loop=lightning"))[0] == "lightning"
    assert choose_loop(make_cfg("trainer.precision=bf16-mixed"))[0] == "plain"


def test_trainer_arguments_only_lightning_implements_choose_lightning_or_fail_clearly(make_cfg):
    for override in ("+trainer.accumulate_grad_batches=2", "trainer.precision=16-mixed", "trainer.limit_val_batches=0"):
        loop, why = choose_loop(make_cfg(override))
        assert loop == "lightning", override
        key = override.lstrip("+").split("=")[0].split(".")[-1]
        assert key in why, why
        with pytest.raises(ValueError, match="engine.loop=lightning"):
            choose_loop(make_cfg(override, "engine.loop=plain"))
    with pytest.raises(ValueError, match="DDP on 2 devices"):
        choose_loop(make_cfg("engine.num_devices=2", "engine.loop=plain"))
    with pytest.raises(ValueError, match="engine.loop must be one of auto, plain, lightning"):
        choose_loop(make_cfg("engine.loop=fast"))


def test_a_stage_interrupted_under_one_loop_resumes_there_or_says_how(make_cfg, tmp_path):
    folder = tmp_path / "stage"
    folder.mkdir()
    torch.save({"epoch": 0, "state_dict": {}, "callbacks": {}}, folder / "last.ckpt")  # Lightning's layout
    loop, why = choose_loop(make_cfg(), folder)
    assert loop == "lightning" and "resumes there" in why
    torch.save({"format": "ddcnn.tensor_fit/1", "epoch": 0}, folder / "last.ckpt")
    assert choose_loop(make_cfg(), folder)[0] == "plain"
    with pytest.raises(ValueError, match="engine.loop=plain to resume, or run with force=true"):
        choose_loop(make_cfg("engine.loop=lightning"), folder)


def test_batch_limits_follow_lightning():
    assert num_batches(10, None, "x") == 10
    assert num_batches(10, 4, "x") == 4 and num_batches(3, 4, "x") == 3
    assert num_batches(10, 0.25, "x") == 2 and num_batches(10, 0.01, "x") == 1 and num_batches(10, 1.0, "x") == 10
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="limit_train_batches"):
            num_batches(10, bad, "limit_train_batches")


def test_both_loops_train_a_stage_with_the_same_artifacts(make_cfg, tmp_path):
    metas = {}
    for loop in ("plain", "lightning"):
        cfg = make_cfg(
            "stage=local", "subdomain=0", "trainer.max_epochs=2", f"engine.loop={loop}", run_dir=tmp_path / loop
        )
        train(cfg)
        run = RunDir(tmp_path / loop)
        metas[loop] = run.meta("local", 0)
        folder = run.stage_dir("local", 0)
        for name in ("last.ckpt", "net.pt", "probs_train.pt", "probs_val.pt", "probs_test.pt", "logs/metrics.csv"):
            assert (folder / name).is_file(), (loop, name)
        lines = (folder / "logs" / "metrics.csv").read_text().splitlines()
        header = lines[0].split(",")
        assert {"epoch", "train_acc", "train_loss", "val_acc", "val_loss"} <= set(header), header
    assert metas["plain"]["loop"] == "plain" and metas["lightning"]["loop"] == "lightning"
    for meta in metas.values():
        assert meta["best_epoch"] in (0, 1) and meta["time_s"] > 0 and 0.0 <= meta["accuracy"]["test"] <= 1.0


def test_a_process_that_trains_with_the_plain_loop_never_imports_lightning(tmp_path):
    code = f"""
import sys
from tests.conftest import compose_config
from ddcnn.pipeline import train
train(compose_config(["stage=local", "subdomain=0"], {str(tmp_path / "run")!r}))
train(compose_config(["stage=global"], {str(tmp_path / "run")!r}))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning", "torchmetrics"))
assert not loaded, loaded
"""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert RunDir(tmp_path / "run").is_done("local", 0) and RunDir(tmp_path / "run").is_done("global")


def test_gradient_clipping_and_bf16_run_in_the_plain_loop(make_cfg, tmp_path):
    train(make_cfg("stage=local", "subdomain=0", "trainer.gradient_clip_val=0.5", "trainer.precision=bf16-mixed"))
    meta = RunDir(tmp_path / "run").meta("local", 0)
    assert meta["loop"] == "plain" and meta["accuracy"]["test"] >= 0.0
