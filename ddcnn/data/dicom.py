"""DICOM CT studies as scanners write them: the right series, read with the right geometry, stored as NIfTI.

A study is a folder (files nested at any depth) holding one or more series. Reading one follows these rules, so that
a volume is right or refused, never silently wrong:

* files are grouped by ``SeriesInstanceUID``; localizer/scout images (``ImageType`` LOCALIZER or SCOUT), dose
  summaries (structured reports, screens described as "Dose Report", "Patient Protocol", ...; a "Low Dose" protocol is
  kept), secondary captures and radiotherapy objects are dropped, and the dataset says how many; files that are not
  DICOM (and ``DICOMDIR``) are ignored;
* one series per study is chosen by a :class:`SeriesRule` (``data.source.series``: a description pattern, a kernel
  pattern, a slice-thickness range or a UID); none or several matching is refused naming the candidates;
* slices are sorted by their position along the slice normal (``ImagePositionPatient`` projected on the cross product
  of the two ``ImageOrientationPatient`` directions), never by ``InstanceNumber`` or file name;
* mixed slice sizes, orientations or pixel spacings, duplicated positions, a missing slice, uneven spacing and gantry
  tilt are refused naming the study, the series and the problem. ``regrid`` resamples uneven spacing (gaps up to
  :data:`MAX_REGRID_GAP` slices) linearly onto a regular grid at the median spacing; ``correct_tilt`` shifts each
  slice in its plane by its offset from the first one (bilinear; the sheared stack becomes a straight one along the
  normal, as dcm2niix's tilt correction does);
* intensities are Hounsfield units, stored value x ``RescaleSlope`` + ``RescaleIntercept``; for CT, padding
  (``PixelPaddingValue``, or any value below -1024 HU, which scanners write outside the field of view, e.g. -2000 or
  -3024) becomes air (-1024 HU);
* the volume's affine maps voxel ``(column, row, slice)`` to RAS+ millimetres (DICOM's LPS with x and y negated), so
  :func:`ddcnn.data.nifti.load_volume` reorients it to RAS+ as any NIfTI file.

Enhanced (multi-frame) CT is refused with the reason: one file holds every slice and its per-frame geometry, which this
reader does not parse; convert it with dcm2niix first and use ``data=nifti``.

Identifying tags (``PatientName``, ``PatientID``, birth date, accession number, ...) are read only to keep one
patient's studies together (:attr:`DicomIndex.groups`); their values never appear in a message, log or written file.

This module needs pydicom (``pip install 'ddcnn[dicom]'``), imported when a function here first reads a file.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from ddcnn.io import atomic_open
from ddcnn.rundir import SPLITS

__all__ = [
    "AIR_HU",
    "DICOM_FORMAT",
    "MAX_REGRID_GAP",
    "DicomError",
    "DicomIndex",
    "SeriesInfo",
    "SeriesRule",
    "SeriesVolume",
    "Study",
    "choose_series",
    "convert_studies",
    "main",
    "read_series",
    "scan_dicom",
    "scan_study",
    "series_to_nifti",
    "to_nifti_image",
]

log = logging.getLogger(__name__)

DICOM_FORMAT = 1
"""Part of every converted volume's cache key; bump it when reading a series changes for unchanged settings."""
AIR_HU = -1024.0
MAX_REGRID_GAP = 3.0
"""``regrid`` interpolates across gaps up to this many median slice spacings; a wider gap is refused (no data)."""

_POSITION_TOL_MM = 0.01  # two slices closer than this along the normal share a position
_SPACING_TOL = 0.01  # slice gaps within 1% of the median (and _POSITION_TOL_MM) are even
_TILT_TOL_MM = 0.05  # an in-plane offset of a slice from the first one above this is a shear (tilt)
_ORIENTATION_TOL = 1e-4
_SOP_SECONDARY_CAPTURE = "1.2.840.10008.5.1.4.1.1.7"  # and .7.1 to .7.4
_SOP_STRUCTURED_REPORT = "1.2.840.10008.5.1.4.1.1.88."  # radiation dose SR among them
_SOP_ENHANCED_CT = "1.2.840.10008.5.1.4.1.1.2.1"
_SOP_RADIOTHERAPY = "1.2.840.10008.5.1.4.1.1.481."  # RT dose, plan, structure set, ...
_DOSE_SCREEN = re.compile(r"dose\s*(report|summary|info|screen|record)|patient\s*protocol|radiation\s*dose")
_SOP_MEDIA_DIRECTORY = "1.2.840.10008.1.3.10"
_J2K = "pylibjpeg-openjpeg (pip install pylibjpeg pylibjpeg-openjpeg), python-gdcm, or Pillow built with OpenJPEG"
_PLUGINS = {
    "1.2.840.10008.1.2.4.90": _J2K,
    "1.2.840.10008.1.2.4.91": _J2K,
    "1.2.840.10008.1.2.4.80": "pylibjpeg-libjpeg (pip install pylibjpeg pylibjpeg-libjpeg) or python-gdcm",
    "1.2.840.10008.1.2.4.81": "pylibjpeg-libjpeg (pip install pylibjpeg pylibjpeg-libjpeg) or python-gdcm",
    "1.2.840.10008.1.2.4.70": "pylibjpeg-libjpeg (pip install pylibjpeg pylibjpeg-libjpeg) or python-gdcm",
    "1.2.840.10008.1.2.4.57": "pylibjpeg-libjpeg (pip install pylibjpeg pylibjpeg-libjpeg) or python-gdcm",
}
_ANY_PLUGIN = "pylibjpeg with pylibjpeg-openjpeg / pylibjpeg-libjpeg, or python-gdcm"


class DicomError(ValueError):
    """A DICOM study, series or dataset that cannot be used; the message names it, the problem and the fix."""


def _pydicom():
    try:
        import pydicom
    except ImportError as err:
        raise ImportError("reading DICOM needs pydicom: pip install 'ddcnn[dicom]' (or pip install pydicom).") from err
    return pydicom


# --------------------------------------------------------------------------------------------------------------
# Headers: the slices of a study and its series
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slice:
    path: Path
    ipp: tuple[float, float, float]
    iop: tuple[float, ...]
    rows: int
    columns: int
    pixel_spacing: tuple[float, float]
    frames: int
    sop_class: str


@dataclass
class SeriesInfo:
    """One series of a study, from its headers.

    Attributes:
        uid: ``SeriesInstanceUID``.
        number: ``SeriesNumber`` (``None`` when absent).
        description: ``SeriesDescription`` (``""`` when absent).
        kernel: ``ConvolutionKernel`` (``""`` when absent).
        thickness: ``SliceThickness`` in mm (``None`` when absent).
        modality: ``Modality``.
        slices: The image files, in the order found (sorted by position only when read).
    """

    uid: str
    number: int | None
    description: str
    kernel: str
    thickness: float | None
    modality: str
    slices: list[_Slice] = field(default_factory=list)

    def describe(self) -> str:
        """How messages name the series: number, description, kernel, thickness, slice count, end of its UID."""
        thickness = f"{self.thickness:g} mm" if self.thickness is not None else "thickness not given"
        number = f"series {self.number}" if self.number is not None else "series"
        return (
            f"{number} {self.description!r} (kernel {self.kernel or 'not given'}, {thickness}, {len(self.slices)} "
            f"slice(s), UID ...{self.uid[-12:]})"
        )


@dataclass
class Study:
    """The series of one study folder (from headers) and what was dropped or ignored.

    Attributes:
        folder: The study folder.
        series: Candidate image series (scouts, dose summaries, secondary captures dropped).
        dropped: Files dropped per reason (``localizer/scout``, ``dose summary``, ``secondary capture``, ...).
        ignored: Files that are not DICOM images (other files, ``DICOMDIR``).
        patient: A hash of the ``PatientID`` (``None`` when no file names one); the value itself is not kept.
    """

    folder: Path
    series: list[SeriesInfo]
    dropped: Counter
    ignored: int
    patient: str | None


def _text(ds: Any, key: str) -> str:
    value = ds.get(key)
    if value is None:
        return ""
    if isinstance(value, list | tuple) or type(value).__name__ == "MultiValue":
        return "\\".join(str(v) for v in value)
    return str(value).strip()


def _number(ds: Any, key: str) -> float | None:
    value = ds.get(key)
    try:
        return float(value) if value is not None and str(value).strip() != "" else None
    except (TypeError, ValueError):
        return None


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def _files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _read_header(path: Path) -> Any | None:
    pydicom = _pydicom()
    from pydicom.errors import InvalidDicomError

    try:
        return pydicom.dcmread(path, stop_before_pixels=True)
    except InvalidDicomError:
        pass
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        return None
    try:  # files written without the 128-byte preamble and file meta (older exports)
        ds = pydicom.dcmread(path, stop_before_pixels=True, force=True)
    except Exception:  # noqa: BLE001 - force=True reads anything; whatever fails here is not DICOM
        return None
    return ds if "SOPClassUID" in ds or "ImagePositionPatient" in ds else None


def _drop_reason(ds: Any) -> str | None:
    sop = _text(ds, "SOPClassUID")
    image_type = _text(ds, "ImageType").upper().split("\\")
    description = _text(ds, "SeriesDescription").lower()
    if sop == _SOP_MEDIA_DIRECTORY or "DirectoryRecordSequence" in ds:
        return "directory"
    if sop.startswith(_SOP_STRUCTURED_REPORT):
        return "dose summary or report"
    if sop.startswith(_SOP_SECONDARY_CAPTURE):
        return "secondary capture"
    if sop.startswith(_SOP_RADIOTHERAPY):
        return "radiotherapy object"
    if "LOCALIZER" in image_type or "SCOUT" in image_type or "topogram" in description or "scout" in description:
        return "localizer/scout"
    # a dose screen saved as an image; not "low dose", a CT protocol's name
    if _DOSE_SCREEN.search(description) or "DOSE" in image_type or "SCREEN SAVE" in " ".join(image_type):
        return "dose summary or report"
    if not ds.get("Rows"):  # headers read without the pixels: an image states its rows
        return "no image"
    multi_frame = sop == _SOP_ENHANCED_CT or (_number(ds, "NumberOfFrames") or 1) > 1
    if not multi_frame and ("ImagePositionPatient" not in ds or "ImageOrientationPatient" not in ds):
        return "no position or orientation"
    return None  # an enhanced (multi-frame) image stays a candidate series, refused with the reason if chosen


def scan_study(folder: str | os.PathLike[str]) -> Study:
    """Reads the headers of every file under ``folder`` and groups the images into series.

    Raises:
        DicomError: No DICOM image in the folder, or images of more than one patient.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise DicomError(f"{folder}: no such study folder. Check the path (a study is a folder of DICOM files).")
    series: dict[str, SeriesInfo] = {}
    dropped: Counter = Counter()
    ignored = 0
    patients: set[str] = set()
    for path in _files(folder):
        ds = _read_header(path)
        if ds is None:
            ignored += 1
            continue
        reason = _drop_reason(ds)
        if reason == "directory":
            ignored += 1
            continue
        patient = _text(ds, "PatientID")
        if patient:
            patients.add(_digest(patient))
        if reason is not None:
            dropped[reason] += 1
            continue
        uid = _text(ds, "SeriesInstanceUID") or "(no SeriesInstanceUID)"
        if uid not in series:
            number = _number(ds, "SeriesNumber")
            series[uid] = SeriesInfo(
                uid=uid,
                number=int(number) if number is not None else None,
                description=_text(ds, "SeriesDescription"),
                kernel=_text(ds, "ConvolutionKernel"),
                thickness=_number(ds, "SliceThickness"),
                modality=_text(ds, "Modality"),
            )
        spacing = [float(v) for v in ds.get("PixelSpacing") or (1.0, 1.0)]
        series[uid].slices.append(
            _Slice(
                path=path,
                ipp=tuple(float(v) for v in ds.get("ImagePositionPatient") or (0.0, 0.0, 0.0)),
                iop=tuple(float(v) for v in ds.get("ImageOrientationPatient") or (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)),
                rows=int(ds.get("Rows") or 0),
                columns=int(ds.get("Columns") or 0),
                pixel_spacing=(spacing[0], spacing[1]),
                frames=int(_number(ds, "NumberOfFrames") or 1),
                sop_class=_text(ds, "SOPClassUID"),
            )
        )
    if len(patients) > 1:
        raise DicomError(
            f"{folder}: the study folder holds images of {len(patients)} different patients (PatientID); a study "
            f"folder holds one patient's study. Move each patient's files into a folder of their own."
        )
    if not series:
        what = ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items()))
        raise DicomError(
            f"{folder}: no DICOM image series in the study folder ({ignored} other file(s) ignored"
            f"{'; dropped: ' + what if what else ''}). Put the study's DICOM files there, or remove the folder."
        )
    ordered = sorted(series.values(), key=lambda s: (s.number if s.number is not None else -1, s.uid))
    return Study(folder, ordered, dropped, ignored, next(iter(patients), None))


# --------------------------------------------------------------------------------------------------------------
# The series rule
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeriesRule:
    """Which series of a study to read (``data.source.series``); every given field must match, none given matches
    every series, so a study must then hold exactly one.

    Attributes:
        description: A regular expression searched (case-insensitive) in ``SeriesDescription``.
        kernel: A regular expression searched (case-insensitive) in ``ConvolutionKernel``.
        thickness: ``(min, max)`` ``SliceThickness`` in mm, both inclusive.
        uid: The ``SeriesInstanceUID`` (one study's series; for a dataset, a description or kernel rule).
    """

    description: str | None = None
    kernel: str | None = None
    thickness: tuple[float, float] | None = None
    uid: str | None = None

    def __post_init__(self) -> None:
        for key in ("description", "kernel"):
            pattern = getattr(self, key)
            if pattern is not None:
                try:
                    re.compile(str(pattern))
                except re.error as err:
                    raise ValueError(
                        f"data.source.series.{key}={pattern!r} is not a regular expression ({err})."
                    ) from err
                object.__setattr__(self, key, str(pattern))
        if self.thickness is not None:
            low, high = (float(v) for v in self.thickness)
            if not 0 <= low <= high:
                raise ValueError(
                    f"data.source.series.thickness must be [min, max] in mm with 0 <= min <= max, got "
                    f"{list(self.thickness)}."
                )
            object.__setattr__(self, "thickness", (low, high))
        if self.uid is not None:
            object.__setattr__(self, "uid", str(self.uid).strip())

    @classmethod
    def of(cls, value: SeriesRule | dict | str | None) -> SeriesRule:
        """A rule from a setting: ``None`` (any series), a description pattern, or a mapping of the fields."""
        if isinstance(value, SeriesRule):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(description=value)
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(
                f"data.source.series has unknown key(s) {sorted(unknown)}; it takes description, kernel, thickness "
                f"and uid."
            )
        thickness = value.get("thickness")
        return cls(
            description=value.get("description"),
            kernel=value.get("kernel"),
            thickness=tuple(thickness) if thickness is not None else None,
            uid=value.get("uid"),
        )

    def matches(self, series: SeriesInfo) -> bool:
        """Whether ``series`` fits every field given."""
        if self.uid is not None and series.uid != self.uid:
            return False
        if self.description is not None and not re.search(self.description, series.description, re.IGNORECASE):
            return False
        if self.kernel is not None and not re.search(self.kernel, series.kernel, re.IGNORECASE):
            return False
        low, high = self.thickness if self.thickness is not None else (-math.inf, math.inf)
        return self.thickness is None or (series.thickness is not None and low <= series.thickness <= high)

    def describe(self) -> str:
        """The rule as the settings that state it."""
        given = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return ", ".join(f"{k}={list(v) if isinstance(v, tuple) else v!r}" for k, v in given.items()) or "any series"


def choose_series(study: Study, rule: SeriesRule | dict | str | None = None) -> SeriesInfo:
    """The one series of ``study`` that ``rule`` matches.

    Raises:
        DicomError: None or several match; the message lists the candidates and the settings that pick one.
    """
    rule = SeriesRule.of(rule)
    matching = [s for s in study.series if rule.matches(s)]
    if len(matching) == 1:
        return matching[0]
    shown = "; ".join(s.describe() for s in study.series)
    how = (
        "set data.source.series (description: a pattern of SeriesDescription, kernel: a pattern of "
        "ConvolutionKernel, thickness: [min, max] mm, or uid; ddcnn-dicom-to-nifti --description, --kernel, "
        "--thickness, --uid) so that exactly one series of each study matches"
    )
    if not matching:
        raise DicomError(f"{study.folder}: no series matches the series rule ({rule.describe()}); candidates: {shown}. "
                         f"{how[0].upper()}{how[1:]}.")  # fmt: skip
    chosen = "; ".join(s.describe() for s in matching)
    raise DicomError(
        f"{study.folder}: {len(matching)} series match the series rule ({rule.describe()}): {chosen}. Which one is "
        f"meant is not guessed: {how}."
    )


# --------------------------------------------------------------------------------------------------------------
# Reading one series: geometry, pixels, Hounsfield units
# --------------------------------------------------------------------------------------------------------------


@dataclass
class SeriesVolume:
    """One series read as a volume.

    Attributes:
        data: ``(columns, rows, slices)`` float32 values (Hounsfield units for CT), voxel ``[i, j, k]`` is column
            ``i`` of row ``j`` of the ``k``-th slice along the normal.
        affine: Voxel -> RAS+ millimetres (4x4).
        padded: Voxels set to air (padding; CT only).
        corrected: What was resampled (``"regrid"``, ``"tilt"``), empty when the stack was read as it is.
        tilt_deg: The gantry tilt found (0 when none).
    """

    data: np.ndarray
    affine: np.ndarray
    padded: int = 0
    corrected: tuple[str, ...] = ()
    tilt_deg: float = 0.0

    @property
    def spacing(self) -> tuple[float, float, float]:
        """Voxel size in mm along the three voxel axes."""
        return tuple(float(v) for v in np.linalg.norm(self.affine[:3, :3], axis=0))

    @property
    def orientation(self) -> str:
        """The voxel axes' directions as nibabel writes them (``"LPS"``: i towards Left, j Posterior, k Superior)."""
        return "".join(nib.aff2axcodes(self.affine))


def _refuse(study: Path | str, series: SeriesInfo, problem: str, fix: str) -> DicomError:
    return DicomError(f"{study}: {series.describe()}: {problem}. {fix}")


def _geometry(series: SeriesInfo, where: Path | str) -> tuple[list[_Slice], np.ndarray, np.ndarray, np.ndarray]:
    """The slices sorted along the normal, their positions along it, the row/column/normal directions."""
    slices = series.slices
    if any(s.frames > 1 for s in slices) or any(s.sop_class == _SOP_ENHANCED_CT for s in slices):
        raise _refuse(
            where,
            series,
            "enhanced (multi-frame) CT, one file holding every slice with per-frame geometry, which this reader does "
            "not parse",
            "Convert the series with dcm2niix and train with data=nifti, or export classic single-frame CT images.",
        )
    if len(slices) < 2:
        raise _refuse(where, series, "a single slice, not a volume", "Choose a series of two or more slices.")
    sizes = Counter((s.rows, s.columns) for s in slices)
    if len(sizes) > 1:
        shown = ", ".join(f"{n} of {r}x{c}" for (r, c), n in sizes.most_common())
        raise _refuse(where, series, f"mixed slice sizes ({shown})", "Export the series again, or choose another.")
    iop = np.asarray([s.iop for s in slices])
    if np.abs(iop - iop[0]).max() > _ORIENTATION_TOL:
        n = len({tuple(np.round(v, 4)) for v in iop})
        raise _refuse(where, series, f"mixed orientations ({n} different ImageOrientationPatient)",
                      "A series of one orientation is needed; choose another series.")  # fmt: skip
    spacings = {s.pixel_spacing for s in slices}
    if len(spacings) > 1:
        raise _refuse(where, series, f"mixed pixel spacings {sorted(spacings)}", "Choose another series.")
    row_dir, col_dir = iop[0, :3], iop[0, 3:]
    normal = np.cross(row_dir, col_dir)
    if not math.isclose(float(np.linalg.norm(normal)), 1.0, abs_tol=1e-3):
        raise _refuse(where, series, f"an ImageOrientationPatient {list(iop[0])} whose directions are not unit and "
                      "orthogonal", "The headers are damaged; export the series again.")  # fmt: skip
    position = np.asarray([s.ipp for s in slices]) @ normal
    order = np.argsort(position, kind="stable")
    return [slices[k] for k in order], position[order], row_dir, col_dir


def _check_spacing(series: SeriesInfo, where: Path | str, z: np.ndarray, regrid: bool) -> float:
    """The slice spacing (median gap); refuses duplicated positions always, uneven gaps unless ``regrid``."""
    gaps = np.diff(z)
    duplicated = int((gaps < _POSITION_TOL_MM).sum())
    if duplicated:
        k = int(np.flatnonzero(gaps < _POSITION_TOL_MM)[0])
        raise _refuse(
            where,
            series,
            f"duplicated slice positions: {duplicated} slice(s) share a position with another (first at "
            f"{z[k]:.2f} mm along the normal)",
            "Two slices at one place are two acquisitions or a copied file; remove the copies or choose another "
            "series (regrid does not decide between them).",
        )
    spacing = float(np.median(gaps))
    off = np.abs(gaps - spacing) > max(_SPACING_TOL * spacing, _POSITION_TOL_MM)
    if not off.any():
        return spacing
    ratio = gaps / spacing
    missing = off & (np.abs(ratio - np.round(ratio)) < 0.1) & (ratio > 1.5)
    widest = float(gaps.max())
    if (missing == off).all():
        n = int(np.round(ratio[missing] - 1).sum())
        problem = (f"{n} missing slice(s): gap(s) of {', '.join(f'{g:g}' for g in gaps[missing][:5])} mm in a "
                   f"stack of {spacing:g} mm")  # fmt: skip
    else:
        problem = f"uneven slice spacing: gaps from {gaps.min():g} to {widest:g} mm (median {spacing:g} mm)"
    if not regrid:
        raise _refuse(where, series, problem,
                      "Set data.source.regrid=true (ddcnn-dicom-to-nifti --regrid) to resample it onto a regular "
                      "grid at the median spacing, or choose another series.")  # fmt: skip
    if widest > MAX_REGRID_GAP * spacing:
        raise _refuse(where, series, problem + f"; the widest gap, {widest:g} mm, is more than {MAX_REGRID_GAP:g} "
                      "slices wide, too wide to interpolate", "Choose another series, or split the stack "
                      "into the volumes it holds.")  # fmt: skip
    return spacing


def _pixels(path: Path, where: Path | str, series: SeriesInfo) -> tuple[np.ndarray, np.ndarray]:
    """One slice's values (rescaled) and its padding mask."""
    pydicom = _pydicom()
    ds = pydicom.dcmread(path, force=True)
    syntax = str(getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", "") or "")
    try:
        stored = np.asarray(ds.pixel_array)
    except Exception as err:  # pydicom raises RuntimeError/NotImplementedError/ValueError when it cannot decode
        compressed = syntax not in ("1.2.840.10008.1.2", "1.2.840.10008.1.2.1", "1.2.840.10008.1.2.2", "")
        if compressed:
            name = getattr(getattr(ds.file_meta, "TransferSyntaxUID", None), "name", syntax)
            raise _refuse(where, series, f"pixel data compressed as {name} ({syntax}), which pydicom cannot decode "
                          "with the packages installed", f"Install {_PLUGINS.get(syntax, _ANY_PLUGIN)}, or "
                          "decompress the files (e.g. gdcmconv --raw).") from err  # fmt: skip
        raise _refuse(where, series, f"{path.name}: pixel data cannot be read ({type(err).__name__}: {err})",
                      "The file is damaged; export the series again.") from err  # fmt: skip
    if stored.ndim != 2:
        raise _refuse(where, series, f"{path.name}: pixel data of shape {stored.shape}, not one grey slice",
                      "Choose a series of grey-level CT slices.")  # fmt: skip
    padding = ds.get("PixelPaddingValue")
    mask = stored == padding if padding is not None else np.zeros(stored.shape, dtype=bool)
    slope = _number(ds, "RescaleSlope")
    intercept = _number(ds, "RescaleIntercept")
    values = stored.astype(np.float32) * np.float32(1.0 if slope is None else slope)
    values += np.float32(0.0 if intercept is None else intercept)
    return values, mask


def read_series(
    series: SeriesInfo, where: Path | str = "", *, regrid: bool = False, correct_tilt: bool = False
) -> SeriesVolume:
    """Reads one series as a volume with its affine, following the rules of the module docstring.

    Args:
        series: From :func:`scan_study` / :func:`choose_series`.
        where: The study, as messages name it.
        regrid: Resample uneven slice spacing (gaps up to :data:`MAX_REGRID_GAP` slices) onto a regular grid.
        correct_tilt: Shift each slice in its plane to undo a gantry tilt (a sheared stack).

    Raises:
        DicomError: Any problem of the module docstring's rules, naming the study, the series and the fix.
    """
    slices, z, row_dir, col_dir = _geometry(series, where)
    normal = np.cross(row_dir, col_dir)
    spacing = _check_spacing(series, where, z, regrid)
    row_spacing, col_spacing = slices[0].pixel_spacing  # DICOM: between rows, between columns
    first = np.asarray(slices[0].ipp)
    offsets = np.asarray([s.ipp for s in slices]) - first
    shear = offsets - np.outer(offsets @ normal, normal)  # in-plane part of each slice's offset from the first
    sheared = float(np.linalg.norm(shear, axis=1).max())
    tilt = math.degrees(math.atan2(float(np.linalg.norm(shear[-1])), float(z[-1] - z[0]))) if sheared else 0.0
    if sheared > _TILT_TOL_MM and not correct_tilt:
        raise _refuse(where, series, f"gantry tilt of {tilt:.2f} degrees (each slice shifted in its plane, up to "
                      f"{sheared:.1f} mm): a plain stack of its slices misplaces them", "Set "
                      "data.source.correct_tilt=true (ddcnn-dicom-to-nifti --correct-tilt) to shift every slice back "
                      "onto a straight stack, or choose another series.")  # fmt: skip
    values, masks = zip(*(_pixels(s.path, where, series) for s in slices), strict=True)
    stack = np.stack(values)  # (slices, rows, columns)
    mask = np.stack(masks)
    ct = series.modality.upper() in ("CT", "")
    if ct:
        mask |= stack < AIR_HU
    else:
        mask[:] = False
    padded = int(mask.sum())
    stack[mask] = AIR_HU
    corrected: list[str] = []
    if sheared > _TILT_TOL_MM:
        from scipy.ndimage import shift

        fill = AIR_HU if ct else 0.0
        for k in range(len(stack)):
            rows, cols = (shear[k] @ col_dir) / row_spacing, (shear[k] @ row_dir) / col_spacing
            stack[k] = shift(stack[k], (rows, cols), order=1, mode="grid-constant", cval=fill)
        corrected.append("tilt")
    if regrid and len(z) > 1 and np.abs(np.diff(z) - spacing).max() > max(_SPACING_TOL * spacing, _POSITION_TOL_MM):
        n = int(round((z[-1] - z[0]) / spacing)) + 1
        grid = z[0] + spacing * np.arange(n)
        upper = np.clip(np.searchsorted(z, grid, side="right"), 1, len(z) - 1)
        lower = upper - 1
        w = np.clip((grid - z[lower]) / (z[upper] - z[lower]), 0.0, 1.0).astype(np.float32)[:, None, None]
        stack = (1 - w) * stack[lower] + w * stack[upper]
        corrected.append("regrid")
    lps = np.eye(4)
    lps[:3, 0] = row_dir * col_spacing
    lps[:3, 1] = col_dir * row_spacing
    lps[:3, 2] = normal * spacing
    lps[:3, 3] = first
    affine = np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps  # DICOM's LPS -> RAS
    data = np.ascontiguousarray(np.transpose(stack, (2, 1, 0)), dtype=np.float32)
    return SeriesVolume(data, affine, padded, tuple(corrected), tilt if sheared > _TILT_TOL_MM else 0.0)


def to_nifti_image(volume: SeriesVolume) -> nib.Nifti1Image:
    """The volume as a NIfTI image: int16 when every value is a whole number that fits (as dcm2niix writes CT),
    float32 otherwise; scanner coordinates (qform and sform code 1), millimetres."""
    data = volume.data
    exact = np.array_equal(data, np.round(data)) and data.min() >= -32768 and data.max() <= 32767
    image = nib.Nifti1Image(data.astype(np.int16) if exact else data, volume.affine)
    image.header.set_xyzt_units("mm")
    image.set_qform(volume.affine, code=1)
    image.set_sform(volume.affine, code=1)
    return image


def series_to_nifti(
    folder: str | os.PathLike[str],
    out: str | os.PathLike[str],
    rule: SeriesRule | dict | str | None = None,
    *,
    regrid: bool = False,
    correct_tilt: bool = False,
) -> SeriesVolume:
    """Writes the series of ``folder`` that ``rule`` chooses as one NIfTI file (``.nii`` or ``.nii.gz``), atomically.

    Returns:
        The volume written.

    Raises:
        DicomError: As :func:`scan_study`, :func:`choose_series` and :func:`read_series`.
    """
    study = scan_study(folder)
    volume = read_series(choose_series(study, rule), study.folder, regrid=regrid, correct_tilt=correct_tilt)
    _write_nifti(to_nifti_image(volume), Path(out))
    return volume


def _write_nifti(image: nib.Nifti1Image, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    data = image.to_bytes()
    if out.name.lower().endswith(".gz"):
        import gzip

        data = gzip.compress(data, compresslevel=1, mtime=0)
    with atomic_open(out, fsync=False) as f:
        f.write(data)


# --------------------------------------------------------------------------------------------------------------
# Datasets: studies, labels, patient groups
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DicomIndex:
    """The studies of a dataset and their labels, as found by :func:`scan_dicom` (no file read yet).

    Attributes:
        studies: Study folders.
        labels: Class index of each study.
        class_names: Class names; ``labels`` index into them.
        groups: The manifest's ``group`` of each study, or ``None`` (then the studies' PatientID decides).
        splits: The manifest's ``split`` of each study, or ``None``.
        source: The folder or manifest the index was read from.
    """

    studies: tuple[Path, ...]
    labels: tuple[int, ...]
    class_names: tuple[str, ...]
    groups: tuple[str, ...] | None = None
    splits: tuple[str, ...] | None = None
    source: Path | None = None

    def __len__(self) -> int:
        return len(self.studies)


def scan_dicom(root_or_manifest: str | os.PathLike[str], class_names: Sequence[str] | None = None) -> DicomIndex:
    """Finds the studies of a dataset: class folders (``root/<class>/<study>/...``, each study a folder, files nested
    at any depth below it) or a CSV manifest with a header row ``path,label[,group][,split]`` (paths of study folders,
    absolute or relative to the manifest's folder; labels are class names or integers).

    Raises:
        DicomError: Missing source, a class folder without studies, a manifest row naming no folder, an unknown
            label or split.
    """
    source = Path(root_or_manifest).expanduser()
    names = tuple(str(c) for c in class_names) if class_names is not None else None
    if source.is_dir():
        classes = sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not classes:
            raise DicomError(f"{source}: no class folders. Lay the studies out as {source}/<class>/<study>/..., or "
                             "pass a manifest (CSV: path,label[,group][,split]).")  # fmt: skip
        names = names or tuple(c.name for c in classes)
        unknown = [c.name for c in classes if c.name not in names]
        if unknown:
            raise DicomError(f"{source}: class folder(s) {unknown} not in class_names {list(names)}.")
        studies: list[Path] = []
        labels: list[int] = []
        for folder in classes:
            found = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
            if not found:
                loose = sum(1 for p in folder.iterdir() if p.is_file())
                raise DicomError(
                    f"{folder}: no study folders in class folder {folder.name!r} ({loose} loose file(s)). Each study "
                    f"is a folder: {folder}/<study>/... (a series' files directly in the class folder would make all "
                    f"of them one study)."
                )
            studies += found
            labels += [names.index(folder.name)] * len(found)
        return DicomIndex(tuple(studies), tuple(labels), names, None, None, source)
    if source.is_file():
        return _read_manifest(source, names)
    raise DicomError(f"{source}: no such folder or manifest. Pass {source}/<class>/<study>/... or a CSV manifest "
                     "with columns path,label[,group][,split].")  # fmt: skip


def _read_manifest(manifest: Path, class_names: tuple[str, ...] | None) -> DicomIndex:
    with open(manifest, newline="", encoding="utf-8-sig") as f:
        rows = [{k.strip().lower(): (v or "").strip() for k, v in row.items() if k} for row in csv.DictReader(f)]
    rows = [r for r in rows if any(r.values())]
    if not rows or "path" not in rows[0] or "label" not in rows[0]:
        raise DicomError(f"{manifest}: a DICOM manifest needs a header row path,label[,group][,split] and one row per "
                         "study.")  # fmt: skip
    studies = []
    for number, row in enumerate(rows, 1):
        path = Path(row["path"]).expanduser()
        path = path if path.is_absolute() else manifest.parent / path
        if not row["path"] or not path.is_dir():
            raise DicomError(f"{manifest}, row {number}: study folder {row['path']!r} not found (looked for {path}).")
        split = row.get("split", "")
        if "split" in rows[0] and split not in SPLITS:
            raise DicomError(f"{manifest}, row {number}: unknown split {split!r}; one of {list(SPLITS)}.")
        studies.append(path)
    raw = [r["label"] for r in rows]
    if class_names is None:
        numeric = all(v.lstrip("-").isdigit() for v in raw)
        class_names = tuple(str(i) for i in range(max(int(v) for v in raw) + 1)) if numeric else tuple(sorted(set(raw)))
    labels = []
    for number, value in enumerate(raw, 1):
        if value in class_names:
            labels.append(class_names.index(value))
        elif value.isdigit() and int(value) < len(class_names):
            labels.append(int(value))
        else:
            raise DicomError(f"{manifest}, row {number}: unknown label {value!r}; one of {list(class_names)}.")
    groups = tuple(r.get("group", "") or f"row {i}" for i, r in enumerate(rows)) if "group" in rows[0] else None
    splits = tuple(r["split"] for r in rows) if "split" in rows[0] else None
    return DicomIndex(tuple(studies), tuple(labels), class_names, groups, splits, manifest)


def _study_files_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in _files(folder):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def convert_studies(
    index: DicomIndex,
    cache_dir: str | os.PathLike[str],
    rule: SeriesRule | dict | str | None = None,
    *,
    regrid: bool = False,
    correct_tilt: bool = False,
    progress: bool = True,
) -> tuple[list[Path], np.ndarray, dict]:
    """Reads every study's chosen series and stores it as NIfTI under ``cache_dir/dicom/`` (once: a file is named by
    the hash of the study's path, its files' sizes and times and the reading settings).

    Returns:
        The NIfTI files (index order), one patient group per study (integers: the manifest's ``group``, else the
        study's PatientID, else the study alone; no identifying value kept) and the dataset's report: files dropped
        per reason, voxels set to air, what was resampled, and each study's spacing and orientation (keyed by a hash
        of the study's path).

    Raises:
        DicomError: Every study that cannot be read, each named with its problem (up to 20 listed).
    """
    from ddcnn.data.progress import track

    rule = SeriesRule.of(rule)
    settings = {"format": DICOM_FORMAT, "rule": dataclasses.asdict(rule), "regrid": regrid, "tilt": correct_tilt}
    key = _digest(json.dumps(settings, sort_keys=True))
    folder = Path(cache_dir).expanduser() / "dicom" / key
    paths: list[Path] = []
    group_keys: list[str] = []
    problems: list[str] = []
    dropped: Counter = Counter()
    studies: list[dict] = []
    padded = ignored = 0
    corrected: Counter = Counter()
    for i, study_dir in enumerate(track(list(index.studies), "reading DICOM", "studies", progress)):
        study_key = _digest(str(study_dir.resolve()))
        try:
            study = scan_study(study_dir)
            record_path = folder / f"{study_key}-{_study_files_digest(study_dir)}.json"
            out = record_path.with_suffix(".nii.gz")
            if record_path.is_file() and out.is_file():
                record = json.loads(record_path.read_text())
            else:
                volume = read_series(choose_series(study, rule), study_dir, regrid=regrid, correct_tilt=correct_tilt)
                _write_nifti(to_nifti_image(volume), out)
                record = {
                    "study": study_key,
                    "shape": list(volume.data.shape),
                    "spacing_mm": [round(v, 4) for v in volume.spacing],
                    "orientation": volume.orientation,
                    "padded_voxels": volume.padded,
                    "corrected": list(volume.corrected),
                    "tilt_deg": round(volume.tilt_deg, 3),
                }
                with atomic_open(record_path, fsync=False) as f:
                    f.write(json.dumps(record).encode())
        except DicomError as err:
            problems.append(str(err))
            continue
        dropped.update(study.dropped)
        ignored += study.ignored
        padded += int(record["padded_voxels"] > 0)
        corrected.update(record["corrected"])
        studies.append({**record, "label": index.class_names[index.labels[i]]})
        paths.append(out)
        if index.groups is not None:
            group_keys.append("manifest\0" + index.groups[i])
        else:
            group_keys.append("patient\0" + study.patient if study.patient else "study\0" + study_key)
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise DicomError(f"{len(problems)} of {len(index)} DICOM studies cannot be read:\n  {shown}")
    if dropped:
        log.info("DICOM: dropped %s (not the images of a CT series)",
                 ", ".join(f"{n} {r} file(s)" for r, n in sorted(dropped.items())))  # fmt: skip
    if padded:
        log.info("DICOM: padding (PixelPaddingValue or values below %g HU) set to air (%g HU) in %d of %d studies",
                 AIR_HU, AIR_HU, padded, len(studies))  # fmt: skip
    if corrected:
        log.info(
            "DICOM: resampled onto a regular grid: %s", ", ".join(f"{k} in {n} studies" for k, n in corrected.items())
        )
    groups = np.unique(np.asarray(group_keys), return_inverse=True)[1].astype(np.int64)
    for record, group in zip(studies, groups, strict=True):
        record["group"] = int(group)
    report = {
        "dicom": {
            "studies": len(studies),
            "patient_groups": int(groups.max()) + 1 if len(groups) else 0,
            "groups_from": "manifest" if index.groups is not None else "PatientID",
            "series_rule": rule.describe(),
            "dropped_files": dict(sorted(dropped.items())),
            "ignored_files": ignored,
            "studies_with_padding_to_air": padded,
            "resampled": dict(corrected),
            "per_study": studies,
        }
    }
    return paths, groups, report


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``ddcnn-dicom-to-nifti SERIES_DIR OUT.nii.gz [--description RE] [--kernel RE]
    [--thickness MIN MAX] [--uid UID] [--regrid] [--correct-tilt]``."""
    parser = argparse.ArgumentParser(
        prog="ddcnn-dicom-to-nifti",
        description="Write one DICOM series (of a study folder) as NIfTI with its affine, by ddcnn's series rules: "
        "sorted along the slice normal, Hounsfield units, padding as air, scouts dropped; tilt, gaps and duplicates "
        "refused unless corrected on request.",
    )
    parser.add_argument("series_dir", type=Path, help="a folder holding the series (or a whole study)")
    parser.add_argument("out", type=Path, help="output file, .nii or .nii.gz")
    parser.add_argument("--description", default=None, metavar="RE", help="SeriesDescription pattern")
    parser.add_argument("--kernel", default=None, metavar="RE", help="ConvolutionKernel pattern")
    parser.add_argument("--thickness", type=float, nargs=2, default=None, metavar=("MIN", "MAX"), help="mm")
    parser.add_argument("--uid", default=None, help="SeriesInstanceUID")
    parser.add_argument("--regrid", action="store_true", help="resample uneven slice spacing onto a regular grid")
    parser.add_argument("--correct-tilt", action="store_true", help="undo a gantry tilt (shear)")
    args = parser.parse_args(argv)
    try:
        rule = SeriesRule(args.description, args.kernel, tuple(args.thickness) if args.thickness else None, args.uid)
        volume = series_to_nifti(args.series_dir, args.out, rule, regrid=args.regrid, correct_tilt=args.correct_tilt)
    except (ValueError, OSError, ImportError) as err:
        print(f"ddcnn-dicom-to-nifti: error: {err}", file=sys.stderr)
        return 1
    spacing = " x ".join(f"{v:.4g}" for v in volume.spacing)
    extra = f", resampled: {', '.join(volume.corrected)}" if volume.corrected else ""
    print(f"wrote {args.out}: {' x '.join(str(n) for n in volume.data.shape)} voxels of {spacing} mm, "
          f"{volume.orientation}, HU [{volume.data.min():g}, {volume.data.max():g}]{extra}")  # fmt: skip
    return 0
