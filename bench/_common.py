"""Helpers shared by the benchmark scripts (not part of the package)."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
os.environ.setdefault("DDCNN_DATA", str(SHARED_DATA))  # this repository's development data; users set their own

# ``ddcnn-train`` as a subprocess: this interpreter, and this checkout's ddcnn through :func:`train_env`.
TRAIN = [
    sys.executable,
    "-c",
    "import sys; from ddcnn.cli import train_main; sys.argv[0] = 'ddcnn-train'; train_main()",
]
# The rows bench/speedup.py and bench/coarse.py share: the default demo (digits 2x2) and MNIST 10k at 2 epochs.
ROWS = {
    "digits": [],
    "mnist_2x2": ["data=mnist", "data.train_subset=10000", "trainer.max_epochs=2"],
    "mnist_4x4": [
        "data=mnist",
        "data.train_subset=10000",
        "trainer.max_epochs=2",
        "decomposition=4x4",
        "decomposition.overlap=1",
    ],
}


def train_env(**extra: str) -> dict[str, str]:
    """The environment of a :data:`TRAIN` subprocess: this checkout's ddcnn first on ``PYTHONPATH``, ``DDCNN_DATA``
    set (the shared development data unless the caller's environment names other), then ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "DDCNN_DATA": os.environ.get("DDCNN_DATA", str(SHARED_DATA)), **extra}


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
