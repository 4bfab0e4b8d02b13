"""From a source to prepared data: splits, compact storage and normalisation constants, in memory or in the store.

Preparing a dataset means: carve a validation split from training with a fixed seed when the source has none, take
the optional stratified subsets, resize (``data.image_size``), keep the values in a compact type
(:mod:`ddcnn.data.encoding`) and compute the per-channel mean and std of the training split once, in float64. The
network's inputs are made from the stored values per batch, on the training device (:class:`Prepared.normalizer`).

Where the prepared data live (``data.memory.mode``; no setting here changes a result):

- ``memory``: in this process's memory, prepared from the source by every process that needs them (P workers of one
  machine share the parent's copy). Small data: no file is written, and a local net cuts its sub-domain once.
- ``mapped``: written once per (dataset, preprocessing) into the store (:mod:`ddcnn.store`: ``store.root``,
  ``$DDCNN_STORE``) and memory-mapped by every process that uses them, on every node: P workers, ``srun`` tasks and
  the tasks of a SLURM array share the pages of one copy, a local net touches only its sub-domain, and a process
  holds no more than the batch it works on. ``store.stage_to`` copies the entry to node-local disk first.
- ``auto`` (default): ``memory`` up to ``data.memory.auto_max_mb`` of prepared data (256 MB), ``mapped`` above, or
  whenever the entry already exists in the store.

Preparation reads the source a few megabytes at a time (sources called with ``lazy=True`` never hold it whole), so a
study larger than memory is prepared in a flat amount of memory. The splits, labels and order do not depend on how
the values are stored, and neither do the network's inputs (bitwise for lossless storage, :mod:`ddcnn.data.encoding`).
"""

from __future__ import annotations

import copy
import io
import json
import logging
import mmap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ddcnn.data.arrays import Rows
from ddcnn.data.encoding import Normalize, check_float_storage, check_window, storage_dtype
from ddcnn.data.memory import available_bytes, rss_bytes
from ddcnn.data.progress import Progress
from ddcnn.data.sources import Splits, source_identity, stratified_split
from ddcnn.rundir import SPLITS

log = logging.getLogger(__name__)

__all__ = [
    "PREPARED_KIND",
    "PREPARED_FORMAT",
    "TEST_SUBSET_SEED",
    "MODES",
    "DataDoesNotFit",
    "PrepareSettings",
    "Prepared",
    "prepare",
    "load_prepared",
    "class_counts",
    "gather",
    "split_manifest",
    "MANIFEST_COLUMNS",
]

PREPARED_KIND = "prepared"
# Part of every store key: bump it when the prepared files change for unchanged settings.
PREPARED_FORMAT = 1
# The seed of data.test_subset's draw, whatever data.split_seed: the same test images for every seed (the split seed
# draws the training subset, validation and target splits only).
TEST_SUBSET_SEED = 0
MODES = ("auto", "memory", "mapped")
DATA_FILE = "data.json"
# Where each prepared sample came from (the source split and row of each, the source's files): the run's splits.csv.
# An entry written before it existed lacks it; its manifest then names the rows of the prepared splits.
ORIGIN_FILE = "origin.json"
_CHUNK_BYTES = 16 << 20  # source bytes read per piece while preparing
_PROGRESS_MIN_BYTES = 32 << 20  # smaller datasets prepare in a blink: no progress lines
# A mapped split up to this size (MNIST's training split: 47 MB) stays in a process's page table as it is read: it adds
# at most this much resident memory, and no batch faults its pages in again (dropping them after every batch of 128
# MNIST sub-images made the batch 1.7 ms instead of 0.8 ms). A larger one drops the pages of every batch once read
# (they stay in the page cache): a count of bytes read cannot bound what stays mapped, since the kernel maps whole
# large folios (up to 2 MB) of the page cache, and for volumes the cost is small (about 2 ms per batch of eight 64^3
# volumes, of a 500 ms step).
KEEP_MAPPED_BYTES = 64 << 20


class DataDoesNotFit(ValueError):
    """The prepared data do not fit the configured memory setting; the message names it and the fix."""


@dataclass(frozen=True)
class PrepareSettings:
    """The settings of a preparation (``data.*``, checked here); all but ``normalize`` name the prepared copy in the
    store. The run's :class:`~ddcnn.settings.DataSettings` is one (these fields, read from the YAML that holds their
    defaults, and the source, the batch size, ...); a script builds one with every field given.

    ``num_classes`` and ``in_channels`` may be ``"auto"``: the source's class list and channels decide.
    """

    num_classes: int | str
    in_channels: int | str
    spatial_dims: int
    image_size: tuple[int, ...] | None
    val_fraction: float
    split_seed: int
    train_subset: int | None
    test_subset: int | None
    normalize: bool
    float_storage: str | None
    window: tuple[float, float] | None

    def __post_init__(self) -> None:
        put = object.__setattr__
        if isinstance(self.split_seed, bool) or not isinstance(self.split_seed, int):
            # data.split_seed: null is the run's seed, resolved where the run's settings are read (DataSettings.read):
            # a draw left to chance would give another split in every process that prepares the data
            raise ValueError(
                f"split_seed must be a whole number, got {self.split_seed!r} (data.split_seed=null means the run's "
                f"seed: a script that builds PrepareSettings gives the seed itself)."
            )
        put(self, "float_storage", check_float_storage(self.float_storage))
        put(self, "window", check_window(self.window))
        if self.image_size is not None:
            put(self, "image_size", tuple(int(v) for v in self.image_size))

    def depends(self) -> dict:
        """What the prepared copy depends on: the fields of this class, not those a subclass adds (``DataSettings``'
        source, batch size, ...), and not ``normalize`` (applied when reading). A test subset drawn with
        :data:`TEST_SUBSET_SEED` under another ``split_seed`` says so: it was drawn with the split seed before."""
        out = {f.name: getattr(self, f.name) for f in fields(PrepareSettings) if f.name != "normalize"}
        if self.test_subset is not None and self.split_seed != TEST_SUBSET_SEED:
            out["test_subset_seed"] = TEST_SUBSET_SEED
        return out


# --------------------------------------------------------------------------------------------------------------
# Planning: which source rows go where, checked before anything is read
# --------------------------------------------------------------------------------------------------------------


def _subset(y: np.ndarray, n: int, seed: int, groups: np.ndarray | None = None, what: str = "subset") -> np.ndarray:
    """A class-stratified subset of ``n`` indices, fixed by ``seed`` (for fast benchmarks); of whole groups (about
    ``n`` samples) when ``groups`` are given."""
    if n >= len(y):
        return np.arange(len(y))
    if groups is not None:
        return np.sort(stratified_split(y, n / len(y), seed, groups, what)[1])
    from sklearn.model_selection import train_test_split

    try:
        held, _ = train_test_split(np.arange(len(y)), train_size=n, stratify=y, random_state=seed)
    except ValueError:  # a class too small to stratify: fall back to a plain seeded sample
        held = np.random.default_rng(seed).permutation(len(y))[:n]
    return np.sort(held)


def _resize(x: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    if tuple(x.shape[2:]) == size:
        return x
    mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[len(size)]
    # Antialiasing only exists for 2D; it avoids aliasing when shrinking large images.
    antialias = len(size) == 2 and any(s < n for s, n in zip(size, x.shape[2:], strict=True))
    return F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=antialias)


@dataclass
class _Plan:
    name: str
    class_names: list[str]
    sources: dict[str, Any]  # source split -> array or Rows
    routes: dict[str, tuple[str, np.ndarray]]  # prepared split -> (source split, ascending source rows)
    y: dict[str, np.ndarray]
    row_shape: tuple[int, ...]  # (C, *spatial) as stored
    size: tuple[int, ...] | None  # resize target (None: kept)
    stored: np.dtype
    scale_uint8: bool
    report: dict  # what the source found while reading (Splits.report)
    groups: dict[str, np.ndarray] | None = None  # prepared split -> a group (patient) per sample, kept together
    files: dict[str, list[str]] | None = None  # source split -> the file of each sample (Splits.files)

    def n(self, split: str) -> int:
        return len(self.routes[split][1])

    def nbytes(self, split: str | None = None) -> int:
        row = int(np.prod(self.row_shape, dtype=np.int64)) * self.stored.itemsize
        return row * (self.n(split) if split else sum(self.n(s) for s in SPLITS))


def _resolve(splits: Splits, s: PrepareSettings) -> PrepareSettings:
    """``s`` with ``auto`` class and channel counts taken from the data, and a declared class count checked against a
    source that lists its classes (class folders)."""
    from dataclasses import replace

    where = f"dataset {splits.name!r}"
    listed = len(splits.class_names)
    if s.num_classes == "auto":
        if not listed:
            raise ValueError(f"{where} names no classes, so data.num_classes=auto cannot count them; set the number.")
        s = replace(s, num_classes=listed)
    elif splits.classes_listed and s.num_classes != listed:
        shown = ", ".join(splits.class_names[:12]) + (", ..." if listed > 12 else "")
        raise ValueError(
            f"{where} has {listed} classes ({shown}) but data.num_classes={s.num_classes}; set data.num_classes="
            f"{listed} or auto (counted from the data)."
        )
    if s.in_channels == "auto":
        s = replace(s, in_channels=splits.in_channels)
    return s


def _plan(splits: Splits, s: PrepareSettings) -> _Plan:
    where = f"dataset {splits.name!r}"
    s = _resolve(splits, s)
    if splits.x_train.ndim != s.spatial_dims + 2:
        raise ValueError(
            f"{where} has images of shape {tuple(splits.x_train.shape[1:])} (channels first), which is "
            f"{splits.x_train.ndim - 2}D, but data.spatial_dims={s.spatial_dims}; set data.spatial_dims to match."
        )
    if splits.in_channels != s.in_channels:
        raise ValueError(
            f"{where} has {splits.in_channels} channel(s) but data.in_channels={s.in_channels}; set data.in_channels="
            f"{splits.in_channels} (or auto)."
        )
    sources = {"train": splits.x_train, "test": splits.x_test}
    labels = {"train": np.asarray(splits.y_train), "test": np.asarray(splits.y_test)}
    routes: dict[str, tuple[str, np.ndarray]] = {
        "train": ("train", np.arange(len(labels["train"]))),
        "test": ("test", np.arange(len(labels["test"]))),
    }
    groups = _source_groups(splits, labels)
    if splits.x_val is not None and splits.y_val is not None:
        sources["val"], labels["val"] = splits.x_val, np.asarray(splits.y_val)
        routes["val"] = ("val", np.arange(len(labels["val"])))
    else:
        what = f"{where}: the validation split (data.val_fraction={s.val_fraction})"
        keep, held = stratified_split(labels["train"], s.val_fraction, s.split_seed, groups.get("train"), what)
        routes["train"], routes["val"] = ("train", keep), ("train", held)
    for split, n in (("train", s.train_subset), ("test", s.test_subset)):
        if n is not None:
            if n < 1:
                raise ValueError(f"data.{split}_subset must be a positive number of samples or null, got {n}.")
            src, rows = routes[split]
            part = groups[src][rows] if src in groups else None
            what = f"{where}: data.{split}_subset={n}"
            seed = s.split_seed if split == "train" else TEST_SUBSET_SEED  # one test subset for every seed
            routes[split] = (src, rows[_subset(labels[src][rows], int(n), seed, part, what)])
    y = {split: np.asarray(labels[src][rows], dtype=np.int64) for split, (src, rows) in routes.items()}
    for split in SPLITS:
        if len(y[split]) == 0:
            raise ValueError(f"{where}: the {split} split is empty; provide more data or lower data.val_fraction.")
        if y[split].min() < 0 or y[split].max() >= s.num_classes:
            raise ValueError(
                f"{where}: {split} labels range over [{y[split].min()}, {y[split].max()}] but data.num_classes="
                f"{s.num_classes}; labels must be 0..{s.num_classes - 1}. Set data.num_classes to "
                f"{int(y[split].max()) + 1} if that is right."
            )
    if len(np.unique(y["train"])) < 2:
        raise ValueError(f"{where}: the training split holds a single class; a classifier needs at least two.")
    spatial = tuple(int(v) for v in splits.x_train.shape[2:])
    size = None
    if s.image_size is not None:
        if len(s.image_size) != s.spatial_dims or min(s.image_size) < 1:
            raise ValueError(f"data.image_size={list(s.image_size)} must give {s.spatial_dims} positive sizes.")
        size = s.image_size
    for key, x in sources.items():
        if tuple(x.shape[1:]) != (s.in_channels, *spatial) and size is None:
            raise ValueError(
                f"{where}: {key} images have shape {tuple(x.shape[1:])} but train images {(s.in_channels, *spatial)}; "
                f"set data.image_size to resize them to one shape."
            )
    resized = size is not None and any(tuple(x.shape[2:]) != size for x in sources.values())
    stored, scale = storage_dtype([x.dtype for x in sources.values()], resized, s.float_storage)
    row_shape = (s.in_channels, *(size if size is not None else spatial))
    report = dict(splits.report)
    prepared_groups = {split: groups[src][rows] for split, (src, rows) in routes.items()} if groups else None
    return _Plan(splits.name, list(splits.class_names), sources, routes, y, row_shape, size, stored, scale, report,
                 prepared_groups, splits.files)  # fmt: skip


def _source_groups(splits: Splits, labels: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The source's group per sample of each source split (``{}`` without groups), groups numbered across splits."""
    if splits.groups is None:
        return {}
    from ddcnn.data.splits import check_groups

    out = {}
    for split, y in (*labels.items(), ("val", splits.y_val)):
        if y is None:
            continue
        if split not in splits.groups:
            raise ValueError(f"dataset {splits.name!r}: the source gives groups but none for its {split} split.")
        given = np.asarray(splits.groups[split])
        check_groups(given, len(y), f"dataset {splits.name!r}: {split} split")
        out[split] = given.astype(np.int64)
    for a, b in (("train", "test"), ("train", "val"), ("val", "test")):
        shared = np.intersect1d(out.get(a, []), out.get(b, []))
        if len(shared):
            raise ValueError(
                f"dataset {splits.name!r}: {len(shared)} patient group(s) have samples in both the {a} and the {b} "
                f"split; one patient's studies belong to one split. Fix the manifest's split column for them."
            )
    return out


# --------------------------------------------------------------------------------------------------------------
# Writing: one pass over each source array, into memory or into files
# --------------------------------------------------------------------------------------------------------------


class _Stats:
    """Per-channel mean and (unbiased) std of decoded values, in float64: exact histograms for 8- and 16-bit
    integers, Chan's pairwise merge of chunk moments otherwise."""

    def __init__(self, stored: np.dtype, channels: int, decode: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.stored, self.channels, self.decode = np.dtype(stored), int(channels), decode
        self.histogram = self.stored.kind in "iu" and self.stored.itemsize <= 2
        if self.histogram:
            self.offset = -int(np.iinfo(self.stored).min)
            self.counts = np.zeros((channels, 1 << (8 * self.stored.itemsize)), dtype=np.int64)
        else:
            self.seen = np.zeros(channels, dtype=np.int64)
            self.mean = np.zeros(channels)
            self.m2 = np.zeros(channels)

    def update(self, x: np.ndarray) -> None:
        for c in range(self.channels):
            values = x[:, c].reshape(-1)
            for start in range(0, len(values), 1 << 22):  # bounded temporaries (bincount widens to int64)
                part = values[start : start + (1 << 22)]
                if self.histogram:
                    index = part if self.offset == 0 else part.astype(np.int64) + self.offset
                    self.counts[c] += np.bincount(index, minlength=self.counts.shape[1])
                else:
                    self._merge(c, self.decode(torch.from_numpy(np.ascontiguousarray(part))).double().numpy())

    def _merge(self, c: int, v: np.ndarray) -> None:
        n_a, n_b = int(self.seen[c]), v.size
        mean_b = float(v.mean())
        m2_b = float(np.square(v - mean_b).sum())
        delta = mean_b - self.mean[c]
        total = n_a + n_b
        self.mean[c] += delta * n_b / total
        self.m2[c] += m2_b + delta * delta * n_a * n_b / total
        self.seen[c] = total

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        if self.histogram:
            bins = np.arange(self.counts.shape[1], dtype=np.int64) - self.offset
            values = self.decode(torch.from_numpy(bins.astype(self.stored))).double().numpy()
            n = self.counts.sum(axis=1).astype(np.float64)
            mean = (self.counts * values).sum(axis=1) / n
            var = (self.counts * np.square(values[None] - mean[:, None])).sum(axis=1) / (n - 1)
            return mean, np.sqrt(var)
        return self.mean.copy(), np.sqrt(self.m2 / (self.seen.astype(np.float64) - 1))


class _MemorySink:
    def __init__(self, plan: _Plan) -> None:
        self.arrays = {s: np.empty((plan.n(s), *plan.row_shape), dtype=plan.stored) for s in SPLITS}
        self.filled = dict.fromkeys(SPLITS, 0)

    def append(self, split: str, x: np.ndarray) -> None:
        k = self.filled[split]
        self.arrays[split][k : k + len(x)] = x
        self.filled[split] = k + len(x)


class _FileSink:
    """``x_<split>.npy`` written piece by piece (never mapped while written: the pages stay out of this process's
    memory), hashed as written."""

    def __init__(self, plan: _Plan, folder: Path) -> None:
        import hashlib

        self.folder = folder
        self.files, self.hashes, self.left = {}, {}, {}
        for s in SPLITS:
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                header,
                {
                    "descr": np.lib.format.dtype_to_descr(plan.stored),
                    "fortran_order": False,
                    "shape": (plan.n(s), *plan.row_shape),
                },
            )
            fh = open(folder / f"x_{s}.npy", "xb")  # noqa: SIM115 - closed in finish() or abort()
            fh.write(header.getvalue())
            self.files[s], self.hashes[s], self.left[s] = fh, hashlib.sha256(header.getvalue()), plan.n(s)

    def append(self, split: str, x: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(x)).cast("B")
        self.files[split].write(data)
        self.hashes[split].update(data)
        self.left[split] -= len(x)

    def finish(self) -> dict[str, str]:
        for s, fh in self.files.items():
            fh.close()
            if self.left[s]:
                raise RuntimeError(f"prepared {s} split is {self.left[s]} samples short; this is a bug.")
        return {f"x_{s}.npy": h.hexdigest() for s, h in self.hashes.items()}

    def abort(self) -> None:
        for fh in self.files.values():
            fh.close()


def _convert(x: np.ndarray, plan: _Plan, where: str, first: int) -> np.ndarray:
    """A piece of source rows -> stored values (float conversion, resize, cast), NaN-checked."""
    if plan.stored.kind != "f" or x.dtype == plan.stored:
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            bad = int(np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))[0])
            raise ValueError(f"{where} sample {first + bad} holds NaN or infinite values; clean the data first.")
        return x if x.dtype == plan.stored else x.astype(plan.stored)
    t = torch.from_numpy(np.ascontiguousarray(x))
    # As the float32 path always did: uint8 is scaled to [0, 1], any other type is taken as it is.
    t = t.to(torch.float32).div_(255.0) if t.dtype == torch.uint8 else t.to(torch.float32)
    if not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).flatten(1).any(1).nonzero()[0, 0])
        raise ValueError(f"{where} sample {first + bad} holds NaN or infinite values; clean the data first.")
    if plan.size is not None:
        t = _resize(t, plan.size)
    return t.to(torch.float16).numpy() if plan.stored == np.float16 else t.numpy()


def _write(plan: _Plan, sink, decode: Callable, progress: bool) -> _Stats:
    stats = _Stats(plan.stored, plan.row_shape[0], decode)
    total = sum(plan.n(s) for s in SPLITS)
    show = progress and plan.nbytes() >= _PROGRESS_MIN_BYTES
    with Progress(f"preparing {plan.name}", total, "samples", enabled=show, nbytes=plan.nbytes()) as bar:
        for src_key, x in plan.sources.items():
            wanted = {split: rows for split, (src, rows) in plan.routes.items() if src == src_key}
            if not wanted:
                continue
            every = np.unique(np.concatenate(list(wanted.values())))
            rows_x = x if isinstance(x, Rows) else None
            row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * np.dtype(x.dtype).itemsize
            step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
            done = dict.fromkeys(wanted, 0)
            for start in range(0, len(every), step):
                part = every[start : start + step]
                raw = rows_x.read(part) if rows_x is not None else _take(x, part)
                for split, rows in wanted.items():
                    # Both ascending, and part is a run of the union: the split's next rows up to part[-1] are here.
                    end = int(np.searchsorted(rows, part[-1], side="right"))
                    if end == done[split]:
                        continue
                    take = np.searchsorted(part, rows[done[split] : end])
                    where = f"dataset {plan.name!r}: {split}"
                    values = _convert(raw[take], plan, where, done[split])
                    sink.append(split, values)
                    if split == "train":
                        stats.update(values)
                    done[split] += len(take)
                    bar.update(len(take))
    return stats


def _take(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        return np.asarray(x[int(rows[0]) : int(rows[-1]) + 1])
    return np.asarray(x[rows])


# --------------------------------------------------------------------------------------------------------------
# The prepared data
# --------------------------------------------------------------------------------------------------------------


def _map_npy(path: Path) -> tuple[np.ndarray, mmap.mmap]:
    """An ``.npy`` file memory-mapped copy-on-write (writable for torch, never written back), and its mapping."""
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = reader(fh)
        offset = fh.tell()
        mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    if fortran:
        raise ValueError(f"{path} is in Fortran order; the prepared store writes C order only (a foreign file?).")
    return np.ndarray(shape, dtype=dtype, buffer=mapping, offset=offset), mapping


class Prepared:
    """The prepared train, val and test splits of one dataset: compact stored values, labels, normalisation.

    Attributes:
        stored: Per split, the stored values ``(n, C, *spatial)`` as host tensors, in this process's memory or
            memory-mapped from the store (``holding``). Read them with :meth:`read`; :meth:`normalizer` turns them
            into network inputs.
        y: Per split, the labels (``int64``).
        class_names: Class names, index = label.
        mean, std: Per-channel normalisation constants (``float32``; computed in float64).
        name: Short dataset name.
        info: Sizes and where the data came from (``n_train``, ``n_val``, ``n_test``, ...).
        holding: ``memory`` or ``mapped``.
        entry: The store entry's folder of mapped data, else ``None``.
    """

    def __init__(
        self,
        x: Mapping[str, torch.Tensor],
        y: Mapping[str, torch.Tensor],
        class_names: Sequence[str],
        mean: torch.Tensor,
        std: torch.Tensor,
        name: str = "data",
        info: Mapping | None = None,
        *,
        scale_uint8: bool = False,
        window: tuple[float, float] | None = None,
        holding: str = "memory",
        entry: Path | None = None,
        maps: Mapping[str, mmap.mmap] | None = None,
        groups: Mapping[str, np.ndarray] | None = None,
        origin: Mapping[str, Any] | None = None,
    ) -> None:
        self.stored = dict(x)
        # where each sample came from (_origin: per split its source split and rows, the source's files), or None
        # (a store entry prepared before it was recorded): split_manifest reads it
        self.origin = dict(origin) if origin is not None else None
        # split -> a group (patient) per sample that every split drawn later (val_target, folds, coarse_val) keeps
        # together; None: every sample on its own
        self.groups = {k: np.asarray(v, dtype=np.int64) for k, v in groups.items()} if groups else None
        self.y = dict(y)
        self.class_names = list(class_names)
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
        self.name = name
        self.info = dict(info or {})
        self.scale_uint8 = bool(scale_uint8)
        self.window = check_window(window)
        self.holding = holding
        self.entry = Path(entry) if entry is not None else None
        self._maps = dict(maps or {})
        self._normalizers: dict[str, Normalize] = {}
        self._float: dict[str, torch.Tensor] = {}

    # --- shape ---
    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def in_channels(self) -> int:
        return int(self.stored["train"].shape[1])

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.stored["train"].shape[2:])

    @property
    def spatial_dims(self) -> int:
        return self.stored["train"].dim() - 2

    @property
    def stored_dtype(self) -> torch.dtype:
        return self.stored["train"].dtype

    def nbytes(self, split: str | None = None) -> int:
        """Bytes of the stored values (of one split)."""
        splits = [split] if split else list(self.stored)
        return sum(self.stored[s].numel() * self.stored[s].element_size() for s in splits)

    # --- reading ---
    def normalizer(self, device: torch.device | str | None = None) -> Normalize:
        """The module that turns stored values into network inputs, on ``device`` (one per device, kept)."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        key = str(device)
        if key not in self._normalizers:
            module = Normalize(self.mean, self.std, self.spatial_dims, self.scale_uint8, self.window)
            self._normalizers[key] = module.to(device)
        return self._normalizers[key]

    def read(
        self,
        split: str,
        idx: torch.Tensor,
        region: Sequence[slice] | None = None,
        flips: torch.Tensor | None = None,
        flip_axes: Sequence[int] = (),
        into: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Stored values of samples ``idx`` of ``split``, only within ``region`` (spatial slices), where the split is
        held (host memory, or the device of :meth:`on_device`: the indices are moved there if they are elsewhere).

        ``into(shape, dtype)``: where a gather on the host writes (e.g. pinned memory, so that the batch travels to a
        GPU from the memory it was gathered into: one host copy); ignored for a split held on a device.

        ``flips`` ``(B, len(flip_axes))`` (bool, sample ``b`` flipped along spatial axis ``flip_axes[k]``): the
        ``region`` of each sample's flipped image, read as one gather (a flipped sample's values come from the mirror
        image of ``region``, nothing else is read).

        From mapped data only the pages of that region are read; for a split larger than :data:`KEEP_MAPPED_BYTES` they
        are dropped from this process's page table right away (they stay in the page cache, shared with every process
        that maps the file): the resident memory of a process holds what it works on, not what it has read.
        """
        x = self.stored[split]
        idx = torch.as_tensor(idx, dtype=torch.long)
        if idx.device != x.device:
            idx = idx.to(x.device, non_blocking=True)
        into = into if x.device.type == "cpu" else None
        if flips is None or not len(flip_axes):
            if region is not None:
                x = x[(slice(None), slice(None), *region)]
            out = gather(x, (idx,), into)
        else:
            out = _flipped_gather(x, idx, region, flips.to(x.device, non_blocking=True), tuple(flip_axes), into)
        if split in self._maps and self.nbytes(split) > KEEP_MAPPED_BYTES:
            self._maps[split].madvise(mmap.MADV_DONTNEED)
        return out

    def release(self, split: str | None = None) -> None:
        """Drop the mapped pages of ``split`` (default: all) from this process's page table."""
        for s in [split] if split else list(self._maps):
            self._maps[s].madvise(mmap.MADV_DONTNEED)

    def inputs(self, split: str, idx: torch.Tensor | None = None, region: Sequence[slice] | None = None):
        """Network inputs (float32, normalised) of samples ``idx`` (default: all) of ``split``, where the split is
        held (the host, or the device of :meth:`on_device`)."""
        idx = torch.arange(len(self.y[split])) if idx is None else torch.as_tensor(idx, dtype=torch.long)
        x = self.read(split, idx, region)
        return self.normalizer(x.device)(x)

    def on_device(self, device: torch.device | str, splits: Sequence[str] = ("train", "val")) -> Prepared:
        """These data with the stored (compact) values of ``splits`` held on ``device`` (a copy, also on the CPU), so
        that :meth:`read` cuts batches there; the other splits stay as they are held here."""
        device = torch.device(device)
        out = copy.copy(self)
        out.stored = {s: (v.to(device, copy=True) if s in splits else v) for s, v in self.stored.items()}
        out._maps = {s: m for s, m in self._maps.items() if s not in splits}
        out._normalizers, out._float = {}, {}
        out.holding = f"{self.holding}, {', '.join(splits)} on {device}"
        return out

    def sample(self, split: str, i: int) -> torch.Tensor:
        """One sample's network input ``(C, *spatial)``."""
        return self.inputs(split, torch.tensor([int(i)]))[0]

    @property
    def x(self) -> dict[str, torch.Tensor]:
        """Every split's network inputs as float32 tensors, made on first use and kept: for small data, tests and the
        seed baselines. Training reads batches instead (:mod:`ddcnn.data.datamodule`)."""
        for split in self.stored:
            if split not in self._float:
                self._float[split] = self.inputs(split)
        return self._float

    # --- records ---
    def describe(self) -> dict:
        """How the data are held, for ``meta.json`` and the log."""
        return {
            "holding": self.holding,
            "stored_dtype": str(self.stored_dtype).replace("torch.", ""),
            "stored_mb": round(self.nbytes() / 1e6, 3),
            "store_entry": str(self.entry) if self.entry is not None else None,
            **{k: v for k, v in self.info.items() if k.startswith("rss_") or k in ("prepare_s", "built")},
        }

    def carve_val_target(self, fraction: float, seed: int, source: str = "val") -> Prepared:
        """These data with ``fraction`` of the ``source`` split (``val``, or ``train`` where validation is too small
        to halve; stratified, patient groups kept whole, fixed by ``seed``) moved into a fourth split,
        ``val_target``, that no choice sees (``data.val_target_fraction``, ``data.val_target_from``;
        ``docs/protocol.md`` §3): every training, selection and fit reads the rest as ``source``. Both parts are held
        in this process's memory (a copy of the source rows, also of mapped data)."""
        if source not in ("val", "train"):
            raise ValueError(f"data.val_target_from must be val or train, got {source!r}.")
        groups = self.groups[source] if self.groups else None
        n = len(self.y[source])
        name = "validation" if source == "val" else "training"
        what = f"data.val_target_fraction={fraction}: the target split of the {n} {name} samples"
        keep, held = stratified_split(self.y[source].numpy(), float(fraction), int(seed), groups, what)
        if not len(keep) or not len(held):
            raise ValueError(
                f"data.val_target_fraction={fraction} leaves {len(keep)} {name} and {len(held)} target sample(s) "
                f"of {n}; each part needs at least one: lower it"
                + (", or raise data.val_fraction." if source == "val" else ", or bring more training samples.")
            )
        out = copy.copy(self)
        rows, labels = self.stored[source], self.y[source]
        keep_t, held_t = torch.from_numpy(keep), torch.from_numpy(held)
        out.stored = {**self.stored, source: rows[keep_t].clone(), "val_target": rows[held_t].clone()}
        out.y = {**self.y, source: labels[keep_t].clone(), "val_target": labels[held_t].clone()}
        out._maps = {s: m for s, m in self._maps.items() if s != source}
        out._normalizers, out._float = {}, {}
        out.info = {**self.info, f"n_{source}": len(keep), "n_val_target": len(held), "val_target_from": source}
        if self.origin is not None:
            src, source_rows = self.origin["routes"][source]
            routes = {**self.origin["routes"], source: (src, source_rows[keep]), "val_target": (src, source_rows[held])}
            out.origin = {**self.origin, "routes": routes}
        if groups is not None:
            out.groups = {**self.groups, source: groups[keep], "val_target": groups[held]}
        return out

    # --- processes ---
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_maps"], state["_normalizers"], state["_float"] = {}, {}, {}
        # a worker trains, it writes no splits.csv: the origin (a row index and a path per sample) stays here
        state["origin"] = None
        if self.holding == "mapped":  # a worker maps the same files instead of receiving a copy, except held splits
            state["stored"] = {s: v for s, v in self.stored.items() if s not in self._maps}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.holding == "mapped":
            held = self.stored or {}
            self.stored, self._maps = _map_entry(self.entry)
            self.stored.update(held)  # the carved validation splits (carve_val_target) stay as they were
            self._maps = {s: m for s, m in self._maps.items() if s not in held}

    @classmethod
    def from_entry(cls, folder: Path, normalize: bool = True) -> Prepared:
        """The prepared data of a store entry, memory-mapped."""
        folder = Path(folder)
        meta = json.loads((folder / DATA_FILE).read_text())
        stored, maps = _map_entry(folder)
        y = {s: torch.from_numpy(np.load(folder / f"y_{s}.npy")) for s in SPLITS}
        groups = {s: np.load(folder / f"g_{s}.npy") for s in SPLITS} if (folder / "g_train.npy").is_file() else None
        mean, std = _constants(meta["stats"], normalize, len(meta["stats"]["mean"]))
        origin = None
        if (folder / ORIGIN_FILE).is_file():
            saved = json.loads((folder / ORIGIN_FILE).read_text())
            routes = {s: (src, np.asarray(rows, dtype=np.int64)) for s, (src, rows) in saved["routes"].items()}
            origin = {"routes": routes, "files": saved["files"]}
        return cls(
            stored,
            y,
            meta["class_names"],
            mean,
            std,
            meta["name"],
            {**meta["info"], "stats": meta["stats"]},
            scale_uint8=meta["decode"]["scale_uint8"],
            window=meta["decode"]["window"],
            holding="mapped",
            entry=folder,
            maps=maps,
            groups=groups,
            origin=origin,
        )


def _map_entry(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, mmap.mmap]]:
    stored, maps = {}, {}
    for s in SPLITS:
        array, maps[s] = _map_npy(Path(folder) / f"x_{s}.npy")
        stored[s] = torch.from_numpy(array)
    return stored, maps


def _constants(stats: Mapping, normalize: bool, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not normalize:
        return torch.zeros(channels), torch.ones(channels)
    mean = torch.tensor(stats["mean"], dtype=torch.float64).to(torch.float32)
    std = torch.tensor(stats["std"], dtype=torch.float64).to(torch.float32).clamp_min(1e-6)
    return mean, std


def _record(plan: _Plan, stats: _Stats, settings: PrepareSettings) -> dict:
    mean, std = stats.result()
    return {
        "format": PREPARED_FORMAT,
        "name": plan.name,
        "class_names": plan.class_names,
        "stored_dtype": plan.stored.name,
        "shapes": {s: [plan.n(s), *plan.row_shape] for s in SPLITS},
        "decode": {"scale_uint8": plan.scale_uint8, "window": list(settings.window) if settings.window else None},
        "stats": {"mean": [float(v) for v in mean], "std": [float(v) for v in std], "of": "train, decoded"},
        "info": {
            **{f"n_{s}": plan.n(s) for s in SPLITS},
            **({"report": plan.report} if plan.report else {}),
            **({"n_groups": {s: len(np.unique(plan.groups[s])) for s in SPLITS}} if plan.groups else {}),
        },
    }


def _decoder(plan: _Plan, settings: PrepareSettings) -> Callable[[torch.Tensor], torch.Tensor]:
    return Normalize(torch.zeros(plan.row_shape[0]), torch.ones(plan.row_shape[0]), len(plan.row_shape) - 1,
                     plan.scale_uint8, settings.window).decode  # fmt: skip


def _prepare_in_memory(plan: _Plan, settings: PrepareSettings, progress: bool) -> Prepared:
    sink = _MemorySink(plan)
    stats = _write(plan, sink, _decoder(plan, settings), progress)
    record = _record(plan, stats, settings)
    mean, std = _constants(record["stats"], settings.normalize, plan.row_shape[0])
    x = {s: torch.from_numpy(sink.arrays[s]) for s in SPLITS}
    y = {s: torch.from_numpy(plan.y[s]) for s in SPLITS}
    return Prepared(
        x,
        y,
        plan.class_names,
        mean,
        std,
        plan.name,
        {**record["info"], "stats": record["stats"]},
        scale_uint8=plan.scale_uint8,
        window=settings.window,
        groups=plan.groups,
        origin=_origin(plan),
    )


def _write_entry(plan: _Plan, settings: PrepareSettings, folder: Path, progress: bool) -> dict:
    """Build function of a store entry: the prepared splits as ``.npy`` files, labels, ``data.json``."""
    from ddcnn.store import StoreError, free_bytes

    need = plan.nbytes()
    free = free_bytes(folder)
    if free < need + (64 << 20):
        raise StoreError(
            f"the store at {folder.parent.parent} has {free / 1e9:.2f} GB free, but the prepared {plan.name} needs "
            f"{need / 1e9:.2f} GB; set store.root (or DDCNN_STORE) to a file system with room, or data.memory.mode="
            f"memory to keep the data in memory instead."
        )
    sink = _FileSink(plan, folder)
    try:
        stats = _write(plan, sink, _decoder(plan, settings), progress)
    except BaseException:
        sink.abort()
        raise
    sums = sink.finish()
    for s in SPLITS:
        np.save(folder / f"y_{s}.npy", plan.y[s])
        if plan.groups is not None:
            np.save(folder / f"g_{s}.npy", plan.groups[s])
    record = _record(plan, stats, settings)
    origin = _origin(plan)
    routes = {s: [src, rows.tolist()] for s, (src, rows) in origin["routes"].items()}
    (folder / ORIGIN_FILE).write_text(json.dumps({"routes": routes, "files": origin["files"]}))
    (folder / DATA_FILE).write_text(json.dumps(record, indent=2))
    return {"describe": f"{plan.name}: {sum(plan.n(s) for s in SPLITS)} samples {plan.stored.name}", "_sha256": sums}


def prepare(
    splits: Splits,
    *,
    num_classes: int,
    in_channels: int,
    spatial_dims: int,
    image_size: Sequence[int] | None = None,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    train_subset: int | None = None,
    test_subset: int | None = None,
    normalize: bool = True,
    float_storage: str | None = None,
    window: Sequence[float] | None = None,
    progress: bool = False,
) -> Prepared:
    """Split, resize and store a dataset compactly in this process's memory; check it against the configuration.

    Args:
        splits: Arrays (or lazy :class:`~ddcnn.data.arrays.Rows`) from a source.
        num_classes, in_channels, spatial_dims: What the configuration declares; a mismatch with the data
            is an error (models are built from the declaration before the data is read).
        image_size: Resize every image/volume to this spatial shape (bilinear/trilinear).
        val_fraction: Share of the training split held out (stratified) when the source has no validation split.
        split_seed: Seed of that split and of the training subset; fixed so that every stage sees the same data.
        train_subset, test_subset: Use only this many (stratified) samples, for quick benchmarks (the test subset
            drawn with :data:`TEST_SUBSET_SEED`, the same for every split seed).
        normalize: Subtract the training mean and divide by the training std, per channel.
        float_storage: ``None`` (float32) or ``"float16"`` for values that are not integers.
        window: ``(low, high)`` intensity window applied before normalising.
        progress: Report progress (for large data).
    """
    settings = PrepareSettings(
        num_classes,
        in_channels,
        spatial_dims,
        tuple(image_size) if image_size is not None else None,
        val_fraction,
        split_seed,
        train_subset,
        test_subset,
        normalize,
        float_storage,
        tuple(window) if window is not None else None,
    )
    data = _prepare_in_memory(_plan(splits, settings), settings, progress)
    data.info["class_counts"] = class_counts(data)
    return data


def _origin(plan: _Plan) -> dict[str, Any]:
    """Where each prepared sample came from: per prepared split its source split and source rows, and the source's
    files (``None`` for a source of arrays)."""
    return {"routes": {s: (src, np.asarray(rows, dtype=np.int64)) for s, (src, rows) in plan.routes.items()},
            "files": plan.files}  # fmt: skip


# The columns of RUN_DIR/splits.csv: one row per sample of every split.
MANIFEST_COLUMNS = ("file", "split", "class", "file_is")


def split_manifest(data: Prepared) -> str:
    """``RUN_DIR/splits.csv``: which sample is in which split, one row per sample (train, val, test and val_target
    where carved), as CSV text with the columns :data:`MANIFEST_COLUMNS`.

    ``file`` is the file (a DICOM study's folder) as the user gave the source, with ``file_is`` ``path``; for a source
    of arrays (an ``.npz``, scikit-learn's digits), the sample's row in the source's split, with ``file_is`` saying
    which split (``row of the source's test split``: ``x_test[row]`` of an ``.npz``). A store entry prepared before
    ddcnn recorded origins gives the row in the prepared split (``row of the prepared test split``). Nothing but the
    paths the user gave and the class names is written: no image and no value read from a file.
    """
    import csv

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(MANIFEST_COLUMNS)
    origin = data.origin
    for split in (*SPLITS, *(s for s in data.y if s not in SPLITS)):
        labels = data.y[split].tolist()
        if origin is None or split not in origin["routes"]:
            refs, what = range(len(labels)), [f"row of the prepared {split} split"] * len(labels)
        else:
            src, rows = origin["routes"][split]
            files = (origin.get("files") or {}).get(src)
            if files is not None:
                refs, what = [files[r] for r in rows], ["path"] * len(rows)
            else:
                refs, what = rows.tolist(), [f"row of the source's {src} split"] * len(rows)
        for ref, label, kind in zip(refs, labels, what, strict=True):
            writer.writerow((ref, split, data.class_names[label], kind))
    return out.getvalue()


def class_counts(data: Prepared) -> dict[str, dict[str, int]]:
    """Samples per class in each split, ``{split: {class name: count}}`` (every class listed, zeros included)."""
    out = {}
    for split in SPLITS:
        counts = np.bincount(data.y[split].numpy(), minlength=data.num_classes)
        out[split] = {name: int(n) for name, n in zip(data.class_names, counts, strict=False)}
    return out


def _log_classes(data: Prepared) -> None:
    counts = data.info["class_counts"]
    if data.num_classes <= 20:
        for split in SPLITS:
            shown = ", ".join(f"{k} {v}" for k, v in counts[split].items())
            log.info("data %s: %s per class: %s", data.name, split, shown)
        return
    for split in SPLITS:
        values = list(counts[split].values())
        log.info("data %s: %s: %d classes, %d to %d samples per class", data.name, split, data.num_classes,
                 min(values), max(values))  # fmt: skip


def _gb(value: int) -> str:
    return f"{value / 1e9:.2f} GB" if value >= 1e8 else f"{value / 1e6:.1f} MB"


def load_prepared(
    source: Callable[[], Splits],
    spec: Mapping[str, Any],
    settings: PrepareSettings,
    *,
    mode: str = "auto",
    auto_max_mb: float = 256.0,
    limit_gb: float | None = None,
    store=None,
    stage_to: str | Path | None = None,
    progress: bool = True,
) -> Prepared:
    """The prepared data of a source, held as ``mode`` says (see the module docstring).

    Args:
        source: Makes the source's splits (lazily where it can); called only when the data must be prepared.
        spec: The source's settings (``data.source``), part of the store key with the identity of its files.
        settings: The preparation settings.
        mode: ``auto``, ``memory`` or ``mapped`` (``data.memory.mode``).
        auto_max_mb: ``auto`` keeps prepared data up to this size in memory (``data.memory.auto_max_mb``).
        limit_gb: The most memory the data may take in this process (``data.memory.limit_gb``); ``None``: what the
            machine or the job has available.
        store: The :class:`~ddcnn.store.Store` of mapped data.
        stage_to: Copy the store entry there first (``store.stage_to``).
        progress: Report progress of long preparations.

    Raises:
        DataDoesNotFit: ``mode=memory`` and the prepared data exceed the memory setting.
    """
    if mode not in MODES:
        raise ValueError(f"data.memory.mode must be one of {list(MODES)}, got {mode!r}.")
    if limit_gb is not None and float(limit_gb) <= 0:
        raise ValueError(f"data.memory.limit_gb must be a positive number of GB or null, got {limit_gb!r}.")
    started, rss_before = time.perf_counter(), rss_bytes()
    depends = {"format": PREPARED_FORMAT, "settings": settings.depends(), "source": dict(spec)}
    plan = entry = None
    built = read = False

    def splits_of_source() -> Splits:
        nonlocal read
        read = True
        return source()

    if mode in ("auto", "mapped") and store is not None:
        depends["files"] = source_identity(dict(spec))
        entry = store.get(PREPARED_KIND, depends)
    if entry is None:
        if mode in ("auto", "memory"):
            plan = _plan(splits_of_source(), settings)
        if mode == "auto":
            limit = available_bytes() if limit_gb is None else float(limit_gb) * 1e9
            small = plan.nbytes() <= float(auto_max_mb) * 1e6 and (limit is None or plan.nbytes() <= limit)
            mode = "memory" if small or store is None else "mapped"
        if mode == "memory":
            _check_fits(plan, limit_gb)
            data = _prepare_in_memory(plan, settings, progress)
        else:
            if store is None:
                raise ValueError("data.memory.mode=mapped needs a store (store.root or $DDCNN_STORE).")

            def build(folder: Path) -> dict:
                nonlocal built, plan
                built = True
                plan = plan if plan is not None else _plan(splits_of_source(), settings)
                return _write_entry(plan, settings, folder, progress)

            entry = store.get_or_build(PREPARED_KIND, depends, build, describe=f"prepared {spec_name(spec)}")
    if entry is not None:
        if stage_to:
            entry = store.stage(entry, stage_to)
        data = Prepared.from_entry(entry.path, settings.normalize)
    data.info["built"] = built
    data.info["class_counts"] = class_counts(data)
    data.info["prepare_s"] = round(time.perf_counter() - started, 3)
    rss_ready = rss_bytes()
    if rss_before is not None and rss_ready is not None:
        data.info["rss_before_mb"] = round(rss_before / 1e6, 1)
        data.info["rss_ready_mb"] = round(rss_ready / 1e6, 1)
    where = f"memory-mapped from {entry.path}" if entry is not None else "in memory"
    log.info(
        "data %s: %d samples as %s (%s) %s, ready in %.1f s%s",
        data.name,
        sum(len(v) for v in data.y.values()),
        str(data.stored_dtype).replace("torch.", ""),
        _gb(data.nbytes()),
        where,
        data.info["prepare_s"],
        f"; this process +{(rss_ready - rss_before) / 1e6:.0f} MB resident" if rss_before and rss_ready else "",
    )
    summary = (data.info.get("report") or {}).get("summary")
    if summary and not read:  # the source logged it when it was read; from the store, the record says it
        log.info("data %s, as read when prepared: %s", data.name, summary)
    _log_classes(data)
    return data


def spec_name(spec: Mapping) -> str:
    """A short name of a source for log lines."""
    return str(spec.get("name") or Path(str(spec.get("path") or spec.get("root") or spec.get("_target_", "data"))).stem)


def _check_fits(plan: _Plan, limit_gb: float | None) -> None:
    need = plan.nbytes()
    if limit_gb is not None:
        limit, what = float(limit_gb) * 1e9, f"data.memory.limit_gb={limit_gb}"
    else:
        limit, what = available_bytes(), "the memory this machine (or job) has available"
        if limit is None:
            return
    if need > limit:
        raise DataDoesNotFit(
            f"dataset {plan.name!r} takes {_gb(need)} prepared ({plan.stored.name}, {sum(plan.n(s) for s in SPLITS)} "
            f"samples), more than {what} ({_gb(int(limit))}) with data.memory.mode=memory. Set data.memory.mode=mapped "
            f"(or auto) to prepare it once into the store and memory-map it: each process then holds only the batches "
            f"it works on. Or raise data.memory.limit_gb if the memory is there."
        )


def gather(
    x: torch.Tensor,
    index: Sequence[torch.Tensor],
    into: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x[tuple(index)]`` (advanced indexing of the leading axes), written into ``into(shape, dtype)`` when given:
    the same values, gathered in one copy into memory of the caller's choosing (pinned host memory for a batch on its
    way to a GPU)."""
    if into is None:
        return x[tuple(index)]
    shape = (*torch.broadcast_shapes(*(i.shape for i in index)), *x.shape[len(index) :])
    return torch.ops.aten.index.Tensor_out(x, list(index), out=into(shape, x.dtype))


def _flipped_gather(
    x: torch.Tensor,
    idx: torch.Tensor,
    region: Sequence[slice] | None,
    flips: torch.Tensor,
    flip_axes: tuple[int, ...],
    into: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x[idx]`` within ``region``, each sample flipped along the axes its row of ``flips`` marks, as one gather:
    along a flipped axis of length ``n``, output position ``p`` of the region ``[s, e)`` holds ``n - 1 - s - p``."""
    b, spatial = len(idx), x.dim() - 2
    shape = x.shape[2:]
    region = tuple(region) if region is not None else tuple(slice(0, n) for n in shape)
    index: list[torch.Tensor] = [
        idx.view(b, *([1] * (spatial + 1))),
        torch.arange(x.shape[1], device=x.device).view(1, -1, *([1] * spatial)),
    ]
    for axis, (part, n) in enumerate(zip(region, shape, strict=True)):
        start, stop = part.indices(n)[:2]
        pos = torch.arange(start, stop, device=x.device)
        view = [1] * (spatial + 2)
        view[2 + axis] = len(pos)
        if axis in flip_axes:
            flipped = flips[:, flip_axes.index(axis)].view(-1, 1)
            src = torch.where(flipped, n - 1 - pos.view(1, -1), pos.view(1, -1))  # (B, length)
            view[0] = b
            index.append(src.view(view))
        else:
            index.append(pos.view(view))
    return gather(x, index, into)
