"""Write arrays (e.g. MedMNIST 3D archives) as NIfTI files plus a manifest that :func:`scan_nifti` reads.

Volumes go to ``out_dir/<class_name>/<split>_<index>.nii.gz`` with affine ``diag(spacing)`` (already RAS+
canonical, so :func:`ddcnn.data.nifti.load_volume` returns the array unchanged apart from the dtype), and
``out_dir/manifest.csv`` lists ``path,label,split,class_name`` with integer labels and paths relative to
``out_dir``. Every file is written to a temporary name and renamed once complete, and the manifest is written
last: a killed conversion leaves no half-written file and no manifest row pointing at a missing volume.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys
from collections.abc import Mapping, Sequence
from gzip import compress as gzip_compress
from pathlib import Path

import nibabel as nib
import numpy as np
from numpy.typing import ArrayLike

from ddcnn.data.progress import track
from ddcnn.io import atomic_open
from ddcnn.rundir import SPLITS

__all__ = ["arrays_to_nifti", "main", "npz_to_nifti", "splits_to_nifti"]

_COLUMNS = ("path", "label", "split", "class_name")


def arrays_to_nifti(
    x: ArrayLike,
    y: ArrayLike,
    out_dir: str | os.PathLike[str],
    class_names: Sequence[str] | None = None,
    split_name: str | None = None,
    spacing: Sequence[float] = (1.0, 1.0, 1.0),
    manifest_name: str = "manifest.csv",
    gzip: bool = True,
    progress: bool = True,
) -> Path:
    """Writes one split of volumes as NIfTI files and adds them to the manifest.

    Calling it once per split builds a multi-split manifest: rows of other splits are kept, rows of
    ``split_name`` (and rows without a split) are replaced, so a rerun does not duplicate them, and volumes
    those replaced rows listed that are not rewritten are deleted. With ``split_name=None`` the manifest is
    replaced and has no split column.

    Args:
        x: Volumes ``(N, D, H, W)``, or ``(N, C, D, H, W)`` stored as 4D files with channels on axis 3 (read
            them with ``NiftiPreprocess(channel_axis=3)``).
        y: Integer class indices, shape ``(N,)`` or ``(N, 1)``.
        out_dir: Output folder.
        class_names: Folder name of each class; default: zero-padded indices (``"0"``, ``"1"``, ...).
        split_name: ``"train"``, ``"val"``, ``"test"`` or ``None``.
        spacing: Voxel size in mm along ``(D, H, W)``.
        manifest_name: Manifest file name inside ``out_dir``.
        gzip: Write ``.nii.gz`` (else ``.nii``).
        progress: Show a progress bar.

    Returns:
        The manifest path.
    """
    out_dir = Path(out_dir)
    manifest = out_dir / manifest_name
    rows = _write_volumes(x, y, out_dir, class_names, split_name, spacing, gzip, progress)
    old = _read_rows(manifest)
    keep = [r for r in old if split_name is not None and r.get("split") in SPLITS and r["split"] != split_name]
    _replace_manifest(manifest, keep + rows, old)
    return manifest


def splits_to_nifti(
    splits: Mapping[str, tuple[ArrayLike, ArrayLike]],
    out_dir: str | os.PathLike[str],
    class_names: Sequence[str] | None = None,
    spacing: Sequence[float] = (1.0, 1.0, 1.0),
    manifest_name: str = "manifest.csv",
    gzip: bool = True,
    progress: bool = True,
) -> Path:
    """Writes several splits and a manifest that lists exactly them (replacing any earlier manifest).

    Args:
        splits: ``{"train": (x, y), "val": (x, y), ...}``; arrays as in :func:`arrays_to_nifti`.
        out_dir, class_names, spacing, manifest_name, gzip, progress: As in :func:`arrays_to_nifti`.

    Returns:
        The manifest path.
    """
    out_dir = Path(out_dir)
    manifest = out_dir / manifest_name
    rows = []
    for split_name, (x, y) in splits.items():
        rows += _write_volumes(x, y, out_dir, class_names, split_name, spacing, gzip, progress)
    _replace_manifest(manifest, rows, _read_rows(manifest))
    return manifest


def npz_to_nifti(
    npz_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    limit_per_split: int | None = None,
    spacing: Sequence[float] = (1.0, 1.0, 1.0),
    gzip: bool = True,
    progress: bool = True,
) -> Path:
    """Converts a MedMNIST-style archive (``x_train``, ``y_train``, ``x_val``, ..., ``class_names``) to NIfTI.

    Labels keep their integer values and the archive's ``class_names`` go to the manifest's ``class_name``
    column, so ``scan_nifti(manifest)`` gives back the archive's labels and class order.

    Args:
        npz_path: The ``.npz`` archive; volumes ``(N, D, H, W)``, labels ``(N,)`` or ``(N, 1)``.
        out_dir, spacing, gzip, progress: As in :func:`arrays_to_nifti`.
        limit_per_split: Convert only the first ``limit_per_split`` volumes of each split.

    Returns:
        The manifest path.
    """
    if limit_per_split is not None and limit_per_split < 1:
        raise ValueError(f"limit_per_split must be at least 1, got {limit_per_split}")
    stop = limit_per_split
    with np.load(npz_path, allow_pickle=False) as archive:
        keys = set(archive.files)
        class_names = [str(c) for c in archive["class_names"]] if "class_names" in keys else None
        splits = {}
        for split in SPLITS:
            if f"x_{split}" not in keys:
                continue
            if f"y_{split}" not in keys:
                raise ValueError(f"{npz_path}: has x_{split} but no y_{split}; add the labels to the archive.")
            splits[split] = (archive[f"x_{split}"][:stop], archive[f"y_{split}"][:stop])
    if not splits:
        raise ValueError(f"{npz_path}: no x_train, x_val or x_test array (keys: {sorted(keys)}).")
    return splits_to_nifti(splits, out_dir, class_names, spacing, gzip=gzip, progress=progress)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``ddcnn-nifti-convert NPZ OUT_DIR [--limit N]``."""
    parser = argparse.ArgumentParser(
        prog="ddcnn-nifti-convert",
        description="Convert a MedMNIST-style .npz archive of 3D volumes to NIfTI files and a CSV manifest.",
    )
    parser.add_argument("npz", type=Path, help="archive with x_train, y_train, x_val, ..., class_names")
    parser.add_argument("out_dir", type=Path, help="output folder (class folders and manifest.csv)")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="convert the first N volumes per split")
    parser.add_argument(
        "--spacing", type=float, nargs=3, default=(1.0, 1.0, 1.0), metavar=("SD", "SH", "SW"), help="voxel size, mm"
    )
    parser.add_argument("--no-gzip", action="store_true", help="write .nii instead of .nii.gz")
    args = parser.parse_args(argv)
    try:
        manifest = npz_to_nifti(args.npz, args.out_dir, args.limit, args.spacing, gzip=not args.no_gzip)
    except (ValueError, OSError) as err:
        print(f"ddcnn-nifti-convert: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {len(_read_rows(manifest))} volumes; manifest: {manifest}")
    return 0


def _write_volumes(
    x: ArrayLike,
    y: ArrayLike,
    out_dir: Path,
    class_names: Sequence[str] | None,
    split_name: str | None,
    spacing: Sequence[float],
    gzip: bool,
    progress: bool,
) -> list[dict[str, str]]:
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim not in (4, 5):
        raise ValueError(f"x must be (N, D, H, W) or (N, C, D, H, W), got shape {x.shape}")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.shape != (len(x),) or (y.size and not np.issubdtype(y.dtype, np.integer)):
        raise ValueError(f"y must hold {len(x)} integer labels, shape (N,) or (N, 1); got {y.dtype} {y.shape}")
    if len(x) == 0:
        raise ValueError("x is empty; nothing to convert")
    if y.min() < 0:
        raise ValueError(f"labels must be >= 0, got {y.min()}")
    if class_names is None:
        width = len(str(int(y.max())))
        class_names = [f"{i:0{width}d}" for i in range(int(y.max()) + 1)]
    class_names = [str(c) for c in class_names]
    if y.max() >= len(class_names):
        raise ValueError(f"label {y.max()} out of range for {len(class_names)} class_names {class_names}")
    for name in class_names:
        if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"class name {name!r} cannot be a folder name; rename the class")
    if split_name is not None and split_name not in SPLITS:
        raise ValueError(f"split_name must be one of {list(SPLITS)} or None, got {split_name!r}")
    spacing = tuple(float(s) for s in spacing)
    if len(spacing) != 3 or min(spacing) <= 0:
        raise ValueError(f"spacing must be three positive mm values, got {spacing}")

    affine = np.diag([*spacing, 1.0])
    width = max(5, len(str(len(x) - 1)))
    suffix = ".nii.gz" if gzip else ".nii"
    rows = []
    for i in track(range(len(x)), f"writing {split_name or 'volumes'}", "volumes", progress):
        name = class_names[int(y[i])]
        relative = f"{name}/{split_name or 'volume'}_{i:0{width}d}{suffix}"
        volume = x[i] if x.ndim == 4 else np.moveaxis(x[i], 0, -1)  # NIfTI keeps channels on axis 3
        data = _nifti_bytes(volume, affine)
        with atomic_open(out_dir / relative) as f:
            f.write(gzip_compress(data, compresslevel=6, mtime=0) if gzip else data)
        rows.append({"path": relative, "label": str(int(y[i])), "split": split_name or "", "class_name": name})
    return rows


def _nifti_bytes(volume: np.ndarray, affine: np.ndarray) -> bytes:
    dtype = None
    if volume.dtype == np.bool_:
        volume = volume.astype(np.uint8)
    elif volume.dtype == np.float16:  # NIfTI has no 16-bit float type
        volume = volume.astype(np.float32)
    elif volume.dtype.kind in "iu" and volume.dtype.itemsize == 8:
        dtype = "compat"  # nibabel refuses 64-bit ints by default; "compat" picks a type that holds the values
    img = nib.Nifti1Image(np.ascontiguousarray(volume), affine, dtype=dtype)
    img.header.set_xyzt_units("mm")
    return img.to_bytes()


def _read_rows(manifest: Path) -> list[dict[str, str]]:
    if not manifest.is_file():
        return []
    with open(manifest, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _replace_manifest(manifest: Path, rows: list[dict[str, str]], old_rows: list[dict[str, str]]) -> None:
    rows = sorted(rows, key=lambda r: SPLITS.index(r["split"]) if r.get("split") in SPLITS else -1)
    columns = [c for c in _COLUMNS if c != "split" or any(r.get("split") for r in rows)]
    text = io.StringIO()
    writer = csv.DictWriter(text, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    with atomic_open(manifest) as f:
        f.write(text.getvalue().encode())
    # Volumes an earlier manifest listed that are no longer listed: delete them (only inside out_dir), so the
    # class folders match the manifest and a folder scan does not pick them up.
    root = manifest.parent.resolve()
    listed = {(root / r["path"]).resolve() for r in rows}
    for row in old_rows:
        path = (root / row.get("path", "")).resolve()
        if path not in listed and path.is_relative_to(root) and path != root and path.is_file():
            path.unlink()
