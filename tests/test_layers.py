"""The package's layers, as import-linter contracts in pyproject.toml: an upward import or a circle fails here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = Path(sys.executable).parent / "lint-imports"
    command = [str(exe)] if exe.is_file() else [shutil.which("lint-imports") or "lint-imports"]
    proc = subprocess.run(
        [*command, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_a_forbidden_import_is_caught(tmp_path):
    """The contracts can fail: a copy of the package whose report imports the engine breaks one."""
    if not (Path(sys.executable).parent / "lint-imports").is_file():
        pytest.skip("lint-imports is not installed beside this Python")
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "ddcnn", copy / "ddcnn", ignore=shutil.ignore_patterns("__pycache__", "conf"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    bad = copy / "ddcnn" / "report" / "combiners.py"
    bad.write_text(bad.read_text() + "\nfrom ddcnn.engine.loop import fit_batches  # noqa: E402,F401\n")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports")],
        cwd=copy,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode != 0
    assert "BROKEN" in proc.stdout and "ddcnn.report.combiners -> ddcnn.engine.loop" in proc.stdout
