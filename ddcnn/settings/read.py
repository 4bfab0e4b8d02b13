"""How a section of the composed configuration is read into the settings: key by key, a missing key taking the
default its YAML file states (:func:`yaml_default`), and what is left unread refused with the known keys listed
(:class:`Section`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["AUTO", "Section", "yaml_default", "positive_int"]

AUTO = "auto"
# The YAML file of each section's default (the group's default option; the top level is config.yaml).
_DEFAULT_FILES = {
    "": "config.yaml",
    "data": "data/_base.yaml",
    "coarse": "coarse/mlp.yaml",
    "trainer": "trainer/default.yaml",
    "engine": "engine/default.yaml",
    "parallel": "parallel/default.yaml",
    "methods": "methods/default.yaml",
}


def positive_int(value: Any, key: str, *, auto: bool = False, none: bool = False) -> Any:
    """``value`` as a whole number >= 1, the one check of such a setting (``auto`` or ``None`` pass where allowed).

    Raises:
        ValueError: Naming ``key``, the value and what to set.
    """
    if (auto and value == AUTO) or (none and value is None):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        also = " or auto (taken from the data)" if auto else ""
        raise ValueError(
            f"{key} must be a positive whole number{also}, got {value!r}; set {key}=<n> with n >= 1{also}."
        )
    return int(value)


@functools.cache
def _default_file(name: str) -> dict:
    from omegaconf import OmegaConf

    from ddcnn.config import CONFIG_DIR

    node = OmegaConf.load(Path(CONFIG_DIR) / name)
    return OmegaConf.to_container(node, resolve=False)


def yaml_default(key: str) -> Any:
    """The default of setting ``key`` (``store.reuse``, ``data.val_fraction``) as its YAML file states it.

    Raises:
        KeyError: For a key that has no default in the YAML.
    """
    section, _, rest = key.partition(".")
    if section in _DEFAULT_FILES and rest:
        node, parts = _default_file(_DEFAULT_FILES[section]), rest.split(".")
    else:
        node, parts = _default_file(_DEFAULT_FILES[""]), key.split(".")
    for part in parts:
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(f"{key} has no default in conf/ ({_DEFAULT_FILES.get(section, 'config.yaml')})")
        node = node[part]
    return node


class Section:
    """One mapping of the configuration read key by key: a missing key takes its YAML default; what is left unread
    is refused by :meth:`done`, with the known keys listed.

    ``added``: the defaults of keys a user adds with ``+section.key=value``, which the YAML cannot hold (Hydra refuses
    ``+`` for a key it has).
    """

    def __init__(self, name: str, given: Any, added: Mapping[str, Any] | None = None) -> None:
        self.name = name
        self.given = dict(given or {})
        self.added = dict(added or {})
        self.read: list[str] = []

    def __call__(self, key: str) -> Any:
        self.read.append(key)
        if key in self.given:
            return self.given[key]
        if key in self.added:
            return self.added[key]
        return yaml_default(f"{self.name}.{key}" if self.name else key)

    def default(self, key: str) -> Any:
        """The value of ``key``, its YAML default where it is given as ``null``."""
        value = self(key)
        if value is not None:
            return value
        return self.added[key] if key in self.added else yaml_default(f"{self.name}.{key}" if self.name else key)

    def sub(self, key: str) -> Section:
        node = self(key)
        name = f"{self.name}.{key}" if self.name else key
        return Section(name, {"enabled": node} if isinstance(node, bool) else node)

    def done(self, result: Any = None, extra_known: tuple[str, ...] = ()) -> Any:
        """Refuse what is left unread, with the known keys listed; return ``result`` (what was read from here)."""
        known = list(dict.fromkeys([*self.read, *extra_known]))
        unknown = [k for k in self.given if k not in known]
        if unknown:
            where = f"{self.name}." if self.name else ""
            key = unknown[0]
            settings = f"the {self.name or 'top-level'} settings are {', '.join(known)}" if known else "it has none"
            raise ValueError(
                f"{where}{key}={self.given[key]!r} is not a setting of ddcnn; {settings}. Remove it (or fix its "
                f"spelling)."
            )
        return result
