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
