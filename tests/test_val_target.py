"""The held-out target split (``data.val_target_fraction``, docs/protocol.md §3): carved from validation, seen by no
choice, measured every epoch, and the fixed targets of both directions read on it."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch

from ddcnn.context import load_data
from ddcnn.pipeline import train
from ddcnn.report.curves import held_out_target, time_to_target
from ddcnn.rundir import RunDir, fingerprint
from ddcnn.settings import RunSettings


def test_the_target_split_is_a_stratified_part_of_validation_that_leaves_it(make_cfg):
    whole = load_data(RunSettings.from_config(make_cfg()))
    carved = load_data(RunSettings.from_config(make_cfg("data.val_target_fraction=0.4")))
    n_val, n_target = len(carved.y["val"]), len(carved.y["val_target"])
    assert n_val + n_target == len(whole.y["val"]) and n_target == pytest.approx(0.4 * len(whole.y["val"]), abs=10)
    assert carved.info["n_val"] == n_val and carved.info["n_val_target"] == n_target
    # Every class keeps samples on both sides, and together they are exactly the validation samples (same multiset of
    # images: the rows are moved, not copied from elsewhere).
    classes = set(whole.y["val"].tolist())
    assert set(carved.y["val"].tolist()) == classes == set(carved.y["val_target"].tolist())
    key = lambda x: sorted(map(tuple, x.flatten(1).tolist()))  # noqa: E731
    assert key(torch.cat([carved.stored["val"], carved.stored["val_target"]])) == key(whole.stored["val"])
    # Training and test splits are untouched.
    for split in ("train", "test"):
        assert torch.equal(carved.stored[split], whole.stored[split]) and torch.equal(carved.y[split], whole.y[split])


def test_where_validation_is_too_small_the_target_split_is_carved_from_training(make_cfg):
    """data.val_target_from=train: the target split is a stratified share of the training split, which keeps the rest;
    validation and test are untouched, and the fingerprint tells the two sources apart (val, the default, leaves it
    as it was)."""
    whole = load_data(RunSettings.from_config(make_cfg()))
    carved = load_data(RunSettings.from_config(make_cfg("data.val_target_fraction=0.2", "data.val_target_from=train")))
    n_train, n_target = len(carved.y["train"]), len(carved.y["val_target"])
    assert n_train + n_target == len(whole.y["train"]) and n_target == pytest.approx(
        0.2 * len(whole.y["train"]), abs=10
    )
    assert carved.info["n_train"] == n_train and carved.info["val_target_from"] == "train"
    key = lambda x: sorted(map(tuple, x.flatten(1).tolist()))  # noqa: E731
    assert key(torch.cat([carved.stored["train"], carved.stored["val_target"]])) == key(whole.stored["train"])
    for split in ("val", "test"):
        assert torch.equal(carved.stored[split], whole.stored[split]) and torch.equal(carved.y[split], whole.y[split])
    prints = {
        source: fingerprint(
            RunSettings.from_config(make_cfg("data.val_target_fraction=0.2", f"data.val_target_from={source}"))
            .identity()
            .settings
        )
        for source in ("val", "train")
    }
    plain = fingerprint(RunSettings.from_config(make_cfg("data.val_target_fraction=0.2")).identity().settings)
    assert prints["val"] == plain != prints["train"]
    with pytest.raises(ValueError, match="data.val_target_from must be one of val, train"):
        RunSettings.from_config(make_cfg("data.val_target_fraction=0.2", "data.val_target_from=test"))


def test_mapped_data_keep_the_carved_splits_in_a_worker(make_cfg):
    data = load_data(RunSettings.from_config(make_cfg("data.val_target_fraction=0.5", "data.memory.mode=mapped")))
    assert data.holding == "mapped"
    copy = pickle.loads(pickle.dumps(data))  # what a worker process or a DDP rank receives
    for split in ("train", "val", "val_target", "test"):
        assert torch.equal(copy.stored[split], data.stored[split]) and torch.equal(copy.y[split], data.y[split])


def test_a_target_fraction_of_zero_keeps_every_fingerprint(make_cfg):
    cfg = make_cfg()
    before = dict(RunSettings.from_config(cfg).identity().settings)
    before["data"] = {k: v for k, v in before["data"].items() if k != "val_target_fraction"}  # as older runs recorded
    assert fingerprint(RunSettings.from_config(cfg).identity().settings) == fingerprint(before)
    assert fingerprint(
        RunSettings.from_config(make_cfg("data.val_target_fraction=0.3")).identity().settings
    ) != fingerprint(before)


@pytest.mark.parametrize("value", [-0.1, 1.0, "half"])
def test_a_bad_target_fraction_is_refused_by_name(make_cfg, value, tmp_path):
    with pytest.raises(ValueError, match="data.val_target_fraction must lie in"):
        train(make_cfg(f"data.val_target_fraction={value}"))


def test_a_run_with_a_target_split_measures_both_targets_on_it_and_chooses_nothing_on_it(make_cfg):
    cfg = make_cfg(
        "decomposition.grid=[1,2]",
        "report.curves.enabled=true",
        "trainer.max_epochs=3",
        "data.val_fraction=0.3",
        "data.val_target_fraction=0.5",
    )
    results = train(cfg)
    run = RunDir(Path(cfg.paths.run_dir))
    n_target = results["data"]["n_val_target"]
    assert n_target > 0 and results["data"]["n_val"] > 0
    # Every training measured the target split each epoch, outside its clock; every stage saved its outputs there.
    for stage in ("global", "coarse"):
        saved = torch.load(run.stage_dir(stage) / "probs_val_target.pt", weights_only=True)
        assert len(saved["labels"]) == n_target
        # ... and its validation outputs are the rest only: selection saw none of the target samples.
        assert (
            len(torch.load(run.stage_dir(stage) / "probs_val.pt", weights_only=True)["labels"])
            == (results["data"]["n_val"])
        )
    header = (run.stage_dir("global") / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "val_target_acc" in header
    assert json.loads((run.stage_dir("global") / "meta.json").read_text())["accuracy"]["val_target"] is not None
    # Forward target: the global CNN's accuracy there minus one binomial standard error of that split.
    held = results["val_target"]["accuracy"]
    forward = results["time_to_target"]["target"]
    assert forward["split"] == "val_target" and forward["n_val_target"] == n_target
    se = math.sqrt(held["global"] * (1 - held["global"]) / n_target)
    assert forward["value"] == pytest.approx(held["global"] - se)
    # Reverse target: the CNN-DNN's accuracy there, the global CNN's time to it read on its val_target_acc curve.
    reverse = results["time_to_target_reverse"]["target"]
    assert reverse["value"] == pytest.approx(
        held["cnn_dnn"] - math.sqrt(held["cnn_dnn"] * (1 - held["cnn_dnn"]) / n_target)
    )
    assert "CNN-DNN" in reverse["source"] and "global" in results["time_to_target_reverse"]
    md = (run.root / "results.md").read_text()
    assert "Time to the reverse target (set by the CNN-DNN)" in md and "held-out target split accuracy" in md


def test_time_to_a_held_out_target_reads_each_methods_target_curve():
    target = held_out_target(0.9, 400, "global CNN", True)
    assert target["value"] == pytest.approx(0.9 - 0.015) and target["metric"] == "val_target_acc"
    curves = {
        # High on validation (its own choices) from epoch 1, but the held-out split says epoch 3.
        "global": {
            "epoch": [1, 2, 3],
            "time_s": [1.0, 2.0, 3.0],
            "val_acc": [0.95] * 3,
            "val_target_acc": [0.5, 0.8, 0.89],
        },
        "cnn_dnn": {"epoch": [1], "time_s": [1.0], "val_acc": [0.99]},  # no target curve: not measured
    }
    out = time_to_target(curves, target, {}, {"global": 1, "cnn_dnn": 2}, 2)
    assert out["global"]["reached"] and out["global"]["time_s"] == 3.0
    assert out["cnn_dnn"]["why_not"] == "no curve"
    assert held_out_target(None, 400, "CNN-DNN", True) is None and held_out_target(0.9, 0, "CNN-DNN", True) is None
