"""The run directory: the contract between stages.

Layout (sub-domain index ``i`` as in :mod:`ddcnn.decomposition`, zero-padded to two digits)::

    RUN_DIR/
      config.yaml           resolved configuration of the first run in this directory
      fingerprint.json      the settings that change results, and their hash
      local/i/              best.ckpt, last.ckpt, probs_{train,val,test}.pt, meta.json, done
      coarse/               the same files for the coarse DNN
      global/               the same files for the global CNN
      results.json, results.md

A stage reads only finished artifacts of earlier stages (those whose ``done`` marker exists) and writes
its own atomically: every file goes to a temporary name in the same folder and is renamed into place,
and ``done`` is written last, so a reader never mistakes a half-written stage for a finished one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

__all__ = [
    "RunDir",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_torch_save",
    "fingerprint",
    "FingerprintMismatch",
    "ArtifactWriteError",
    "make_dir",
]

# Settings that do not change results: where and how a run executes, and what it prints.
NON_RESULT_KEYS = (
    "stage",
    "subdomain",
    "force",
    "paths",
    "parallel",
    "hydra",
    "report",
    "methods.enabled",
    "trainer.enable_progress_bar",
    "trainer.log_every_n_steps",
    "trainer.accelerator",
    "trainer.devices",
)


class ArtifactWriteError(OSError):
    """An artifact could not be written (disk full, read-only or forbidden location)."""


def _write_error(path: Path, err: OSError) -> ArtifactWriteError:
    return ArtifactWriteError(
        err.errno,
        f"cannot write {path}: {err.strerror or err}. Nothing half-written was left behind; free disk space or "
        f"choose a writable run directory (hydra.run.dir=...), then run the same command again to continue.",
    )


def _atomic_write(path: Path, write) -> None:
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(err, ArtifactWriteError):
            raise
        raise _write_error(path, err) from err
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    _atomic_write(Path(path), lambda fh: fh.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    # Serialise in memory first: torch's zip writer reports a full disk as an obscure RuntimeError, a plain
    # file write as OSError(ENOSPC).
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getbuffer())


def make_dir(path: str | Path) -> Path:
    """``mkdir -p`` that reports an unwritable location as :class:`ArtifactWriteError`."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _write_error(path, err) from err
    return path


def _drop(container: dict, dotted: str) -> None:
    head, _, rest = dotted.partition(".")
    if head not in container:
        return
    if rest:
        if isinstance(container[head], dict):
            _drop(container[head], rest)
    else:
        del container[head]


def result_settings(cfg: DictConfig | Mapping) -> dict:
    """The part of the configuration that changes results (everything but :data:`NON_RESULT_KEYS`)."""
    if isinstance(cfg, DictConfig):
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    else:
        data = json.loads(json.dumps(cfg, default=str))
    for key in NON_RESULT_KEYS:
        _drop(data, key)
    return data


def fingerprint(settings: Mapping) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


class FingerprintMismatch(ValueError):
    """A run directory holds results of a different configuration."""


class RunDir:
    """Paths, markers and metadata of one run directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def stage_dir(self, stage: str, subdomain: int | None = None) -> Path:
        if stage == "local":
            if subdomain is None:
                raise ValueError("the local stage needs a sub-domain index.")
            return self.root / "local" / f"{subdomain:02d}"
        return self.root / stage

    def make_stage_dir(self, stage: str, subdomain: int | None = None) -> Path:
        return make_dir(self.stage_dir(stage, subdomain))

    def is_done(self, stage: str, subdomain: int | None = None) -> bool:
        return (self.stage_dir(stage, subdomain) / "done").is_file()

    def missing_local(self, num_subdomains: int) -> list[int]:
        return [i for i in range(num_subdomains) if not self.is_done("local", i)]

    def meta(self, stage: str, subdomain: int | None = None) -> dict:
        path = self.stage_dir(stage, subdomain) / "meta.json"
        if not self.is_done(stage, subdomain) or not path.is_file():
            name = stage if subdomain is None else f"{stage} {subdomain}"
            raise FileNotFoundError(f"stage {name} has not finished in {self.root}; run it first (stage={stage}).")
        return json.loads(path.read_text())

    def mark_done(self, stage: str, subdomain: int | None, meta: Mapping, required: Iterable[str] = ()) -> None:
        """Write ``meta.json`` then the ``done`` marker, after checking that every required file exists."""
        folder = self.stage_dir(stage, subdomain)
        missing = [name for name in required if not (folder / name).is_file()]
        if missing:
            raise RuntimeError(f"cannot mark {folder} finished: {missing} were not written.")
        atomic_write_json(folder / "meta.json", dict(meta))
        atomic_write_text(folder / "done", "")

    def clear(self, stage: str, subdomain: int | None = None) -> None:
        """Forget that a stage finished (for ``force=true``): its marker goes first, then its outputs."""
        folder = self.stage_dir(stage, subdomain)
        (folder / "done").unlink(missing_ok=True)
        for name in ("last.ckpt", "best.ckpt", "resumed_from_epoch"):
            (folder / name).unlink(missing_ok=True)

    def load_probs(self, stage: str, split: str, subdomain: int | None = None) -> dict[str, torch.Tensor]:
        if not self.is_done(stage, subdomain):
            name = stage if subdomain is None else f"{stage} sub-domain {subdomain}"
            raise FileNotFoundError(
                f"{name} has not finished in {self.root}; run stage={stage}"
                + ("" if subdomain is None else f" subdomain={subdomain}")
                + " first."
            )
        return torch.load(self.stage_dir(stage, subdomain) / f"probs_{split}.pt", weights_only=True)

    def check_fingerprint(self, cfg: DictConfig) -> str:
        """Record the configuration on first use; refuse a directory that holds another configuration.

        Raises:
            FingerprintMismatch: Naming the settings that differ.
        """
        settings = result_settings(cfg)
        fp = fingerprint(settings)
        path = self.root / "fingerprint.json"
        if path.is_file():
            recorded = json.loads(path.read_text())
            if recorded.get("fingerprint") != fp:
                old, new = _flatten(recorded.get("settings", {})), _flatten(settings)
                diff = sorted(k for k in old.keys() | new.keys() if old.get(k, "<unset>") != new.get(k, "<unset>"))
                shown = ", ".join(f"{k}: {old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}" for k in diff[:8])
                more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
                raise FingerprintMismatch(
                    f"run directory {self.root} holds results of a different configuration ({shown}{more}). "
                    f"Use a new run directory (hydra.run.dir=...), or restore those settings to resume this run."
                )
            return fp
        make_dir(self.root)
        atomic_write_json(path, {"fingerprint": fp, "settings": settings})
        if isinstance(cfg, DictConfig):
            atomic_write_text(self.root / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        return fp
