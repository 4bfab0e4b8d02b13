"""NIfTI volumes: discovery, preprocessing, an on-disk cache and a torch ``Dataset``.

Axis convention, used by every function in this module and in :mod:`ddcnn.data.convert`: a volume is
returned as a float array ``(C, D, H, W)``. ``D, H, W`` are the three voxel axes of the image after
reorientation to the closest canonical (RAS+) orientation with :func:`nibabel.as_closest_canonical`, kept in
nibabel's order and not transposed: ``D`` runs towards the patient's Right, ``H`` towards Anterior, ``W``
towards Superior (MONAI and TorchIO keep the same order). ``NiftiPreprocess.spacing`` and
``NiftiPreprocess.target_shape`` are given in this ``(D, H, W)`` order. ``C`` is 1 for a 3D file; for a 4D
file read with ``channel_axis`` set, the channel axis is moved to the front.

Two dataset layouts are understood by :func:`scan_nifti`:

* class-per-folder: ``root/<class_name>/*.nii[.gz]``; class indices follow the sorted folder names;
* a CSV manifest with a header row ``path,label[,split][,class_name][,group]``; paths are absolute or relative to
  the manifest's folder, labels are class names or integer indices, ``split`` is train/val/test, the
  optional ``class_name`` column (written by :func:`ddcnn.data.convert.arrays_to_nifti`) names integer labels, and
  the optional ``group`` column (a patient) keeps one group's volumes in one split of every split drawn.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import json
import logging
import os
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import nibabel as nib
import numpy as np
import torch
import torch.nn.functional as F
from nibabel.filebasedimages import ImageFileError
from torch.utils.data import Dataset

from ddcnn.data.progress import track
from ddcnn.io import atomic_open
from ddcnn.rundir import SPLITS

__all__ = [
    "FORMAT_VERSION",
    "NiftiCache",
    "NiftiDataset",
    "NiftiError",
    "NiftiIndex",
    "NiftiPreprocess",
    "load_arrays",
    "load_volume",
    "scan_nifti",
]

FORMAT_VERSION = 1
"""Part of every cache key; bump it when ``load_volume`` changes its output for unchanged settings."""


Normalize = Literal["window", "zscore", "minmax", "none"]
_NORMALIZE_MODES = ("window", "zscore", "minmax", "none")

# Errors nibabel, gzip and zlib raise for a corrupt or truncated file (gzip.BadGzipFile is an OSError).
_READ_ERRORS = (ImageFileError, OSError, EOFError, zlib.error, ValueError)

log = logging.getLogger(__name__)


class NiftiError(ValueError):
    """A NIfTI file, class folder or manifest that cannot be used; the message names it and says how to fix it."""


def _is_nifti(path: Path) -> bool:
    name = path.name.lower()
    return not name.startswith(".") and (name.endswith(".nii") or name.endswith(".nii.gz"))


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".nii.gz", ".nii"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


# --------------------------------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NiftiIndex:
    """The volumes of a dataset and their labels, as found by :func:`scan_nifti`.

    Attributes:
        paths: Volume files.
        labels: Class index of each volume.
        class_names: Class names; ``labels`` index into them.
        splits: ``"train"``/``"val"``/``"test"`` per volume, or ``None`` when the source has no split column.
        source: The folder or manifest the index was read from (named in error messages).
        groups: The manifest's ``group`` (a patient) per volume, or ``None`` without a group column.
    """

    paths: tuple[Path, ...]
    labels: tuple[int, ...]
    class_names: tuple[str, ...]
    splits: tuple[str, ...] | None = None
    source: Path | None = None
    groups: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", tuple(Path(p) for p in self.paths))
        object.__setattr__(self, "labels", tuple(int(v) for v in self.labels))
        object.__setattr__(self, "class_names", tuple(str(c) for c in self.class_names))
        if self.splits is not None:
            object.__setattr__(self, "splits", tuple(str(s) for s in self.splits))
        if self.groups is not None:
            object.__setattr__(self, "groups", tuple(str(g) for g in self.groups))
        if (
            len(self.labels) != len(self.paths)
            or (self.splits is not None and len(self.splits) != len(self.paths))
            or (self.groups is not None and len(self.groups) != len(self.paths))
        ):
            raise ValueError("NiftiIndex: paths, labels, splits and groups must have the same length")

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def num_classes(self) -> int:
        """Number of classes (``len(class_names)``)."""
        return len(self.class_names)

    def select(self, split: str | None) -> NiftiIndex:
        """Returns the volumes of one split (all volumes for ``split=None``).

        Raises:
            NiftiError: The index has no split column, or the split holds no volume.
        """
        if split is None:
            return self
        where = self.source if self.source is not None else "dataset"
        if self.splits is None:
            raise NiftiError(
                f"{where}: split {split!r} requested, but the dataset has no split column. Add a column "
                f"'split' (train/val/test) to the manifest, or pass split=None to use every volume."
            )
        keep = [i for i, s in enumerate(self.splits) if s == split]
        if not keep:
            raise NiftiError(
                f"{where}: empty dataset, no volume in split {split!r} (splits present: "
                f"{sorted(set(self.splits))}). Pass one of those splits or add volumes for {split!r}."
            )
        return NiftiIndex(
            paths=tuple(self.paths[i] for i in keep),
            labels=tuple(self.labels[i] for i in keep),
            class_names=self.class_names,
            splits=tuple(self.splits[i] for i in keep),
            source=self.source,
            groups=tuple(self.groups[i] for i in keep) if self.groups is not None else None,
        )


def scan_nifti(root_or_manifest: str | os.PathLike[str], class_names: Sequence[str] | None = None) -> NiftiIndex:
    """Finds the volumes of a dataset: a class-per-folder tree or a CSV manifest.

    Args:
        root_or_manifest: A folder laid out as ``root/<class_name>/*.nii[.gz]``, or a CSV manifest file with
            columns ``path,label[,split][,class_name]`` (see the module docstring).
        class_names: Class names in label order. Default for folders: the sorted folder names; for a manifest:
            the sorted label names, or for integer labels the ``class_name`` column (``"0"``, ``"1"``, ...
            without one).

    Returns:
        The index; file order is sorted by class then file name for folders, row order for a manifest.

    Raises:
        NiftiError: Missing source, empty class folder, missing file named in a manifest row, unknown or
            out-of-range label, or no volume at all.
    """
    source = Path(root_or_manifest).expanduser()
    names = _check_class_names(class_names, source) if class_names is not None else None
    if source.is_dir():
        return _scan_folders(source, names)
    if source.is_file():
        return _read_manifest(source, names)
    raise NiftiError(
        f"{source}: no such folder or manifest file. Pass a folder laid out as <root>/<class_name>/*.nii.gz, "
        f"or a CSV manifest with a header row path,label[,split]."
    )


def _check_class_names(class_names: Sequence[str], source: Path) -> tuple[str, ...]:
    names = tuple(str(c) for c in class_names)
    if not names or len(set(names)) != len(names):
        raise NiftiError(f"{source}: class_names must be a non-empty list of distinct names, got {list(names)}.")
    return names


def _scan_folders(root: Path, class_names: tuple[str, ...] | None) -> NiftiIndex:
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        loose = [p for p in root.iterdir() if p.is_file() and _is_nifti(p)]
        hint = f" It holds {len(loose)} NIfTI file(s) directly: move them into one folder per class." if loose else ""
        raise NiftiError(
            f"{root}: empty dataset, no class folders found.{hint} Expected <root>/<class_name>/*.nii.gz, "
            f"or pass a CSV manifest (path,label[,split]) instead of the folder."
        )
    if class_names is None:
        class_names = tuple(f.name for f in folders)
    unknown = [f.name for f in folders if f.name not in class_names]
    if unknown:
        raise NiftiError(
            f"{root}: unknown label, class folder(s) {unknown} not in class_names {list(class_names)}. "
            f"Rename the folders or add the names to class_names."
        )
    paths: list[Path] = []
    labels: list[int] = []
    for folder in folders:
        files = sorted(p for p in folder.iterdir() if p.is_file() and _is_nifti(p))
        if not files:
            raise NiftiError(
                f"{folder}: empty class folder, no .nii or .nii.gz file in it. Add volumes of class "
                f"{folder.name!r} or remove the folder."
            )
        paths += files
        labels += [class_names.index(folder.name)] * len(files)
    return NiftiIndex(tuple(paths), tuple(labels), class_names, None, root)


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


class _Row(NamedTuple):
    number: int  # data row, from 1
    line: int  # line in the file, header = 1
    path: str
    label: str
    split: str
    class_name: str
    group: str


def _read_manifest(manifest: Path, class_names: tuple[str, ...] | None) -> NiftiIndex:
    # utf-8-sig: spreadsheet programs start CSV files with a byte-order mark.
    with open(manifest, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip().lower() for h in next(reader, [])]
            if "path" not in header or "label" not in header:
                raise NiftiError(
                    f"{manifest}: a manifest needs a header row with columns path,label[,split] "
                    f"(found {header or 'an empty file'}). Add the header row."
                )
            rows: list[_Row] = []
            for cells in reader:
                if not any(cell.strip() for cell in cells):
                    continue
                value = dict(zip(header, (cell.strip() for cell in cells), strict=False))
                rows.append(
                    _Row(
                        len(rows) + 1,
                        reader.line_num,
                        *(value.get(k, "") for k in ("path", "label", "split", "class_name", "group")),
                    )
                )
        except (UnicodeDecodeError, csv.Error) as err:
            raise NiftiError(
                f"{manifest}: not a readable CSV manifest ({err}). Pass a UTF-8 CSV file with columns "
                f"path,label[,split], or a folder laid out as <root>/<class_name>/*.nii.gz."
            ) from err
    if not rows:
        raise NiftiError(f"{manifest}: empty dataset, the manifest has no rows. Add one row per volume.")

    paths = []
    for row in rows:
        path = Path(row.path).expanduser()
        path = path if path.is_absolute() else manifest.parent / path
        if not row.path or not path.is_file():
            raise NiftiError(
                f"{_where(manifest, row)}: file {row.path!r} not found (looked for {path}). Relative paths are "
                f"resolved against the manifest's folder; fix the path or remove the row."
            )
        paths.append(path)
    splits = None
    if "split" in header:
        for row in rows:
            if row.split not in SPLITS:
                raise NiftiError(
                    f"{_where(manifest, row)}: unknown split {row.split!r}; the split column takes one of "
                    f"{list(SPLITS)}."
                )
        splits = tuple(row.split for row in rows)
    labels, class_names = _manifest_labels(manifest, rows, class_names, "class_name" in header)
    # a row without a group is a group of its own
    groups = tuple(row.group or f"\0row {row.number}" for row in rows) if "group" in header else None
    return NiftiIndex(tuple(paths), tuple(labels), class_names, splits, manifest, groups)


def _where(manifest: Path, row: _Row) -> str:
    return f"{manifest}, row {row.number} (line {row.line})"


def _manifest_labels(
    manifest: Path, rows: list[_Row], class_names: tuple[str, ...] | None, named: bool
) -> tuple[list[int], tuple[str, ...]]:
    if class_names is not None:
        labels = []
        for row in rows:
            if row.label in class_names:
                labels.append(class_names.index(row.label))
            elif _is_int(row.label) and 0 <= int(row.label) < len(class_names):
                labels.append(int(row.label))
            else:
                kind = "out of range label" if _is_int(row.label) else "unknown label"
                raise NiftiError(
                    f"{_where(manifest, row)}: {kind} {row.label!r}; expected one of {list(class_names)} or an "
                    f"integer in [0, {len(class_names) - 1}]. Fix the label or the class_names."
                )
        return labels, class_names
    numeric = [_is_int(row.label) for row in rows]
    if any(numeric) and not all(numeric):
        row = rows[numeric.index(not numeric[0])]
        raise NiftiError(
            f"{_where(manifest, row)}: label {row.label!r} mixes class names and integer labels in one manifest. "
            f"Use one kind, or pass class_names so names and indices can be matched."
        )
    if not all(numeric):
        class_names = tuple(sorted({row.label for row in rows}))
        return [class_names.index(row.label) for row in rows], class_names
    labels = [int(row.label) for row in rows]
    names = [str(i) for i in range(max(labels) + 1)]
    seen: dict[int, str] = {}
    for row, label in zip(rows, labels, strict=True):
        if label < 0:
            raise NiftiError(f"{_where(manifest, row)}: out of range label {row.label!r}; integer labels start at 0.")
        if named:
            if seen.setdefault(label, row.class_name) != row.class_name:
                raise NiftiError(
                    f"{_where(manifest, row)}: label {label} is named {row.class_name!r} here but "
                    f"{seen[label]!r} in an earlier row. Make the class_name column consistent."
                )
            names[label] = row.class_name
    return labels, tuple(names)


# --------------------------------------------------------------------------------------------------------------
# Preprocessing
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NiftiPreprocess:
    """How :func:`load_volume` turns a NIfTI file into a ``(C, D, H, W)`` array; also the cache key.

    Steps, in order: reorient to closest canonical (RAS+), resample to ``spacing``, clip to ``window``,
    normalise, resize to ``target_shape``, cast to ``dtype``.

    Attributes:
        target_shape: ``(D, H, W)`` every volume is resized to (trilinear), or ``None`` to keep shapes.
        spacing: Target voxel size in mm, one number or ``(D, H, W)``; ``None`` keeps the file's spacing.
        window: ``(low, high)`` intensity window (e.g. ``(-1000, 400)`` HU for lung CT); voxels are clipped
            to it, and ``normalize="window"`` maps it to ``[0, 1]``.
        normalize: ``"window"`` (needs ``window``), ``"zscore"`` or ``"minmax"`` (per volume and channel; a
            constant channel becomes 0), or ``"none"``.
        channel_axis: Axis (of the array as stored in the file) that holds channels in a 4D file; the other
            three are the spatial axes the affine describes. ``None``: 4D files are an error. NIfTI stores
            channels or time on axis 3.
        dtype: Floating dtype of the result.
    """

    target_shape: tuple[int, int, int] | None = None
    spacing: tuple[float, float, float] | None = None
    window: tuple[float, float] | None = None
    normalize: Normalize = "none"
    channel_axis: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        # Canonicalise (lists from YAML -> tuples, 1 -> 1.0, -1 -> 3) so equal settings give equal keys.
        put = object.__setattr__
        if self.target_shape is not None:
            shape = tuple(self.target_shape)
            if len(shape) != 3 or not all(float(n).is_integer() and n >= 1 for n in shape):
                raise ValueError(f"NiftiPreprocess: target_shape must be three positive ints (D, H, W), got {shape}")
            put(self, "target_shape", tuple(int(n) for n in shape))
        if self.spacing is not None:
            spacing = (self.spacing,) * 3 if np.isscalar(self.spacing) else tuple(self.spacing)
            if len(spacing) != 3 or not all(float(s) > 0 for s in spacing):
                raise ValueError(f"NiftiPreprocess: spacing must be one or three positive mm values, got {spacing}")
            put(self, "spacing", tuple(float(s) for s in spacing))
        if self.window is not None:
            window = tuple(float(v) for v in self.window)
            if len(window) != 2 or not window[0] < window[1]:
                raise ValueError(f"NiftiPreprocess: window must be (low, high) with low < high, got {self.window}")
            put(self, "window", window)
        if self.normalize not in _NORMALIZE_MODES:
            raise ValueError(f"NiftiPreprocess: normalize must be one of {_NORMALIZE_MODES}, got {self.normalize!r}")
        if self.normalize == "window" and self.window is None:
            raise ValueError('NiftiPreprocess: normalize="window" needs window=(low, high)')
        if self.channel_axis is not None:
            if not -4 <= int(self.channel_axis) < 4:
                raise ValueError(f"NiftiPreprocess: channel_axis must be in [-4, 3], got {self.channel_axis}")
            put(self, "channel_axis", int(self.channel_axis) % 4)
        if np.dtype(self.dtype).kind != "f":
            raise ValueError(f"NiftiPreprocess: dtype must be a floating type, got {self.dtype!r}")
        put(self, "dtype", np.dtype(self.dtype).name)

    def key(self) -> str:
        """A stable hash of every setting and :data:`FORMAT_VERSION`; names the cache folder."""
        settings = json.dumps({"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(settings.encode()).hexdigest()[:16]


def load_volume(path: str | os.PathLike[str], prep: NiftiPreprocess | None = None) -> np.ndarray:
    """Reads one NIfTI file and preprocesses it (see the module docstring for the axis convention).

    Resampling computes the new shape as ``round(shape * zooms / spacing)`` from the header zooms of the
    canonical image, so the field of view is kept and the achieved spacing differs from the target only by
    that rounding. Resampling and resizing use trilinear interpolation with ``align_corners=False`` and no
    anti-aliasing: downsampling by large factors aliases.

    Args:
        path: A ``.nii`` or ``.nii.gz`` file (any image nibabel reads with an affine works).
        prep: Preprocessing settings; default: reorient only.

    Returns:
        ``(C, D, H, W)`` array of ``prep.dtype``.

    Raises:
        NiftiError: Missing, corrupt or truncated file; not 3D (4D without ``channel_axis``); NaN or
            infinite voxels.
    """
    prep = prep or NiftiPreprocess()
    path = Path(path)
    data, zooms = _read_canonical(path, prep.channel_axis)
    finite = np.isfinite(data)
    if not finite.all():
        n_nan = int(np.isnan(data).sum())
        n_inf = int(finite.size - finite.sum()) - n_nan
        raise NiftiError(
            f"{path}: {n_nan} NaN and {n_inf} infinite voxel(s) out of {data.size}. Replace them in the source "
            f"file (e.g. with numpy.nan_to_num) or drop the volume from the dataset."
        )
    volume = torch.from_numpy(data)
    if prep.spacing is not None:
        size = tuple(max(1, round(n * z / s)) for n, z, s in zip(volume.shape[1:], zooms, prep.spacing, strict=True))
        volume = _interpolate(volume, size)
    volume = _normalize(volume, prep)
    if prep.target_shape is not None:
        volume = _interpolate(volume, prep.target_shape)
    return np.ascontiguousarray(volume.numpy(), dtype=prep.dtype)


def _corrupt(path: Path, err: BaseException) -> NiftiError:
    return NiftiError(
        f"{path}: cannot read NIfTI file, corrupt or truncated ({type(err).__name__}: {err}). This usually means "
        f"an interrupted download, copy or export; re-create the file from its source."
    )


def _read_canonical(path: Path, channel_axis: int | None) -> tuple[np.ndarray, tuple[float, float, float]]:
    """Returns the canonical float32 ``(C, D, H, W)`` data and the ``(D, H, W)`` voxel size in mm."""
    if not path.is_file():
        raise NiftiError(f"{path}: file not found. Check the path, or re-scan the dataset if files were moved.")
    try:
        img = nib.load(path)
        shape = img.shape
        while len(shape) > 3 and shape[-1] == 1:  # NIfTI pads unused dimensions with 1
            shape = shape[:-1]
        if len(shape) == 4 and channel_axis is None:
            raise NiftiError(
                f"{path}: 4D volume of shape {tuple(img.shape)} where a 3D volume is expected. If an axis holds "
                f"channels, set NiftiPreprocess(channel_axis=3) (or the axis that holds them); otherwise split "
                f"the file into 3D volumes."
            )
        if not 3 <= len(shape) <= 4:
            raise NiftiError(
                f"{path}: {len(shape)}D image of shape {tuple(img.shape)}; expected a 3D volume "
                f"(or 4D with NiftiPreprocess.channel_axis set). Convert it to 3D NIfTI volumes."
            )
        if shape != img.shape or (len(shape) == 4 and channel_axis != 3):
            data = np.asanyarray(img.dataobj).reshape(shape)
            if len(shape) == 4:
                data = np.moveaxis(data, channel_axis, -1)
            img = nib.Nifti1Image(data, img.affine)
        canonical = nib.as_closest_canonical(img)
        data = canonical.get_fdata(dtype=np.float32)
        zooms = tuple(float(z) for z in canonical.header.get_zooms()[:3])
    except NiftiError:
        raise
    except _READ_ERRORS as err:
        raise _corrupt(path, err) from err
    data = data[None] if data.ndim == 3 else np.moveaxis(data, -1, 0)
    return np.ascontiguousarray(data), zooms


def _interpolate(volume: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    size = tuple(int(n) for n in size)
    if tuple(volume.shape[1:]) == size:
        return volume
    return F.interpolate(volume[None], size=size, mode="trilinear", align_corners=False)[0]


def _normalize(volume: torch.Tensor, prep: NiftiPreprocess) -> torch.Tensor:
    if prep.window is not None:
        low, high = prep.window
        volume = volume.clamp(low, high)
        if prep.normalize == "window":
            volume = (volume - low) / (high - low)
    axes = (1, 2, 3)  # statistics per channel
    if prep.normalize == "zscore":
        std, mean = torch.std_mean(volume, dim=axes, correction=0, keepdim=True)
        volume = (volume - mean) / torch.where(std > 0, std, 1.0)
    elif prep.normalize == "minmax":
        low, high = volume.amin(dim=axes, keepdim=True), volume.amax(dim=axes, keepdim=True)
        volume = (volume - low) / torch.where(high > low, high - low, 1.0)
    return volume


# --------------------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------------------


class NiftiCache:
    """Preprocessed volumes stored as one ``.npy`` file each under ``cache_dir/<prep.key()>/``.

    An entry's name hashes the source file's absolute path, size and modification time, so an edited file is
    preprocessed again and changed settings use a different folder: a stale entry is never read. Entries are
    written atomically and read back memory-mapped. Old entries are not deleted; remove the folder to reclaim
    space.

    Args:
        cache_dir: Root folder of the cache (shared by all settings).
        prep: Preprocessing settings.
    """

    def __init__(self, cache_dir: str | os.PathLike[str], prep: NiftiPreprocess | None = None) -> None:
        self.prep = prep or NiftiPreprocess()
        self.directory = Path(cache_dir).expanduser() / self.prep.key()

    def entry_path(self, source: str | os.PathLike[str]) -> Path:
        """The cache file for ``source`` in its current state (it may not exist yet)."""
        source = Path(source).expanduser().resolve()
        try:
            stat = source.stat()
        except FileNotFoundError:
            raise NiftiError(f"{source}: file not found. Check the path, or re-scan the dataset.") from None
        digest = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:20]
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", _stem(source))[:48]
        return self.directory / f"{stem}-{digest}.npy"

    def load(self, source: str | os.PathLike[str]) -> np.ndarray:
        """Returns the preprocessed volume, memory-mapped from the cache, preprocessing it first if needed."""
        entry = self.entry_path(source)
        if entry.is_file():
            with contextlib.suppress(ValueError, OSError, EOFError):
                # Only damage from outside (a full disk, a copy cut short) fails here; rebuild then.
                return np.load(entry, mmap_mode="r")
        volume = load_volume(source, self.prep)
        self._store(entry, volume)
        return volume

    def warm(self, paths: Iterable[str | os.PathLike[str]], progress: bool = True) -> int:
        """Preprocesses every volume not cached yet, showing progress (:func:`~ddcnn.data.progress.track`).

        Returns:
            The number of volumes preprocessed.
        """
        todo = [(p, entry) for p in paths if not (entry := self.entry_path(p)).is_file()]
        for source, entry in track(todo, "preprocessing NIfTI", "volumes", progress):
            self._store(entry, load_volume(source, self.prep))
        return len(todo)

    def _store(self, entry: Path, volume: np.ndarray) -> None:
        settings = self.directory / "settings.json"
        if not settings.is_file():
            text = json.dumps({"format_version": FORMAT_VERSION, **dataclasses.asdict(self.prep)}, indent=2)
            with atomic_open(settings, fsync=False) as f:  # a cache entry can be made again
                f.write(text.encode())
        with atomic_open(entry, fsync=False) as f:
            np.save(f, volume)


# --------------------------------------------------------------------------------------------------------------
# Dataset and in-memory loading
# --------------------------------------------------------------------------------------------------------------


def _empty(index: NiftiIndex) -> NiftiError:
    where = index.source if index.source is not None else "NiftiIndex"
    return NiftiError(f"{where}: empty dataset, no volume to load. Add volumes or check the split.")


class NiftiDataset(Dataset):
    """Volumes of a :class:`NiftiIndex` as ``(tensor (C, D, H, W), label)`` pairs.

    Args:
        index: Volumes and labels, e.g. from :func:`scan_nifti`.
        prep: Preprocessing settings; default: reorient only.
        cache_dir: Cache root (see :class:`NiftiCache`); ``None`` preprocesses on every access.
        split: Keep only this split (``"train"``, ``"val"``, ``"test"``); ``None`` keeps all.
    """

    def __init__(
        self,
        index: NiftiIndex,
        prep: NiftiPreprocess | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        split: str | None = None,
    ) -> None:
        self.index = index.select(split)
        if not len(self.index):
            raise _empty(self.index)
        self.prep = prep or NiftiPreprocess()
        self.cache = NiftiCache(cache_dir, self.prep) if cache_dir is not None else None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path = self.index.paths[i]
        volume = self.cache.load(path) if self.cache is not None else load_volume(path, self.prep)
        if isinstance(volume, np.memmap):
            volume = np.array(volume)  # a private, writable copy: torch warns on read-only memory maps
        return torch.from_numpy(volume), self.index.labels[i]

    @property
    def class_names(self) -> tuple[str, ...]:
        """Class names; labels index into them."""
        return self.index.class_names


def load_arrays(
    index: NiftiIndex,
    prep: NiftiPreprocess | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    split: str | None = None,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Loads a whole split into memory.

    Args:
        index: Volumes and labels, e.g. from :func:`scan_nifti`.
        prep: Preprocessing settings; default: reorient only.
        cache_dir: Cache root (see :class:`NiftiCache`); ``None`` preprocesses every volume.
        split: Keep only this split; ``None`` loads all volumes.
        progress: Show progress: a bar on a terminal, one line per tenth in a log file
            (:func:`~ddcnn.data.progress.track`).

    Returns:
        ``x`` of shape ``(N, C, D, H, W)`` and ``y`` (int64 class indices), in index order.

    Raises:
        NiftiError: As :func:`load_volume`; also for volumes of different shapes when ``prep.target_shape``
            is not set, and for an empty selection.
    """
    index = index.select(split)
    if not len(index):
        raise _empty(index)
    prep = prep or NiftiPreprocess()
    cache = NiftiCache(cache_dir, prep) if cache_dir is not None else None
    x: np.ndarray | None = None
    first = index.paths[0]
    for i, path in enumerate(track(index.paths, "loading NIfTI", "volumes", progress)):
        volume = cache.load(path) if cache is not None else load_volume(path, prep)
        if x is None:
            x = np.empty((len(index), *volume.shape), dtype=volume.dtype)
        elif volume.shape != x.shape[1:]:
            raise NiftiError(
                f"{path}: mismatched volume shapes, (C, D, H, W) = {volume.shape} here but {x.shape[1:]} in "
                f"{first}. Set NiftiPreprocess(target_shape=(D, H, W)) to resize every volume to one shape, or "
                f"use NiftiDataset with batch size 1."
            )
        x[i] = volume
    return x, np.asarray(index.labels, dtype=np.int64)
