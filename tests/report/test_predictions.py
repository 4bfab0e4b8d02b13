"""Every method's per-image test predictions, compactly (ddcnn/report/predictions.py), and the results page's snapshots
that keep them (experiments/results.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddcnn.io import atomic_torch_save
from ddcnn.report.predictions import PREDICTIONS_FILE, compact_test_predictions, read_compact_predictions
from ddcnn.rundir import RunDir
from tests.conftest import load_script


def _fake_run(root: Path, n_test: int, k: int, n: int = 2, seed: int = 0) -> RunDir:
    """A finished run directory as the stages leave it, with random test outputs: local nets, coarse (on logits) and
    the global CNN."""
    run = RunDir(root)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(k, (n_test,), generator=g)

    def stage(name: str, subdomain: int | None = None, **meta) -> torch.Tensor:
        folder = run.make_stage_dir(name, subdomain)
        logits = torch.randn(n_test, k, generator=g)
        atomic_torch_save({"logits": logits, "probs": logits.softmax(-1), "labels": labels}, folder / "probs_test.pt")
        run.mark_done(name, subdomain, {"stage": name, **meta})
        return logits.softmax(-1)

    for i in range(n):
        stage("local", i)
    stage("coarse", input="logits")
    stage("global")
    return run


def test_each_method_keeps_its_predicted_class_in_a_byte_per_test_image(tmp_path):
    run = _fake_run(tmp_path / "run", n_test=10_000, k=10)
    saved = compact_test_predictions(run.root)
    assert set(saved["methods"]) == {"mean_prob", "majority_vote", "cnn_dnn_logits", "global"}
    assert saved["aliases"] == {"cnn_dnn": "cnn_dnn_logits"}
    labels = run.load_probs("global", "test")["labels"]
    assert saved["labels"].dtype == torch.uint8 and torch.equal(saved["labels"].long(), labels)
    for stage, key in (("global", "global"), ("coarse", "cnn_dnn_logits")):
        entry = saved["methods"][key]
        assert set(entry) == {"pred"} and entry["pred"].dtype == torch.uint8  # no probabilities for 10 classes
        assert torch.equal(entry["pred"].long(), run.load_probs(stage, "test")["probs"].argmax(-1))
    local = torch.stack([run.load_probs("local", "test", i)["probs"] for i in range(2)], dim=1)
    assert torch.equal(saved["methods"]["mean_prob"]["pred"].long(), local.mean(1).argmax(-1))
    path = tmp_path / PREDICTIONS_FILE
    torch.save(saved, path)
    # 10 KB a method and 10 KB for the labels, and a little for the file's structure
    assert path.stat().st_size <= (4 + 1) * 10_000 + 4 * 1_024


def test_a_binary_task_keeps_the_probability_of_class_1_for_the_auc(tmp_path):
    from sklearn.metrics import roc_auc_score

    run = _fake_run(tmp_path / "run", n_test=298, k=2)
    path = tmp_path / PREDICTIONS_FILE
    torch.save(compact_test_predictions(run.root), path)
    saved = read_compact_predictions(path)
    full = run.load_probs("global", "test")
    prob1 = saved["methods"]["global"]["prob1"]
    assert torch.allclose(prob1, full["probs"][:, 1], atol=1e-3)
    y = full["labels"].numpy()
    assert roc_auc_score(y, prob1.numpy()) == pytest.approx(roc_auc_score(y, full["probs"][:, 1].numpy()), abs=1e-3)
    assert path.stat().st_size <= (4 * 3 + 1) * 298 + 4 * 1_024  # a byte and a float16 per image and method


def test_the_results_page_snapshot_keeps_them(tmp_path):
    page = load_script("experiments/results.py", "results_page")
    run = _fake_run(tmp_path / "run", n_test=100, k=10)
    (run.root / "results.json").write_text(json.dumps({"accuracy": {}}))
    page.save_snapshot(run.root, tmp_path / "snapshot")
    kept = read_compact_predictions(tmp_path / "snapshot" / PREDICTIONS_FILE)
    assert torch.equal(kept["methods"]["global"]["pred"], run.load_probs("global", "test")["probs"].argmax(-1))
    # a snapshot restored as a run directory (no stage outputs) is snapshotted again with its copy
    restored = tmp_path / "restored"
    page.save_snapshot(tmp_path / "snapshot", restored)
    assert (restored / PREDICTIONS_FILE).read_bytes() == (tmp_path / "snapshot" / PREDICTIONS_FILE).read_bytes()
