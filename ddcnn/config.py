"""Where ddcnn's Hydra configuration lives, and composing it from Python (tests, notebooks, benchmarks).

An installed wheel carries the configuration inside the package (``ddcnn/conf/``, mapped from the repository's
top-level ``conf/`` by setuptools); a source checkout or editable install reads ``conf/`` beside ``ddcnn/``. Users
add their own configuration folder with Hydra's ``--config-dir DIR`` (its groups and files are searched before
ours, so ``DIR/data/my_data.yaml`` makes ``data=my_data`` available) or ``hydra.searchpath``.

:func:`compose` composes each choice of config groups once per process (while the YAML files are unchanged) and
applies the value overrides to a copy, as Hydra applies them after the groups: a test suite, a notebook or a sweep in
Python composing hundreds of configurations pays Hydra's defaults tree and YAML parsing once per choice of groups.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
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
    """``conf/config.yaml`` with ``overrides`` as the command line would give it, writing into ``run_dir``.

    The same configuration as Hydra's own compose, errors included: the config groups the overrides choose are
    composed by Hydra (once per process and choice while ``conf/`` is unchanged) and the value overrides (``key=v``,
    ``+key=v``, ``++key=v``, ``~key``) applied to a copy by Hydra's own rule, in their order, as Hydra applies them
    after the groups. Overrides of Hydra's node, sweeps and package overrides (``group@pkg=``) compose in full.
    """
    overrides = list(overrides)
    split = _split_overrides(overrides)
    if split is None:
        cfg = _hydra_compose(overrides)
    else:
        groups, values = split
        key = (_config_files_signature(CONFIG_DIR), tuple(groups))
        if key not in _COMPOSED:
            _COMPOSED[key] = _hydra_compose(groups)
            while len(_COMPOSED) > _COMPOSED_MAX:
                _COMPOSED.popitem(last=False)
        _COMPOSED.move_to_end(key)
        cfg = copy.deepcopy(_COMPOSED[key])
        if values:
            from hydra._internal.config_loader_impl import ConfigLoaderImpl

            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    if run_dir is not None:
        with open_dict(cfg):
            cfg.paths.run_dir = str(run_dir)
    return cfg


# Configurations composed from a choice of config groups: (conf/'s files, the group overrides) -> the configuration.
_COMPOSED: OrderedDict[tuple, DictConfig] = OrderedDict()
_COMPOSED_MAX = 64


def _hydra_compose(overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def _split_overrides(overrides: list[str]) -> tuple[list[str], list] | None:
    """The overrides that choose config groups (their text, in order) and the parsed value overrides, or ``None``
    where Hydra must compose all of them (an override of Hydra's node, a sweep, a package, or one it cannot parse:
    its own error then)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    except Exception:  # Hydra's compose raises its own error for it
        return None
    groups, values = [], []
    for override in parsed:
        if override.is_hydra_override() or override.is_sweep_override() or override.package is not None:
            return None
        if os.path.isdir(os.path.join(CONFIG_DIR, override.key_or_group)):  # Hydra's test: a folder of conf/
            groups.append(override.input_line)
        else:
            values.append(override)
    return groups, values


def _config_files_signature(root: str) -> tuple:
    """Each file under ``root`` with its size and modification time: a composed configuration is reused only while
    none of them changed (a YAML edited in a notebook session is read again)."""
    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            stat = os.stat(os.path.join(folder, name))
            found.append((folder, name, stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(found))
