"""One training per settings for the stages that do not depend on the decomposition (the global CNN on one device and
with DDP), shared by the runs of a sweep through the store (:mod:`ddcnn.store`).

A sweep such as ``-m decomposition=2x2,4x4 seed=0,1`` has four runs but only two global CNNs to train: the global
CNN sees full images, so its result depends on the data, the model, the recipe and the seed, never on the grid, the
overlap or the coarse DNN. With ``store.reuse=true`` (the default) a stage whose registry entry is ``reusable`` (and
``global_ddp`` when this process spawns its ranks, its ``methods.global_ddp`` settings part of the key):

- finds its finished folder in the store under a key of everything it depends on (:func:`stage_depends`) and
  copies it into the run (every file checked against its sha256, ``meta.json`` and ``done`` last), with
  ``reused_from`` in its ``meta.json``: the store entry and the run directory that trained it;
- or trains in the run directory as always and then publishes its folder to the store. Concurrent runs with the
  same key (the tasks of a SLURM array, parallel Hydra jobs) follow the store's builder protocol: one trains, the
  others wait for its entry and copy it.

A reused stage counts as trained: its ``time_s`` is that of the training it copies, and the report says "reused".
``force=true`` retrains and replaces the entry, except one that a process of the same run generation (the same
``ddcnn-slurm`` submission or SLURM array) has just published. ``store.reuse=false`` trains in the run directory
and leaves the store alone.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ddcnn.context import Context, open_store
from ddcnn.data.sources import NOT_IDENTITY, source_identity
from ddcnn.rundir import PROB_FILES, network_identity
from ddcnn.runtime import run_generation, source_hash
from ddcnn.store import Entry, Store, StoreError

log = logging.getLogger(__name__)

__all__ = ["REUSE_FORMAT", "DECOMPOSITION_KEYS", "source_hash", "device_kind", "stage_depends", "run"]

# Part of every key: bump it when a reusable stage's files change for unchanged settings.
REUSE_FORMAT = 1
# The settings that a reusable stage never reads (the decomposition and the methods built on it).
DECOMPOSITION_KEYS = ("decomposition", "coarse", "methods")
# What the run directory keeps of a training but a copy needs not: resuming state, the run's own marker.
_NOT_PUBLISHED = ("done", "last.ckpt", "best.ckpt", "resumed_from_epoch")


def device_kind(device) -> str:
    """The kind of device a stage trains on (``cpu``, ``cuda NVIDIA H200``): results and times differ between
    kinds, not between two devices of one kind."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name(dev.index or 0)}"
    return dev.type


def stage_depends(ctx: Context, stage: str, device, member: int | None = None, derived: dict | None = None) -> dict:
    """Everything a reusable stage's result depends on: every setting that changes results
    (:func:`ddcnn.rundir.result_settings`) but the decomposition's (:data:`DECOMPOSITION_KEYS`), with the network it
    trains in place of ``model`` / ``global_model``, the accuracy-versus-time curve settings (the curve travels with
    the copy), the identity of the data's files, the device kind and the package's source hash; for ``member`` ``i`` of
    an ensemble (``global_ensemble``), its index (its seed follows from the run's seed and ``i``); ``derived``: what
    the stage takes from the decomposition, as plain data (``global_wide``: its width factor and the parameter count
    it matched), so that runs of one such value share it and runs of two do not."""
    if ctx.identity is None:
        raise RuntimeError("stage_depends needs the run's identity (ddcnn.context.build_context), a worker has none")
    settings = copy.deepcopy(ctx.identity.settings)
    for key in (*DECOMPOSITION_KEYS, "model", "global_model"):
        settings.pop(key, None)
    spec = ctx.settings.data.source
    curves = ctx.settings.report.curves
    depends = {
        "format": REUSE_FORMAT,
        "stage": stage,
        "settings": settings,
        "network": network_identity(ctx.settings.global_model or ctx.settings.model),
        "curves": {"enabled": curves.enabled, "points": curves.points},
        "data_files": source_identity({k: v for k, v in spec.items() if k not in NOT_IDENTITY}),
        "device_kind": device_kind(device),
        "source": source_hash(),
    }
    if stage == "global_ddp":  # the devices it trains on (methods.global_ddp, dropped above with the methods)
        depends["num_devices"] = ctx.settings.methods.global_ddp.num_devices
    if member is not None:
        depends["member"] = int(member)
    if derived is not None:
        depends["derived"] = derived
    return depends


def _replace(store: Store, entry: Entry) -> None:
    """Remove ``entry`` for ``force=true``, unless it was replaced meanwhile (a fresh one under the same key)."""
    now = store.open(entry.kind, entry.key)
    if now is not None and now.record.get("created_unix") == entry.record.get("created_unix"):
        store.remove(now)


def _copy_in(ctx: Context, stage: str, entry: Entry, member: int | None = None) -> dict:
    """The stage's folder from ``entry``: files first, ``meta.json`` with ``reused_from``, the ``done`` marker last."""
    folder = ctx.run.make_stage_dir(stage, member)
    ctx.run.clear(stage, member)
    entry.copy_to(folder, exclude=("meta.json",))
    meta = json.loads(entry.file("meta.json").read_text())
    meta.pop("published", None)
    meta["reused_from"] = {
        "key": entry.key,
        "entry": str(entry.path),
        "run_dir": entry.info.get("run_dir"),
        "published": entry.record.get("created"),
        "host": entry.record.get("host"),
    }
    meta["generation"] = run_generation(ctx.settings.run_generation)
    ctx.run.mark_done(stage, member, meta, required=(*PROB_FILES, "net.pt"), generation=meta["generation"])
    log.info(
        "%s: reused the one trained for these settings by %s (store entry %s; store.reuse=false trains it here)",
        stage if member is None else f"{stage} {member}",
        entry.info.get("run_dir", "an earlier run"),
        entry.path,
    )
    return meta


def run(
    ctx: Context,
    stage: str,
    device,
    train: Callable[[dict], dict],
    member: int | None = None,
    derived: dict | None = None,
) -> dict:
    """Reuse stage ``stage`` from the store, or ``train`` it in the run directory and publish it.

    Args:
        ctx: The run.
        stage: A reusable stage (its registry entry says so), not finished in this run; or, with ``member``, the stage
            of an ensemble whose member ``member`` (``RUN_DIR/<stage>/<member>/``) is reusable.
        device: Where it would train.
        train: ``train(extra)`` trains the stage in the run directory, with ``extra`` in its ``meta.json``, and
            returns its metadata.
        member: The index of an ensemble's member, whose result depends on nothing of the decomposition either.
        derived: What a stage takes from the decomposition, part of its key (:func:`stage_depends`).
    """
    if not ctx.settings.store.reuse:
        return train({})
    store = open_store(ctx.settings.store)
    depends = stage_depends(ctx, stage, device, member, derived)
    key = store.key(stage, depends)
    generation = run_generation(ctx.settings.run_generation)
    found = store.open(stage, key)
    if found is not None and ctx.settings.force and found.info.get("generation") != generation:
        log.info("%s: force=true retrains it and replaces store entry %s", stage, found.path)
        _replace(store, found)
    trained: dict = {}

    def build(folder: Path) -> dict:
        meta = trained["meta"] = train({"published": {"key": key, "entry": str(store.entry_dir(stage, key))}})
        source = ctx.run.stage_dir(stage, member)
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            rel = path.relative_to(source)
            if rel.as_posix() in _NOT_PUBLISHED:
                continue
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, folder / rel)
        acc = (meta.get("accuracy") or {}).get("test")
        acc = f"{acc:.4f}" if isinstance(acc, float) else "-"
        return {
            "describe": f"{stage} of {ctx.data.name}, seed {ctx.settings.seed}: test acc {acc}, {meta['time_s']:.1f} s",
            "run_dir": str(ctx.run.root.resolve()),
            "generation": generation,
        }

    try:
        entry = store.get_or_build(stage, depends, build, describe=f"the {stage} CNN of {ctx.run.root}")
    except StoreError as err:
        # A store that cannot be written (no room, a read-only home on a cluster) costs the reuse, not the run.
        if "meta" not in trained:
            log.warning("%s: %s; it trains here, without reuse (store.reuse=false says so silently)", stage, err)
            return train({})
        log.warning("%s: trained, but not published to the store: %s", stage, err)
        meta = {k: v for k, v in trained["meta"].items() if k != "published"}
        ctx.run.mark_done(stage, member, meta, required=(*PROB_FILES, "net.pt"), generation=meta.get("generation"))
        return meta
    if "meta" in trained:
        return trained["meta"]
    return _copy_in(ctx, stage, entry, member)
