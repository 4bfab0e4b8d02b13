"""A tiny end-to-end CNN-DNN run through the real Hydra configuration, and stage-by-stage use."""

from __future__ import annotations

import json

import pytest
import torch

from ddcnn.pipeline import train
from ddcnn.rundir import FingerprintMismatch, RunDir
from ddcnn.settings import RunSettings


def test_tiny_run_writes_every_artifact_and_results(make_cfg, tmp_path):
    cfg = make_cfg()
    results = train(cfg)
    run = RunDir(cfg.paths.run_dir)
    for i in range(4):
        folder = run.stage_dir("local", i)
        for name in ("last.ckpt", "probs_train.pt", "probs_val.pt", "probs_test.pt", "net.pt", "done"):
            assert (folder / name).is_file(), f"{folder / name} missing"
    saved = json.loads((run.root / "results.json").read_text())
    acc = saved["accuracy"]
    assert set(acc) >= {"global", "cnn_dnn", "mean_prob", "majority_vote", "local"}
    assert len(acc["local"]) == 4
    assert all(0.0 <= a <= 1.0 for a in [acc["global"], acc["cnn_dnn"], *acc["local"]])
    assert set(saved["time_s"]) >= {"local", "coarse", "global"}
    assert saved["projected_speedup"] > 0
    assert results["accuracy"] == acc
    assert "| CNN-DNN (coarse DNN on probs) |" in (run.root / "results.md").read_text()
    # Local probabilities are proper distributions over num_classes for every test sample.
    probs = run.load_probs("local", "test", 0)["probs"]
    assert probs.shape == (100, 10)
    assert torch.allclose(probs.sum(-1), torch.ones(100), atol=1e-5)


def test_stages_one_at_a_time_and_finished_work_is_skipped(make_cfg):
    run_dir = None
    for i in range(4):
        cfg = make_cfg("stage=local", f"subdomain={i}")
        run_dir = cfg.paths.run_dir
        train(cfg)
    run = RunDir(run_dir)
    assert run.missing_local(4) == []
    stamp = (run.stage_dir("local", 2) / "done").stat().st_mtime_ns
    meta = train(make_cfg("stage=local", "subdomain=2"))["local"][0]
    assert (run.stage_dir("local", 2) / "done").stat().st_mtime_ns == stamp  # not retrained
    assert meta["subdomain"] == 2
    train(make_cfg("stage=coarse"))
    results = train(make_cfg("stage=evaluate"))
    assert results["accuracy"]["global"] is None  # global never ran: reported as missing, not invented
    assert results["accuracy"]["cnn_dnn"] is not None


def test_coarse_before_local_names_the_missing_nets(make_cfg):
    train(make_cfg("stage=local", "subdomain=[0,1]"))
    with pytest.raises(FileNotFoundError, match=r"local nets \[2, 3\] have not finished"):
        train(make_cfg("stage=coarse"))


def test_run_dir_of_another_configuration_is_refused(make_cfg):
    train(make_cfg("stage=local", "subdomain=0"))
    with pytest.raises(FingerprintMismatch, match="decomposition.overlap: 2 -> 1"):
        train(make_cfg("stage=local", "subdomain=1", "decomposition.overlap=1"))
    # Settings that do not change results may differ.
    train(make_cfg("stage=local", "subdomain=1", "trainer.enable_progress_bar=true", "parallel.workers=1"))


def test_settings_of_a_method_that_never_ran_may_change_and_are_then_recorded(make_cfg):
    cfg = make_cfg("stage=local", "subdomain=0")
    train(cfg)
    run = RunDir(cfg.paths.run_dir)
    # The out-of-fold stage never ran here: its k may change (switching on coarse_oof later with k=3 needs no new run
    # directory), and the new k is what the run then holds.
    run.claim(RunSettings.from_config(make_cfg("methods.local_oof.folds=3")).identity())
    recorded = json.loads((run.root / "fingerprint.json").read_text())
    assert recorded["settings"]["methods"]["local_oof"]["folds"] == 3
    (run.root / "local_oof").mkdir()  # once it has started, its settings are those it started with
    with pytest.raises(FingerprintMismatch, match="methods.local_oof.folds: 3 -> 5"):
        run.claim(RunSettings.from_config(make_cfg()).identity())
    # A method's settings never excuse another difference.
    with pytest.raises(FingerprintMismatch, match="seed: 0 -> 1"):
        run.claim(RunSettings.from_config(make_cfg("seed=1", "methods.e2e.lr_scale=0.5")).identity())


def test_three_dimensional_run(make_cfg, tmp_path):
    """The same pipeline on 3D volumes (digits stacked into tiny volumes would be artificial; use npz)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, size=(80, 8, 8, 8), dtype=np.uint8)
    y = (x[:, :4].mean(axis=(1, 2, 3)) > x[:, 4:].mean(axis=(1, 2, 3))).astype(np.int64)
    path = tmp_path / "vol.npz"
    np.savez(path, x_train=x[:60], y_train=y[:60], x_test=x[60:], y_test=y[60:])
    cfg = make_cfg(
        "data=mnist",
        f"data.path={path}",
        "data.source.spatial_dims=3",
        "data.spatial_dims=3",
        "data.num_classes=2",
        "data.train_subset=null",
        "data.test_subset=null",
        "decomposition=2x2x2",
        "decomposition.overlap=[1,1,0]",
    )
    results = train(cfg)
    assert len(results["accuracy"]["local"]) == 8
    assert results["decomposition"]["sub_shape"] == [5, 5, 4]


def test_a_setting_added_later_at_its_neutral_value_leaves_fingerprints_as_they_were(tmp_path):
    """engine.min_delta came after run directories and store entries were recorded without it: at 0 (any improvement
    counts, as before) it is not part of the fingerprint, so they stay valid; at another value it is."""
    from ddcnn.rundir import fingerprint
    from tests.conftest import compose_config

    cfg = compose_config([], tmp_path)
    assert cfg.engine.min_delta == 0.0
    settings = RunSettings.from_config(cfg).identity().settings
    assert "min_delta" not in settings["engine"]
    recorded_before = {**settings, "engine": {k: v for k, v in settings["engine"].items() if k != "min_delta"}}
    assert fingerprint(settings) == fingerprint(recorded_before)
    cfg.engine.min_delta = 0.002
    assert RunSettings.from_config(cfg).identity().settings["engine"]["min_delta"] == 0.002
