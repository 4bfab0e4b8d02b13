"""Shared fixtures: the real Hydra configuration, shrunk for fast CPU runs."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf")
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

TINY_OVERRIDES = [
    "model=vgg_tiny",
    "trainer.max_epochs=1",
    "trainer.enable_progress_bar=false",
    "trainer.limit_train_batches=4",
    "coarse.max_epochs=2",
    "data.train_subset=300",
    "data.test_subset=100",
    # Plots and the TorchScript export have their own tests; elsewhere they would only cost time.
    "report.plots=false",
    "report.export=false",
]


def compose_config(overrides: list[str] | None = None, run_dir: Path | None = None, tiny: bool = True) -> DictConfig:
    """The real ``conf/config.yaml`` with ``overrides`` (tiny settings first), run directory set."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=(TINY_OVERRIDES if tiny else []) + list(overrides or []))
    if run_dir is not None:
        with open_dict(cfg):
            cfg.paths.run_dir = str(run_dir)
    return cfg


@pytest.fixture
def make_cfg(tmp_path: Path) -> Callable[..., DictConfig]:
    def make(*overrides: str, run_dir: Path | None = None, tiny: bool = True) -> DictConfig:
        return compose_config(list(overrides), run_dir or tmp_path / "run", tiny)

    return make


@pytest.fixture(autouse=True)
def _quiet_lightning():
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*Checkpoint directory.*exists and is not empty.*")
        yield


def shared_data(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"real dataset {path} is not present (it sits in ../shared/data beside the checkout)")
    return path
