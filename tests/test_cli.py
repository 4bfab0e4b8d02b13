"""The ddcnn-train command as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import TINY_OVERRIDES


def _ddcnn_train() -> list[str]:
    exe = Path(sys.executable).parent / "ddcnn-train"
    return [str(exe)] if exe.is_file() else [shutil.which("ddcnn-train") or "ddcnn-train"]


def test_cli_runs_the_pipeline_and_prints_the_table(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [*_ddcnn_train(), *TINY_OVERRIDES, f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| CNN-DNN (coarse DNN on probs) |" in proc.stdout
    results = json.loads((run_dir / "results.json").read_text())
    assert set(results["accuracy"]) >= {"global", "cnn_dnn", "mean_prob", "majority_vote", "local"}
    assert (run_dir / "config.yaml").is_file() and (run_dir / ".hydra" / "overrides.yaml").is_file()


def test_cli_bad_input_is_one_sentence_not_a_traceback(tmp_path):
    proc = subprocess.run(
        [*_ddcnn_train(), *TINY_OVERRIDES, "decomposition.grid=[40,40]", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "ddcnn-train: error: grid (40, 40) asks for 40 sub-domains" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_value_for_sweepers_is_the_validation_figure_never_a_test_one(make_cfg):
    import pytest

    from ddcnn.cli import optimized_value
    from ddcnn.pipeline import train

    cfg = make_cfg("decomposition.grid=[1,2]")
    results = train(cfg)
    saved = json.loads((Path(cfg.paths.run_dir) / "results.json").read_text())
    value = optimized_value(cfg, results)
    assert value == saved["val"]["accuracy"]["cnn_dnn"]
    assert saved["val"]["accuracy"]["cnn_dnn"] == saved["val"]["accuracy"]["cnn_dnn_probs"]
    cfg.optimized_metric = "val/balanced_accuracy/global"
    assert optimized_value(cfg, results) == saved["val"]["balanced_accuracy"]["global"]
    for bad in ("accuracy/cnn_dnn", "test/accuracy/cnn_dnn"):
        cfg.optimized_metric = bad
        with pytest.raises(ValueError, match="must name a validation figure"):
            optimized_value(cfg, results)


def test_an_optuna_sweep_of_two_trials_tunes_on_validation(tmp_path):
    import pytest
    import yaml

    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    tiny = [o for o in TINY_OVERRIDES if not o.startswith("coarse.max_epochs")]
    proc = subprocess.run(
        [
            *_ddcnn_train(),
            "-m",
            "hparams_search=cnn_dnn_optuna",
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.sampler.n_startup_trials=2",
            *tiny,
            "decomposition.grid=[1,2]",
            f"hydra.sweep.dir={sweep}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    trials = [json.loads((sweep / str(i) / "results.json").read_text()) for i in range(2)]
    assert best["best_value"] == max(t["val"]["accuracy"]["cnn_dnn"] for t in trials)
    assert set(best["best_params"]) == {"optimizer.lr", "model.width_mult", "coarse.optimizer.lr", "coarse.net.hidden"}


def test_output_to_a_file_has_no_progress_redraws_and_one_line_per_epoch(tmp_path):
    overrides = [o for o in TINY_OVERRIDES if "enable_progress_bar" not in o]  # the default: bars only on a terminal
    log = tmp_path / "log.txt"
    with log.open("w") as out:
        proc = subprocess.run(
            [*_ddcnn_train(), *overrides, "trainer.max_epochs=3", f"hydra.run.dir={tmp_path / 'run'}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=600,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text, "carriage-return redraws in a log file"
    assert "| CNN-DNN (coarse DNN on probs) |" in text
    assert text.count("local 0: epoch") == 3 and "local 0: epoch 3/3" in text
    assert len(text.encode()) < 30_000
