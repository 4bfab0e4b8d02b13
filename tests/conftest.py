"""Shared fixtures: the real Hydra configuration, shrunk for fast CPU runs."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from omegaconf import DictConfig
from PIL import Image

from ddcnn.config import CONFIG_DIR, compose
from ddcnn.runtime import quiet_process

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
# The real datasets of this repository's development set-up; users point DDCNN_DATA at their own.
os.environ.setdefault("DDCNN_DATA", str(SHARED_DATA))
quiet_process()  # once for the test session, as the CLI and the workers do at their start

__all__ = [
    "CONFIG_DIR",
    "REPO",
    "SHARED_DATA",
    "TINY_OVERRIDES",
    "assert_real_png",
    "compose_config",
    "load_script",
    "mark_converged",
    "prepare_settings",
    "shared_data",
]

# The repository root (scripts outside the package: bench/, experiments/).
REPO = Path(__file__).resolve().parents[1]

TINY_OVERRIDES = [
    "model=vgg_tiny",
    "trainer.max_epochs=1",
    "trainer.enable_progress_bar=false",
    "trainer.limit_train_batches=4",
    "coarse.max_epochs=2",
    "data.train_subset=300",
    "data.test_subset=100",
    # Plots, the TorchScript export and the accuracy-versus-time curves have their own tests; elsewhere they would
    # only cost time.
    "report.plots=false",
    "report.export=false",
    "report.curves.enabled=false",
    # Every test trains the global CNN it checks: one reused from an earlier test's run would hide what it tests.
    # Reuse across runs has its own tests (tests/stages/test_reuse.py).
    "store.reuse=false",
]


@pytest.fixture(autouse=True, scope="session")
def _store_in_tmp(tmp_path_factory):
    """Prepared data that tests memory-map go to a store of the test session, never to the user's ~/.cache/ddcnn."""
    previous = os.environ.get("DDCNN_STORE")
    os.environ["DDCNN_STORE"] = str(tmp_path_factory.mktemp("store"))
    yield
    if previous is None:
        os.environ.pop("DDCNN_STORE", None)
    else:
        os.environ["DDCNN_STORE"] = previous


def compose_config(overrides: list[str] | None = None, run_dir: Path | None = None, tiny: bool = True) -> DictConfig:
    """The real ``conf/config.yaml`` with ``overrides`` (tiny settings first), run directory set."""
    return compose((TINY_OVERRIDES if tiny else []) + list(overrides or []), run_dir)


@pytest.fixture
def make_cfg(tmp_path: Path) -> Callable[..., DictConfig]:
    def make(*overrides: str, run_dir: Path | None = None, tiny: bool = True) -> DictConfig:
        return compose_config(list(overrides), run_dir or tmp_path / "run", tiny)

    return make


def prepare_settings(**given):
    """A :class:`~ddcnn.data.prepare.PrepareSettings` with the data group's defaults (``conf/data/_base.yaml``, their
    one home) and the ``given`` fields (``num_classes`` at least: the YAML leaves it to each dataset)."""
    import dataclasses

    from omegaconf import OmegaConf

    from ddcnn.data.prepare import PrepareSettings

    base = OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "data" / "_base.yaml"))
    if base["split_seed"] is None:  # null: the run's seed, which is 0 by default (conf/config.yaml)
        base["split_seed"] = 0
    names = [f.name for f in dataclasses.fields(PrepareSettings)]
    return PrepareSettings(**{name: given[name] if name in given else base[name] for name in names})


def load_script(relative: str, name: str):
    """A script of the repository that is not part of the package (``bench/gpu_check.py``, ``experiments/results.py``)
    imported as module ``name`` (registered in ``sys.modules``, as its dataclasses need), once per test session."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def shared_data(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"real dataset {path} is not present (it sits in ../shared/data beside the checkout)")
    return path


@functools.cache
def slurm_unavailable() -> str | None:
    """Why the SLURM tests cannot run here (``None`` when a controller answers ``scontrol ping`` within 5 s)."""
    if shutil.which("sbatch") is None:
        return "no SLURM cluster here (sbatch is not on PATH)"
    try:
        proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"sbatch is installed but no SLURM controller answers ({err})"
    if proc.returncode != 0 or "UP" not in proc.stdout:
        return f"sbatch is installed but no SLURM controller answers: {(proc.stdout + proc.stderr).strip()[:200]}"
    return None


def pytest_collection_modifyitems(config, items):
    """SLURM tests skip at once, with the reason, where no controller answers; in CI (which starts one) they fail."""
    slurm_items = [item for item in items if item.get_closest_marker("slurm")]
    if not slurm_items or (reason := slurm_unavailable()) is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        raise pytest.UsageError(f"CI runs the SLURM tests, but {reason}; .ci/run must start the cluster first.")
    for item in slurm_items:
        item.add_marker(pytest.mark.skip(reason=reason))


def assert_real_png(path: Path, min_side: int = 200, max_side: int = 4000) -> None:
    """``path`` is a decodable PNG of plausible size that shows something (not one flat colour)."""
    assert path.is_file(), f"{path} missing"
    assert path.stat().st_size > 2_000, f"{path} is suspiciously small ({path.stat().st_size} bytes)"
    with Image.open(path) as im:
        assert im.format == "PNG", path
        im.load()  # decodes every byte: a truncated file fails here
        width, height = im.size
        pixels = np.asarray(im.convert("L"), dtype=np.float64)
    assert min_side <= width <= max_side and min_side <= height <= max_side, f"{path}: {width}x{height}"
    assert pixels.std() > 5, f"{path} is (nearly) blank"
    assert (pixels < 128).mean() > 0.005, f"{path} holds almost no dark pixels (no text, lines or axes)"


def sigkill_after_first_checkpoint(cmd: list[str], last: Path, settle_s: float = 0.1, timeout_s: float = 120) -> None:
    """Start ``cmd`` (a training process), SIGKILL it ``settle_s`` after its first ``last.ckpt`` appears (so it dies
    mid-training, past a checkpoint) and check that the kill is what ended it."""
    import signal
    import time

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + timeout_s
        while not last.is_file():
            assert proc.poll() is None, f"training ended before its first checkpoint: {proc.stderr.read()[-2000:]!r}"
            assert time.monotonic() < deadline, f"no checkpoint within {timeout_s} s"
            time.sleep(0.01)
        time.sleep(settle_s)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL


def mark_converged(root: Path) -> None:
    """Record every training of a finished tiny run as converged in its meta.json (its 1-epoch trainings are too short
    to judge), so that a test can exercise the verdicts or make exactly one training unconverged."""
    for meta_path in Path(root).glob("**/meta.json"):
        meta = json.loads(meta_path.read_text())
        if "converged" in meta:
            meta["converged"] = True
            meta["convergence"] = {**(meta.get("convergence") or {}), "converged": True, "reasons": []}
            meta_path.write_text(json.dumps(meta))


def hooks_as_callbacks(keywords: dict) -> list:
    """The loop callbacks of the hook functions a test gives as keywords (removed from ``keywords``):
    ``on_epoch_end(epoch, row)`` and ``after_epoch(epoch, row, net)``."""
    from ddcnn.engine.callbacks import AfterValidation, OnEpochEnd

    out = []
    if (hook := keywords.pop("after_epoch", None)) is not None:
        out.append(AfterValidation(hook))
    if (hook := keywords.pop("on_epoch_end", None)) is not None:
        out.append(OnEpochEnd(hook))
    return out
