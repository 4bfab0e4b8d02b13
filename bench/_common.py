"""Helpers shared by the benchmark scripts (not part of the package)."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
os.environ.setdefault("DDCNN_DATA", str(SHARED_DATA))  # this repository's development data; users set their own


def config(overrides: list[str], run_dir: Path) -> DictConfig:
    """The real ``conf/config.yaml`` with ``overrides``, writing into ``run_dir``. A benchmark times what it trains:
    the global CNN is never reused from an earlier run (``store.reuse=false`` unless ``overrides`` say otherwise)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["store.reuse=false", *overrides])
    with open_dict(cfg):
        cfg.paths.run_dir = str(run_dir)
    return cfg


def quiet() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("lightning_fabric", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
