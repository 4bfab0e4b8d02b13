"""Where ddcnn's Hydra configuration lives, and composing it from Python (tests, notebooks, benchmarks).

An installed wheel carries the configuration inside the package (``ddcnn/conf/``, mapped from the repository's
top-level ``conf/`` by setuptools); a source checkout or editable install reads ``conf/`` beside ``ddcnn/``. Users
add their own configuration folder with Hydra's ``--config-dir DIR`` (its groups and files are searched before
ours, so ``DIR/data/my_data.yaml`` makes ``data=my_data`` available) or ``hydra.searchpath``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, open_dict

__all__ = ["CONFIG_DIR", "config_dir", "compose"]


def config_dir() -> str:
    """The folder of ``config.yaml``: inside the installed package, else the checkout's ``conf/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"ddcnn's configuration (config.yaml) is neither in {here / 'conf'} (an installed wheel) nor in "
        f"{here.parent / 'conf'} (a source checkout); reinstall ddcnn (pip install ddcnn, or pip install -e . in a "
        f"checkout)."
    )


CONFIG_DIR = config_dir()


def compose(overrides: Sequence[str] = (), run_dir: str | Path | None = None) -> DictConfig:
    """``conf/config.yaml`` with ``overrides`` as the command line would give it, writing into ``run_dir``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    if run_dir is not None:
        with open_dict(cfg):
            cfg.paths.run_dir = str(run_dir)
    return cfg
