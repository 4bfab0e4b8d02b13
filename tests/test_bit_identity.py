"""tools/bit_identity.py compares two run directories: the same up to the clocks passes, a changed tensor, metrics row
or result fails (the check the loop's restructure is held to)."""

from __future__ import annotations

import json
import shutil

import torch

from tests.conftest import load_script

check = load_script("tools/bit_identity.py", "bit_identity")


def _run(root, weight: float = 1.0, acc: float = 0.5, fit_time: float = 1.0) -> None:
    folder = root / "local" / "00"
    (folder / "logs").mkdir(parents=True)
    ckpt = {"format": "ddcnn.loop/1", "net": {"w": torch.full((2,), weight)}, "fit_time_s": fit_time, "epoch": 2}
    torch.save(ckpt, folder / "last.ckpt")
    (folder / "logs" / "metrics.csv").write_text(f"epoch,step,val_acc,time_s\n0,3,{acc},{fit_time}\n")
    results = {"accuracy": {"cnn_dnn": acc}, "time_s": {"local": [fit_time]}, "timing": {"code": str(fit_time)}}
    (root / "results.json").write_text(json.dumps(results))


def test_runs_that_differ_only_in_their_clocks_are_the_same(tmp_path):
    _run(tmp_path / "a")
    _run(tmp_path / "b", fit_time=7.5)
    assert check.compare(tmp_path / "a", tmp_path / "b") == []


def test_a_changed_weight_metric_or_result_is_named(tmp_path):
    _run(tmp_path / "a")
    _run(tmp_path / "w", weight=1.0 + 1e-7)
    assert any("tensor(s) differ" in d for d in check.compare(tmp_path / "a", tmp_path / "w"))
    _run(tmp_path / "m", acc=0.51)
    found = check.compare(tmp_path / "a", tmp_path / "m")
    assert any("metrics.csv: differs" in d for d in found) and any("results.json differs" in d for d in found)
    shutil.rmtree(tmp_path / "m" / "local")
    assert any("trainings differ" in d for d in check.compare(tmp_path / "a", tmp_path / "m"))
