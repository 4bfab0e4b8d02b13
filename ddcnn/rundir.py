"""The run directory: the contract between stages.

Layout (sub-domain index ``i`` as in :mod:`ddcnn.decomposition`, zero-padded to two digits)::

    RUN_DIR/
      config.yaml           resolved configuration of the first run in this directory
      fingerprint.json      the settings that change results, and their hash
      splits.csv            which image is in which split: file (or the row of a source of arrays), split, class
      local/00/, 01, ...    last.ckpt (with the best weights so far), probs_{train,val,test}.pt, net.pt, meta.json, done
      coarse/               the same files for the coarse DNN
      global/               the same files for the global CNN
      results.json, results.md

A stage reads only finished artifacts of earlier stages (those whose ``done`` marker exists) and writes
its own atomically: every file goes to a temporary name in the same folder and is renamed into place,
and ``done`` is written last, so a reader never mistakes a half-written stage for a finished one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from ddcnn.io import (
    ArtifactWriteError,
    atomic_torch_save,
    atomic_write_json,
    atomic_write_text,
    load_run_file,
    make_dir,
)

__all__ = [
    "RunDir",
    "SPLITS",
    "TARGET_SPLIT",
    "PROB_FILES",
    "CURVE_FILE",
    "SPLIT_MANIFEST",
    "NON_RESULT_KEYS",
    "fingerprint",
    "file_sha256",
    "network_identity",
    "flatten",
    "result_settings",
    "FingerprintMismatch",
    "L2_GRID",
    "StageLock",
    "StageBusy",
    "ArtifactWriteError",
    "atomic_torch_save",
    "atomic_write_json",
    "atomic_write_text",
    "make_dir",
]

# The data splits of every run, in this order: a stage saves probs_<split>.pt for each.
SPLITS = ("train", "val", "test")
PROB_FILES = tuple(f"probs_{s}.pt" for s in SPLITS)
# The part of the validation split no choice sees (data.val_target_fraction > 0): the loop measures it every epoch
# (val_target_acc) and stages save probs_val_target.pt beside the others, for the fixed targets of docs/protocol.md.
TARGET_SPLIT = "val_target"
# The CNN-DNN's accuracy-versus-training-time curve, in the coarse stage's folder (written by the coarse stage).
CURVE_FILE = "curve.json"
# Which image is in which split (file, split, class): written once per run directory by the first process that prepared
# its data (ddcnn.context.write_split_manifest), so that a user finds the test images.
SPLIT_MANIFEST = "splits.csv"

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
    "device",
    "engine.checkpoint_every_s",
    "engine.loop",  # which loop trained a stage is in its meta.json ("loop")
    # The GPU policy follows the device (itself not a result setting); meta.json records what each stage used.
    "engine.channels_last",
    "engine.tf32",
    "engine.cudnn_benchmark",
    "engine.data_on_device",
    "engine.device_data_fraction",
    "engine.compile",
    "engine.profile_steps",
    "engine.activation_checkpointing",  # recomputes what it would have kept: bit-identical results (float64, CPU)
    "coarse.checkpoint_every",
    "coarse.num_threads",
    "optimized_metric",
    "run_generation",
    "logger",
    "store",  # where prepared data and global CNNs are kept, and whether a global CNN is reused (same result)
    "data.memory",  # how a process holds them (in memory or memory-mapped): the same numbers either way
)
# Settings that moved: a run directory recorded under the old name still matches (old -> new).
RENAMED_KEYS = {
    "trainer.monitor": "engine.monitor",
    "trainer.monitor_mode": "engine.monitor_mode",
    "trainer.num_devices": "engine.num_devices",
}


_ABSENT = object()
# The L2 strengths the convex combiners try (coarse.linear.l2_grid, methods.stacker.l2_grid: the YAML holds the same),
# from nearly the prior (10 on standardised features) to nearly unpenalised.
L2_GRID = (10.0, 1.0, 0.1, 0.01, 0.001, 0.0001)
# Settings added since a run directory may have been recorded, at their defaults: a record without the key matches
# a configuration that has this value (a run recorded before the key existed was trained as that default does).
ADDED_DEFAULTS: dict[str, Any] = {
    "coarse.steps": 400,
    "coarse.monitor": "val_acc",
    "coarse.patience": 3,
    "coarse.divergence_restarts": 3,
    "coarse.linear.enabled": True,
    "coarse.linear.l2_grid": list(L2_GRID),
    "coarse.linear.max_rows": 10000,
    "coarse.linear.max_iter": 200,
    "coarse.net.input_norm": "standardize",
    "coarse.net.skip": "mean_prob",
    "coarse.net.linear": True,
    "coarse.scheduler._target_": "torch.optim.lr_scheduler.CosineAnnealingLR",
    "coarse.scheduler._partial_": True,
    "methods.stacker.l2_grid": list(L2_GRID),
    "methods.stacker.max_iter": 200,
    "methods.local_oof.folds": 5,
    # The image-folder source's reading settings (ddcnn.data.images): a run recorded without them read as these do.
    "data.resize_mode": "stretch",
    "data.source.resize_mode": "stretch",
    "data.source.background": 0,
    "data.source.on_bad_file": "error",
    "data.source.duplicates": "report",
    "data.source.class_map": None,
}
# What a record without the key held, where today's default differs (ddcnn.settings.run.OLD_RECIPE): min_epochs is
# left out while patience is null (INERT_WITHOUT), min_steps and precise_bn at 0 and global_lr_scale at 1
# (NEUTRAL_SETTINGS), the scheduler's null kept.
RECORD_ABSENT_MEANS: dict[str, Any] = {
    "engine.min_epochs": None,
    "engine.min_steps": 0,
    "engine.precise_bn": 0,
    "global_lr_scale": 1.0,
}


def absent_means(key: str, absent: Any = None) -> Any:
    """What a record (maybe of an older ddcnn) that lacks ``key`` trained with: the key's value before it was
    recorded (:data:`RECORD_ABSENT_MEANS`) or its default when added (:data:`ADDED_DEFAULTS`); ``absent`` for a key
    of neither."""
    if key in RECORD_ABSENT_MEANS:
        return RECORD_ABSENT_MEANS[key]
    return ADDED_DEFAULTS.get(key, absent)


# Defaults that changed: a record with the old default matches a configuration with the new one (key -> (old, new)).
# The coarse DNN's recipe: a finished coarse stage stays finished, and its meta.json records how it was
# trained (coarse_net, fit); force=true retrains it with today's recipe.
CHANGED_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "coarse.max_epochs": (8, "auto"),
    "coarse.batch_size": (1024, "auto"),
    "coarse.optimizer.lr": (0.02, 0.003),
    # The image-folder source reads data.in_channels channels (auto: those of the images); a run recorded with
    # grayscale=true recorded data.in_channels=1 too, which the resolved count must match.
    "data.source.grayscale": (True, None),
    # Decided by the results page (docs/protocol.md section 6): probs until 2026-12-04, logits until 2026-12-07 (the
    # regenerated page's re-check failed criterion 1), probs since. A run recorded with probs matches today's default
    # as it is; one recorded with logits resumes under today's. A finished coarse stage keeps its input (its meta.json
    # records it, and the evaluation reads it from there); coarse_alt then trains the other one.
    "coarse.input": ("logits", "probs"),
    # The data draw follows the seed (null: the run's seed; config.yaml records the number). A run directory recorded
    # with the old default resumes with it (ddcnn.settings.RunSettings.in_run_dir), on the data its stages trained on;
    # at seed 0 the two are the same draw.
    "data.split_seed": (0, None),
}


def _same_value(key: str, old: Any, new: Any) -> bool:
    if old == new:
        return True
    if old is _ABSENT:
        return key in ADDED_DEFAULTS and new == ADDED_DEFAULTS[key]
    if key in CHANGED_DEFAULTS:
        before, now = CHANGED_DEFAULTS[key]
        return old == before and new == now
    return False


def flatten_recorded(recorded: Mapping) -> dict[str, Any]:
    """Recorded settings (maybe of an older ddcnn) flattened, each key under its name today (:data:`RENAMED_KEYS`)."""
    return {RENAMED_KEYS.get(k, k): v for k, v in flatten(recorded).items()}


def _differences(recorded: Mapping, settings: Mapping) -> dict[str, tuple[Any, Any]]:
    """The keys in which recorded settings (maybe of an older ddcnn) differ from ``settings``, up to renamed keys,
    keys that no longer change results, keys added since with a null value or their default
    (:data:`ADDED_DEFAULTS`), and defaults that changed (:data:`CHANGED_DEFAULTS`): ``{key: (recorded, now)}``."""
    old = flatten_recorded(recorded)
    old = {k: v for k, v in old.items() if not any(k == p or k.startswith(p + ".") for p in NON_RESULT_KEYS)}
    new = flatten(settings)
    out = {}
    for key in sorted(old.keys() | new.keys()):
        before, now = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if (before is _ABSENT and now is None) or (before is None and now is _ABSENT):
            continue  # a key added or removed since, whose value is null
        if not _same_value(key, before, now):
            out[key] = (before, now)
    return out


def _drop(container: dict, dotted: str, prune: bool = False) -> None:
    """Remove ``dotted`` from ``container``; ``prune``: and the sections that this leaves empty (a method whose only
    setting is at its neutral value is then absent, as before it existed)."""
    head, _, rest = dotted.partition(".")
    if head not in container:
        return
    if rest:
        if isinstance(container[head], dict):
            _drop(container[head], rest, prune)
            if prune and not container[head]:
                del container[head]
    else:
        del container[head]


# Settings added after run directories were first recorded, with the value that behaves as before they existed: at
# that value they are left out of the fingerprint, so existing run directories (and the store's keys) stay valid.
NEUTRAL_SETTINGS = {
    "engine.min_delta": 0.0,
    "data.val_target_fraction": 0.0,
    "data.val_target_from": "val",
    "engine.min_steps": 0,
    "methods.global_ensemble.k": "auto",
    "engine.precise_bn": 0,
    "global_lr_scale": 1.0,
}
# Settings that change nothing while another one is null (setting -> the one it needs): left out of the fingerprint
# then, whatever their value (engine.min_epochs only delays early stopping, which engine.patience=null switches off).
INERT_WITHOUT = {"engine.min_epochs": "engine.patience", "engine.min_steps": "engine.patience"}

_SHA256: dict[tuple, str] = {}


def file_sha256(path: str | Path) -> str:
    """The SHA-256 (hex) of a file's content, computed once per process and file version (path, size, mtime)."""
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA256:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        _SHA256[key] = digest.hexdigest()
    return _SHA256[key]


def network_identity(spec: Mapping | None) -> Any:
    """A network's settings as results depend on them: its pretrained weights file (``weights``) by content
    (``sha256:<hex>``), not by path, and left out when there is none, so that a network without weights has the
    identity it had before the setting existed."""
    if not isinstance(spec, Mapping) or "weights" not in spec:
        return spec
    out = dict(spec)
    path = out.pop("weights")
    if isinstance(path, str) and path.startswith("sha256:"):  # already an identity
        out["weights"] = path
    elif path is not None:
        if not Path(str(path)).expanduser().is_file():
            raise FileNotFoundError(
                f"model.weights={str(path)!r}: no such file; pass the path of a local file of weights, or "
                f"model.weights=null."
            )
        out["weights"] = f"sha256:{file_sha256(str(path))}"
    return out


# The generator of the augmentation's draws (ddcnn.data.augment.RNG_VERSION): part of the fingerprint of an augmented
# run (data.augment.rng), whose results it changes; an unaugmented run's fingerprint does not hold it.
AUGMENT_RNG = "splitmix64/1"


def result_settings(plain: Mapping) -> dict:
    """The part of the configuration ``plain`` (plain data, interpolations resolved) that changes results: everything
    but :data:`NON_RESULT_KEYS`, the settings of :data:`NEUTRAL_SETTINGS` at their neutral value, and those of
    :data:`INERT_WITHOUT` while the setting they need is null."""
    data = json.loads(json.dumps(plain, default=str))
    for key in NON_RESULT_KEYS:
        _drop(data, key)
    for key in ("model", "global_model"):  # pretrained weights by content, not by path
        if isinstance(data.get(key), dict):
            data[key] = network_identity(data[key])
    flat = flatten(data)
    for key, neutral in NEUTRAL_SETTINGS.items():
        if key in flat and flat[key] == neutral:
            _drop(data, key, prune=True)
    for key, needs in INERT_WITHOUT.items():
        if key in flat and flat.get(needs) is None:
            _drop(data, key)
    augment = data.get("data", {}).get("augment") if isinstance(data.get("data"), dict) else None
    if isinstance(augment, dict) and (augment.get("flip_axes") or float(augment.get("rotate_deg") or 0) > 0):
        augment["rng"] = AUGMENT_RNG
    return data


def fingerprint(settings: Mapping) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunIdentity:
    """What a run directory records of the configuration that claims it (:meth:`RunDir.claim`): the settings that
    change results (:func:`result_settings`), their fingerprint and the configuration as ``config.yaml``; built from
    the plain configuration the settings record (:meth:`ddcnn.settings.RunSettings.identity`)."""

    settings: dict
    config_yaml: str

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.settings)

    @classmethod
    def of(cls, plain: Mapping, num_classes: int | None = None, in_channels: int | None = None) -> RunIdentity:
        """The identity of the configuration ``plain`` (plain data, interpolations resolved:
        :attr:`ddcnn.settings.RunSettings.recorded`), with ``data.num_classes`` / ``data.in_channels`` that are
        ``auto`` set to the data's (a run of 4 classes is not a run of 5)."""
        counts = {"num_classes": num_classes, "in_channels": in_channels}
        data = plain.get("data") or {}
        auto = {key: int(value) for key, value in counts.items() if value is not None and data.get(key) == "auto"}
        if auto:
            plain = {**plain, "data": {**data, **auto}}
        return cls(result_settings(plain), OmegaConf.to_yaml(plain))


def flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class FingerprintMismatch(ValueError):
    """A run directory holds results of a different configuration."""


class StageBusy(RuntimeError):
    """Another process owns the stage folder (with ``wait=False``)."""


class StageLock:
    """One owner per stage folder: an exclusive ``flock`` (``filelock.FileLock``) on ``.<folder>.lock`` beside it.

    A second process for the same stage waits for the owner and then sees its finished work (and skips it), rather
    than refusing: a requeued SLURM task whose old copy still runs, or a command started twice, then simply does
    the work once. While it waits it says who holds the lock (host, pid, since when, from ``.<folder>.owner``).
    The kernel releases an ``flock`` when its process dies, however it dies, so a dead owner's lock is taken over at
    once; on NFS (v4) the server does the same when the dead client's lease expires.
    """

    # Threads of this process now waiting for another process's lock (a worker's heartbeat does not count the wait
    # as its main thread being stuck).
    waiting = 0

    def __init__(self, run: RunDir, stage: str, subdomain: int | None = None, wait: bool = True) -> None:
        from filelock import FileLock

        folder = run.stage_dir(stage, subdomain)
        self.name = stage if subdomain is None else f"local {subdomain}"
        self.path = folder.parent / f".{folder.name}.lock"
        self.owner_path = folder.parent / f".{folder.name}.owner"
        self.wait = wait
        self._lock = FileLock(self.path, thread_local=False)

    def holder(self) -> str:
        try:
            info = json.loads(self.owner_path.read_text())
            return f"pid {info['pid']} on {info['host']} since {info['since']}"
        except (OSError, ValueError, KeyError):
            return "another process"

    def __enter__(self) -> StageLock:
        import logging
        import os
        import socket
        import time

        from filelock import Timeout

        make_dir(self.path.parent)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            if not self.wait:
                raise StageBusy(f"{self.name} is being trained by {self.holder()} ({self.path}).") from None
            logging.getLogger(__name__).info("%s: waiting for %s, which trains it", self.name, self.holder())
            StageLock.waiting += 1
            try:
                self._lock.acquire()
            finally:
                StageLock.waiting -= 1
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": since}
        atomic_write_json(self.owner_path, owner, fsync=False)
        return self

    def __exit__(self, *exc) -> None:
        self.owner_path.unlink(missing_ok=True)
        self._lock.release()


class RunDir:
    """Paths, markers and metadata of one run directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def stage_dir(self, stage: str, subdomain: int | None = None) -> Path:
        """``RUN_DIR/<stage>``; the local stage's (and the per-sub-domain parts of another) ``.../<i:02d>``."""
        if stage == "local" and subdomain is None:
            raise ValueError("the local stage needs a sub-domain index.")
        if subdomain is not None:
            return self.root / stage / f"{subdomain:02d}"
        return self.root / stage

    def make_stage_dir(self, stage: str, subdomain: int | None = None) -> Path:
        return make_dir(self.stage_dir(stage, subdomain))

    def recorded_config(self) -> dict:
        """``config.yaml`` as plain dicts and lists, interpolations left as written (the configuration the directory
        was claimed with; ``{}`` when it has none)."""
        path = self.root / "config.yaml"
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.is_file() else {}

    def recorded_settings(self) -> dict | None:
        """The settings that change results as the run that claimed the directory recorded them
        (``fingerprint.json``); ``None`` when the directory has no (readable) record."""
        path = self.root / "fingerprint.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text()).get("settings") or {}
        except ValueError:
            return None

    def recorded_setting(self, key: str) -> Any:
        """The value of setting ``key`` (dotted) in :meth:`recorded_settings`; ``None`` when the directory has no
        record or no such key."""
        return flatten(self.recorded_settings() or {}).get(key)

    def is_done(self, stage: str, subdomain: int | None = None, generation: str | None = None) -> bool:
        """Whether the stage's ``done`` marker exists (with ``generation``: and holds that run generation)."""
        done = (self.stage_dir(stage, subdomain) / "done").is_file()
        return done and (generation is None or self.done_generation(stage, subdomain) == generation)

    def missing_local(self, num_subdomains: int) -> list[int]:
        return [i for i in range(num_subdomains) if not self.is_done("local", i)]

    def meta(self, stage: str, subdomain: int | None = None) -> dict:
        path = self.stage_dir(stage, subdomain) / "meta.json"
        if not self.is_done(stage, subdomain) or not path.is_file():
            name = stage if subdomain is None else f"{stage} {subdomain}"
            raise FileNotFoundError(f"stage {name} has not finished in {self.root}; run it first (stage={stage}).")
        return json.loads(path.read_text())

    def mark_done(
        self,
        stage: str,
        subdomain: int | None,
        meta: Mapping,
        required: Iterable[str] = (),
        generation: str | None = None,
    ) -> None:
        """Write ``meta.json`` then the ``done`` marker (holding the run ``generation``), after checking that every
        required file exists."""
        folder = self.stage_dir(stage, subdomain)
        missing = [name for name in required if not (folder / name).is_file()]
        if missing:
            raise RuntimeError(f"cannot mark {folder} finished: {missing} were not written.")
        atomic_write_json(folder / "meta.json", dict(meta))
        atomic_write_text(folder / "done", json.dumps({"generation": generation}) + "\n")

    def done_generation(self, stage: str, subdomain: int | None = None) -> str | None:
        """The run generation recorded in a ``done`` marker (``None``: not done, or written before generations)."""
        path = self.stage_dir(stage, subdomain) / "done"
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return None
        try:
            return json.loads(text).get("generation") if text else None
        except (ValueError, AttributeError):
            return None

    def lock(self, stage: str, subdomain: int | None = None, wait: bool = True) -> StageLock:
        """The lock that makes one process the owner of a stage folder while it trains (see :class:`StageLock`)."""
        return StageLock(self, stage, subdomain, wait=wait)

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
        return load_run_file(self.stage_dir(stage, subdomain) / f"probs_{split}.pt")

    def local_outputs(
        self, num_subdomains: int, split: str, kind: str = "probs", stage: str = "local"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated local outputs ``(n, N, K)`` of one split and their labels, checked for consistency.

        Args:
            num_subdomains: ``N``; every local net must have finished.
            split: One of :data:`SPLITS`.
            kind: ``probs`` or ``logits``.
            stage: Whose per-index outputs: the local nets', or the members of an ensemble (``global_ensemble``:
                ``RUN_DIR/<stage>/<i>/``), which a coarse DNN combines as it combines the local nets.
        """
        if kind not in ("probs", "logits"):
            raise ValueError(f"coarse.input must be 'probs' or 'logits', got {kind!r}.")
        missing = [i for i in range(num_subdomains) if not self.is_done(stage, i)]
        if missing:
            raise FileNotFoundError(
                f"{stage} nets {missing} have not finished in {self.root}; run stage={stage} for them first "
                f"(or stage=all, which skips the finished ones)."
            )
        feats, labels = [], None
        for i in range(num_subdomains):
            saved = self.load_probs(stage, split, i)
            if labels is None:
                labels = saved["labels"]
            elif saved["labels"].shape != labels.shape or not torch.equal(saved["labels"], labels):
                raise ValueError(
                    f"saved {split} predictions of local net {i} in {self.stage_dir('local', i)} are for other samples "
                    f"than those of local net 0 (labels differ); the local stage ran with other data settings. Rerun "
                    f"it with force=true."
                )
            if feats and saved[kind].shape != feats[0].shape:
                raise ValueError(
                    f"saved {split} predictions of local net {i} have shape {tuple(saved[kind].shape)}, local net 0 "
                    f"{tuple(feats[0].shape)}; rerun the local stage with force=true."
                )
            feats.append(saved[kind])
        return torch.stack(feats, dim=1), labels

    def _unstarted_method_setting(self, key: str) -> bool:
        """Whether ``key`` is a setting of an optional method (``methods.<stage>.*``) whose stage never started here:
        each method's settings are read by its own stage only, and the stages that depend on it (``coarse_oof`` on
        ``local_oof``) cannot have run before it."""
        head, _, tail = key.partition(".")
        stage = tail.partition(".")[0]
        return head == "methods" and bool(stage) and not (self.root / stage).exists()

    def claim(self, identity: RunIdentity) -> str:
        """Record the run's identity (its fingerprint, the settings that change results and ``config.yaml``) on first
        use; refuse a directory that holds another configuration, except in the settings of optional methods that
        never ran in it (those the run takes on).

        Raises:
            FingerprintMismatch: Naming the settings that differ.
        """
        settings = identity.settings
        fp = identity.fingerprint
        path = self.root / "fingerprint.json"
        if path.is_file():
            recorded = json.loads(path.read_text())
            differ = _differences(recorded.get("settings", {}), settings) if recorded.get("fingerprint") != fp else {}
            if differ and all(self._unstarted_method_setting(k) for k in differ):
                # Only settings of optional methods that never ran here (methods.<stage>.*, no RUN_DIR/<stage>/):
                # nothing recorded depends on them, so the run takes the new ones (e.g. coarse_oof switched on later
                # with another methods.local_oof.folds) instead of being refused.
                atomic_write_json(path, {"fingerprint": fp, "settings": settings})
                return fp
            if differ:
                diff = list(differ)

                def shown_value(value: Any) -> str:
                    return "'<unset>'" if value is _ABSENT else repr(value)

                shown = ", ".join(f"{k}: {shown_value(differ[k][0])} -> {shown_value(differ[k][1])}" for k in diff[:8])
                more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
                raise FingerprintMismatch(
                    f"run directory {self.root} holds results of a different configuration ({shown}{more}). "
                    f"Use a new run directory (hydra.run.dir=...), or restore those settings to resume this run."
                )
            return fp
        make_dir(self.root)
        atomic_write_json(path, {"fingerprint": fp, "settings": settings})
        atomic_write_text(self.root / "config.yaml", identity.config_yaml)
        return fp
