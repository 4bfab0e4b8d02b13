"""A wheel that works: built from the checkout, installed outside it, ``ddcnn-train`` runs from another folder."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("ddcnn-*.whl")
    return path


def test_wheel_holds_every_module_and_config_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ddcnn").rglob("*.py")}
    assert modules <= names, f"modules missing from the wheel (add their package to pyproject.toml): {modules - names}"
    configs = {"ddcnn/" + p.relative_to(ROOT).as_posix() for p in (ROOT / "conf").rglob("*.yaml")}
    assert configs <= names, f"config files missing from the wheel: {configs - names}"


@pytest.mark.slow
def test_installed_wheel_trains_from_another_directory(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run(
        [sys.executable, "-c", "import ddcnn.config as c; print(c.__file__); print(c.CONFIG_DIR)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0, where.stderr
    module, config_dir = where.stdout.split()
    assert Path(module).is_relative_to(target) and Path(config_dir) == target / "ddcnn" / "conf"
    code = "import sys; from ddcnn.cli import train_main; sys.argv[0] = 'ddcnn-train'; train_main()"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "model=vgg_tiny",
            "trainer.max_epochs=1",
            "trainer.limit_train_batches=2",
            "coarse.max_epochs=1",
            "data.train_subset=200",
            "data.test_subset=50",
            "decomposition.grid=[1,2]",
            "report.plots=false",
            "report.export=false",
            "hydra.run.dir=run",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (elsewhere / "run" / "results.json").is_file()
    assert "| global CNN |" in run.stdout
