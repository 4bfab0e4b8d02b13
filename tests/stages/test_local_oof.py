"""Cross-fitted coarse inputs: out-of-fold local outputs (ddcnn/stages/local_oof.py) and the coarse DNNs fit on them
or on the validation split (coarse_oof, coarse_val)."""

from __future__ import annotations

import pytest
import torch

from ddcnn.io import load_run_file
from ddcnn.pipeline import train
from ddcnn.rundir import RunDir
from ddcnn.stages.local_oof import oof_folds


def test_the_folds_hold_out_every_training_row_exactly_once_stratified():
    labels = torch.arange(5).repeat(20)  # 5 classes, 20 rows each
    folds = oof_folds(labels, 4, seed=0)
    held = torch.cat(folds)
    assert sorted(held.tolist()) == list(range(100))
    for fold in folds:
        assert torch.bincount(labels[fold], minlength=5).tolist() == [5] * 5
    assert [f.tolist() for f in oof_folds(labels, 4, seed=0)] == [f.tolist() for f in folds]  # fixed by the seed
    with pytest.raises(ValueError, match="folds must be >= 2"):
        oof_folds(labels, 1, seed=0)


def test_out_of_fold_and_validation_fits_give_their_rows(make_cfg):
    cfg = make_cfg(
        "decomposition.grid=[1,2]",
        "methods.enabled.coarse_oof=true",
        "methods.enabled.coarse_val=true",
        "methods.local_oof.folds=2",
    )
    results = train(cfg)
    run = RunDir(cfg.paths.run_dir)
    n_train = len(run.load_probs("local", "train", 0)["labels"])
    for i in range(2):
        meta = run.meta("local_oof", i)
        records = meta["folds"]
        assert [r["fold"] for r in records] == [0, 1]
        # a fold's done.pt (read again when the stage resumes) holds tensors and plain types only
        assert load_run_file(run.stage_dir("local_oof", i) / "fold_0" / "done.pt")["record"] == records[0]
        assert all(r["n_fit"] + r["n_held_out"] == n_train for r in records)
        assert sum(r["n_held_out"] for r in records) == n_train
        saved = run.load_probs("local_oof", "train", i)
        assert saved["logits"].shape == (n_train, 10) and torch.isfinite(saved["logits"]).all()
        # Out of fold: not the local net's own (in-sample) outputs.
        assert not torch.equal(saved["logits"], run.load_probs("local", "train", i)["logits"])
    assert run.meta("coarse_oof")["fit_on"] == "out_of_fold"
    val_meta = run.meta("coarse_val")
    n_val = results["data"]["n_val"]
    assert val_meta["fit_on"] == "val" and val_meta["fit"]["plan"]["steps_per_epoch"] * 32 >= n_val // 2
    rows = {row["key"]: row for row in results["methods"]}
    t = results["time_s"]
    assert rows["cnn_dnn_oof"]["sequential_time_s"] == pytest.approx(
        t["local_total"] + t["local_oof"] + t["coarse_oof"]
    )
    assert rows["cnn_dnn_oof"]["projected_time_s"] == pytest.approx(t["local_oof_max"] + t["coarse_oof"])
    assert t["local_oof_max"] > t["local_max"]
    assert rows["cnn_dnn_val"]["projected_time_s"] == pytest.approx(t["local_max"] + t["coarse_val"])
