"""Console entry points. Thin: they parse the command line with Hydra and call library functions."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ddcnn.training.pipeline import train

# conf/ lives at the repository top level beside ddcnn/ (the package is installed editable: pip install -e .).
CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def _train_main(cfg: DictConfig) -> float | None:
    try:
        results = train(cfg)
    except (ValueError, OSError) as err:  # ours carry a sentence that says what is wrong and what to do
        print(f"ddcnn-train: error: {err}", file=sys.stderr)
        sys.exit(2)
    # The returned value is what Hydra sweepers optimise.
    acc = results.get("accuracy", {}).get("cnn_dnn") if isinstance(results, dict) else None
    return acc


def train_main() -> None:
    """``ddcnn-train [hydra overrides]``: run the CNN-DNN pipeline (or one stage of it)."""
    _train_main()
