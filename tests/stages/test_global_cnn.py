"""The global CNN's stage (ddcnn/stages/global_cnn.py): engine.activation_checkpointing=global reaches its training
alone; global_lr_scale sets the rate of the global arms alone."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import ddcnn.engine.loop as loop
from ddcnn.pipeline import train


def test_global_checkpointing_reaches_the_global_cnn_alone(make_cfg, monkeypatch) -> None:
    applied: list[str] = []
    original = loop.apply_checkpointing

    def recording(net):
        applied.append(type(net).__name__)
        return original(net)

    monkeypatch.setattr(loop, "apply_checkpointing", recording)
    train(make_cfg("stage=local", "engine.activation_checkpointing=global", "decomposition.grid=[1,2]"))
    assert applied == []  # the local nets read global as none
    train(make_cfg("stage=global", "engine.activation_checkpointing=global", "decomposition.grid=[1,2]"))
    assert applied == ["VGG"]


def _first_lr(folder: Path) -> float:
    with open(folder / "logs" / "metrics.csv") as f:
        return float(next(csv.DictReader(f))["lr"])


def test_global_lr_scale_sets_the_rate_of_every_global_arm_and_of_no_local_net(make_cfg, tmp_path) -> None:
    # The global baseline's own learning rate (docs/protocol.md 5b): optimizer.lr x global_lr_scale for the global CNN,
    # the ensemble's members and the wide global CNN; the local nets keep optimizer.lr.
    cfg = make_cfg(
        "decomposition.grid=[1,2]",
        "optimizer.lr=0.004",
        "global_lr_scale=0.25",
        "methods.enabled.coarse_alt=false",
        "methods.enabled.stacker=false",
        "methods.enabled.coarse_val=false",
        "methods.enabled.global_ensemble=true",
        "methods.global_ensemble.k=2",
        "methods.enabled.global_wide=true",
        run_dir=tmp_path / "run",
    )
    train(cfg)
    run = tmp_path / "run"
    scaled = [run / "global", run / "global_ensemble" / "00", run / "global_ensemble" / "01", run / "global_wide"]
    assert [_first_lr(f) for f in scaled] == pytest.approx([0.001] * 4)
    assert [_first_lr(run / "local" / f"{i:02d}") for i in range(2)] == pytest.approx([0.004] * 2)
    assert json.loads((run / "global" / "meta.json").read_text())["convergence"]["lr_start"] == pytest.approx(0.001)
    # A fresh run at 1 (the default written out) has the fingerprint of one that never names it.
    from ddcnn.settings import RunSettings

    def fingerprint(*overrides: str) -> str:
        return RunSettings.from_config(make_cfg(*overrides)).identity().fingerprint

    assert fingerprint("global_lr_scale=1.0") == fingerprint() != fingerprint("global_lr_scale=0.5")


@pytest.mark.parametrize("value", [0, -0.5, "fast", True, float("inf")])
def test_a_global_lr_scale_that_is_not_a_positive_number_is_refused(make_cfg, value) -> None:
    from ddcnn.settings import RunSettings

    with pytest.raises(ValueError, match=r"global_lr_scale must be a positive number \(a factor on optimizer.lr\)"):
        RunSettings.from_config(make_cfg(f"global_lr_scale={value}"))
