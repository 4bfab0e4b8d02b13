"""Nothing lost: a local-net training killed with SIGKILL resumes and ends as an uninterrupted run would."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ddcnn.pipeline import train
from ddcnn.rundir import RunDir

OVERRIDES = [
    "model=vgg_small",
    "trainer.max_epochs=4",
    "trainer.enable_progress_bar=false",
    "engine.checkpoint_every_s=0",
    "data.train_subset=600",
    "data.test_subset=100",
    "stage=local",
    "subdomain=0",
]


def _command(run_dir) -> list[str]:
    code = "import sys; from ddcnn.cli import train_main; sys.argv[0] = 'ddcnn-train'; train_main()"
    return [sys.executable, "-c", code, *OVERRIDES, f"hydra.run.dir={run_dir}"]


def _epoch_of(path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=False)["epoch"])


@pytest.mark.slow
def test_sigkill_mid_training_resumes_and_matches_uninterrupted_run(make_cfg, tmp_path):
    killed_dir = tmp_path / "killed"
    last = killed_dir / "local" / "00" / "last.ckpt"
    proc = subprocess.Popen(_command(killed_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not last.is_file():
            assert proc.poll() is None, (
                f"training ended before the first checkpoint: {proc.stderr.read().decode()[-2000:]}"
            )
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.02)
        time.sleep(0.2)  # into the next epoch
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    run = RunDir(killed_dir)
    assert not run.is_done("local", 0)
    epoch_at_kill = _epoch_of(last)
    assert epoch_at_kill < 3, "the kill came too late to test resuming"

    rerun = subprocess.run(_command(killed_dir), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    meta = run.meta("local", 0)
    assert meta["resumed_from_epoch"] == epoch_at_kill  # resumed, not restarted
    # Its recorded time covers both processes: the killed one (up to its checkpoint) and the resumed one.
    assert meta["time_s_earlier_processes"] > 0
    assert meta["time_s"] > meta["time_s_earlier_processes"] and meta["fit_time_s"] > meta["time_s_earlier_processes"]
    # The training curve keeps every epoch, those before the resume included, each once.
    with (run.stage_dir("local", 0) / "logs" / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    val_epochs = [int(float(r["epoch"])) for r in rows if r.get("val_acc")]
    train_epochs = [int(float(r["epoch"])) for r in rows if r.get("train_acc")]
    assert val_epochs == [0, 1, 2, 3] and train_epochs == [0, 1, 2, 3], rows

    # The same seed without interruption gives the same predictions.
    reference = make_cfg(*OVERRIDES, run_dir=tmp_path / "reference", tiny=False)
    train(reference)
    ref = RunDir(tmp_path / "reference")
    assert ref.meta("local", 0)["resumed_from_epoch"] is None
    for split in ("val", "test"):
        a = run.load_probs("local", split, 0)["probs"]
        b = ref.load_probs("local", split, 0)["probs"]
        assert torch.allclose(a, b, atol=1e-5), f"{split} predictions differ after resuming"
    assert meta["accuracy"] == ref.meta("local", 0)["accuracy"]

    # Finished work is skipped, not recomputed.
    stamp = (run.stage_dir("local", 0) / "done").stat().st_mtime_ns
    again = subprocess.run(_command(killed_dir), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0
    assert (run.stage_dir("local", 0) / "done").stat().st_mtime_ns == stamp


def test_same_seed_gives_identical_predictions(make_cfg, tmp_path):
    first = make_cfg(run_dir=tmp_path / "a")
    second = make_cfg(run_dir=tmp_path / "b")
    ra, rb = train(first), train(second)
    assert ra["accuracy"] == rb["accuracy"]
    a, b = RunDir(tmp_path / "a"), RunDir(tmp_path / "b")
    for stage, sub in [*(("local", i) for i in range(4)), ("coarse", None), ("global", None)]:
        for split in ("train", "val", "test"):
            pa, pb = a.load_probs(stage, split, sub), b.load_probs(stage, split, sub)
            assert torch.equal(pa["logits"], pb["logits"]), f"{stage} {sub} {split} differs"


def test_force_recomputes(make_cfg):
    cfg = make_cfg("stage=local", "subdomain=1")
    train(cfg)
    run = RunDir(cfg.paths.run_dir)
    stamp = (run.stage_dir("local", 1) / "done").stat().st_mtime_ns
    time.sleep(0.01)
    train(make_cfg("stage=local", "subdomain=1", "force=true"))
    assert (run.stage_dir("local", 1) / "done").stat().st_mtime_ns > stamp


def test_local_seed_depends_only_on_run_seed_and_index():
    from ddcnn.context import subdomain_seed

    seeds = [subdomain_seed(0, i) for i in range(16)]
    assert len(set(seeds)) == 16
    assert seeds == [subdomain_seed(0, i) for i in range(16)]
    assert subdomain_seed(1, 0) != subdomain_seed(0, 0)
