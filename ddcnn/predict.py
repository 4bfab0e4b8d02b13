"""``ddcnn-predict`` and ``ddcnn-export``: apply a run's exported CNN-DNN to image, ``.npy`` and NIfTI files and DICOM
study folders.

Files are read the way training read its data: image files with PIL in the training's mode (grayscale ``L``
for one channel, ``RGB`` for three, as the image-folder source does), ``.npy`` arrays as they are (``uint8``
is scaled by 1/255 like training data, floats are used unchanged), NIfTI volumes with
:func:`ddcnn.data.nifti.load_volume` and the training source's NIfTI settings, a DICOM study folder by the training's
series rule and corrections (:mod:`ddcnn.data.dicom`), then as a NIfTI volume. The exported model
(:mod:`ddcnn.export`) then resizes and normalises. Predicting needs torch, PIL and nibabel; not the training
stack (Lightning, Hydra), unless a run directory has no exported model yet.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddcnn.export import exported_path, load_exported

__all__ = ["InputError", "Prediction", "read_input", "predict_files", "predict_main", "export_main"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".pgm", ".ppm", ".webp")


class InputError(ValueError):
    """An input file the model cannot take; the message names the file, what was expected and how to fix it."""


@dataclass
class Prediction:
    """The prediction of one input (one file, or one item of a batch in a ``.npy`` file)."""

    name: str
    index: int
    class_name: str
    probabilities: list[float]


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".nii") or name.endswith(".nii.gz"):
        return "nifti"
    if name.endswith(".npy"):
        return "npy"
    if name.endswith(IMAGE_SUFFIXES):
        return "image"
    raise InputError(
        f"{path}: unknown file type; ddcnn-predict reads images ({', '.join(IMAGE_SUFFIXES)}), .npy arrays and "
        f"NIfTI volumes (.nii, .nii.gz)."
    )


def _expected(meta: dict) -> str:
    c, dims, shape = meta["in_channels"], meta["spatial_dims"], meta["image_shape"]
    axes = "H, W" if dims == 2 else "D, H, W"
    alternative = f" or ({axes})" if c == 1 else ""
    kind = "images" if dims == 2 else "volumes"
    return f"the model takes {dims}D {kind} of shape ({c}, {axes}){alternative}, trained on {tuple(shape)}"


def _read_image(path: Path, meta: dict) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    reading = meta["preprocessing"].get("image_files", {})
    c = meta["in_channels"]
    if meta["spatial_dims"] != 2:
        raise InputError(
            f"{path}: an image file is 2D but {_expected(meta)}. Pass the volume as .nii/.nii.gz or .npy instead."
        )
    if c not in (1, 3):
        raise InputError(
            f"{path}: image files give 1 (grayscale) or 3 (RGB) channels but the model expects {c}. Save the input "
            f"as a .npy array of shape ({c}, H, W)."
        )
    if "resize_mode" in reading:  # read as the image-folder source read the training images
        from ddcnn.data.images import read_image

        try:
            return read_image(path, c, reading.get("size"), reading["resize_mode"], int(reading.get("background", 0)))
        except (OSError, ValueError, UnidentifiedImageError) as err:
            raise InputError(f"{path}: cannot be read as an image ({err}); check the file.") from err
    try:  # a model exported before the image-folder source decoded every mode (or trained on other data)
        with Image.open(path) as im:
            im = im.convert(reading.get("mode") or ("L" if c == 1 else "RGB"))
            size = reading.get("size")
            if size:  # the image-folder source resized with PIL when it read the training images
                im = im.resize((int(size[1]), int(size[0])), Image.BILINEAR)
            array = np.asarray(im, dtype=np.uint8)
    except (OSError, UnidentifiedImageError) as err:
        raise InputError(f"{path}: cannot be read as an image ({err}); check the file.") from err
    return array[None] if array.ndim == 2 else np.moveaxis(array, -1, 0)


def _read_nifti(path: Path, meta: dict) -> np.ndarray:
    from ddcnn.data.nifti import NiftiPreprocess, load_volume

    if meta["spatial_dims"] != 3:
        raise InputError(
            f"{path}: a NIfTI file holds a 3D volume but {_expected(meta)}. Pass an image file or a .npy array."
        )
    settings = dict(meta["preprocessing"].get("nifti") or {})
    return load_volume(path, NiftiPreprocess(**settings))


def _read_dicom_study(path: Path, meta: dict) -> np.ndarray:
    """A study folder's series, chosen and read as the training's ``data=dicom`` source did, then preprocessed as its
    NIfTI volumes were."""
    import tempfile

    from ddcnn.data.dicom import choose_series, read_series, scan_study, to_nifti_image

    if meta["spatial_dims"] != 3:
        raise InputError(f"{path}: a DICOM study is a 3D volume but {_expected(meta)}.")
    reading = meta["preprocessing"].get("dicom") or {}
    study = scan_study(path)
    series = choose_series(study, reading.get("series"))
    volume = read_series(
        series, study.folder, regrid=bool(reading.get("regrid")), correct_tilt=bool(reading.get("correct_tilt"))
    )
    with tempfile.TemporaryDirectory(prefix="ddcnn-predict-") as tmp:
        file = Path(tmp) / "study.nii"
        to_nifti_image(volume).to_filename(file)
        return _read_nifti(file, meta)


def _read_npy(path: Path, meta: dict) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: cannot be read as a .npy array ({err}); save it with numpy.save.") from err
    if array.dtype.kind not in "uif" and array.dtype != np.bool_:
        raise InputError(f"{path}: holds {array.dtype} values; save a numeric array (uint8 or float).")
    return array


def _as_batch(array: np.ndarray, path: Path, meta: dict) -> np.ndarray:
    """One sample ``(C, *spatial)`` / ``(*spatial)`` or a batch ``(B, C, *spatial)`` -> ``(B, C, *spatial)``."""
    dims, c = meta["spatial_dims"], meta["in_channels"]
    if array.ndim == dims and c == 1:
        batch = array[None, None]
    elif array.ndim == dims + 1:
        batch = array[None]
        # Channel-last colour images are a common layout; ddcnn's sources move the channels first as well.
        if dims == 2 and batch.shape[1] != c and array.shape[-1] == c:
            batch = np.moveaxis(array, -1, 0)[None]
    elif array.ndim == dims + 2:
        batch = array
    else:
        raise InputError(
            f"{path}: array of shape {array.shape} has {array.ndim} axes but {_expected(meta)}, or a batch of "
            f"them (B, {c}, ...). Reshape the array to one of these layouts."
        )
    if batch.shape[1] != c:
        batch_hint = " A batch of single-channel inputs needs shape (B, 1, ...)." if c == 1 else ""
        raise InputError(
            f"{path}: input of shape {array.shape} has {batch.shape[1]} channel(s) on the channel axis but the model "
            f"expects {c} ({_expected(meta)}). Convert the input to {c} channel(s).{batch_hint}"
        )
    shape = list(batch.shape[2:])
    if shape != list(meta["image_shape"]) and meta["preprocessing"].get("resize") is None:
        raise InputError(
            f"{path}: spatial shape {tuple(shape)} differs from the training shape {tuple(meta['image_shape'])}, and "
            f"the training data were not resized (data.image_size unset), so the model cannot resize it the same "
            f"way. Resize or crop the input to {tuple(meta['image_shape'])}."
        )
    if min(shape) < 1:
        raise InputError(f"{path}: empty input of shape {array.shape}.")
    return np.require(batch, requirements=("C_CONTIGUOUS", "WRITEABLE"))  # torch wants writable memory


def read_input(path: str | Path, meta: dict) -> np.ndarray:
    """A file as a raw batch ``(B, C, *spatial)`` for the exported model (see the module docstring).

    Raises:
        InputError: Unknown type, unreadable file, wrong number of axes or channels, or a shape the model
            cannot resize to what it was trained on.
    """
    path = Path(path)
    if path.is_dir():  # a DICOM study folder
        try:
            return _as_batch(_read_dicom_study(path, meta), path, meta)
        except InputError:
            raise
        except ValueError as err:  # DicomError and NiftiError say what is wrong already
            raise InputError(str(err)) from err
    if not path.is_file():
        raise InputError(f"{path}: no such file or study folder.")
    kind = _kind(path)
    if kind == "image":
        array = _read_image(path, meta)
    elif kind == "nifti":
        try:
            array = _read_nifti(path, meta)
        except InputError:
            raise
        except ValueError as err:  # NiftiError says what is wrong with the file already
            raise InputError(str(err)) from err
    else:
        array = _read_npy(path, meta)
    return _as_batch(array, path, meta)


@torch.inference_mode()
def predict_files(model, meta: dict, paths: Sequence[str | Path]) -> list[Prediction]:
    """Class and probabilities of every input in ``paths`` (a ``.npy`` batch gives one entry per item).

    Raises:
        InputError: For the first file that cannot be used.
    """
    out = []
    names = meta["class_names"]
    for path in paths:
        batch = read_input(path, meta)
        probs = model.predict_proba(torch.from_numpy(batch)).double()
        for j, p in enumerate(probs):
            k = int(p.argmax())
            name = str(path) if len(probs) == 1 else f"{path}[{j}]"
            out.append(Prediction(name, k, names[k], [float(v) for v in p]))
    return out


def _load(target: Path):
    """A model file, or a run directory's exported model (exported now when it has none yet)."""
    if target.is_dir():
        path = exported_path(target)
        if not path.is_file():
            from ddcnn.export import export_run

            print(f"ddcnn-predict: {target} has no exported model yet; exporting it to {path}", file=sys.stderr)
            export_run(target)
        return load_exported(path)
    if not target.is_file():
        raise FileNotFoundError(f"{target}: no such run directory or model file.")
    return load_exported(target)


def _format(pred: Prediction, class_names: Sequence[str], top: int | None) -> str:
    order = sorted(range(len(pred.probabilities)), key=lambda k: -pred.probabilities[k])
    if top is None:
        order = range(len(pred.probabilities)) if len(pred.probabilities) <= 10 else order[:5]
    else:
        order = order[:top]
    probs = "  ".join(f"{class_names[k]}: {pred.probabilities[k]:.4f}" for k in order)
    return f"{pred.name}\t{pred.class_name}\t(p={pred.probabilities[pred.index]:.4f})\t{probs}"


def predict_main(argv: Sequence[str] | None = None) -> int:
    """``ddcnn-predict RUN_DIR_OR_MODEL FILES...``: print the class and probabilities of every input."""
    parser = argparse.ArgumentParser(
        prog="ddcnn-predict",
        description="Classify image files (PNG, JPG, ...), .npy arrays, NIfTI volumes (.nii, .nii.gz) and DICOM "
        "study folders with the CNN-DNN of a finished run, preprocessed as in training. Prints: file, class, its "
        "probability, class probabilities.",
    )
    parser.add_argument("model", type=Path, help="a run directory or an exported model file (export/cnn_dnn.pt)")
    parser.add_argument("files", type=Path, nargs="+", help="inputs to classify (files, or DICOM study folders)")
    parser.add_argument("--top", type=int, default=None, help="show the K most likely classes (default: all <= 10)")
    parser.add_argument("--json", action="store_true", help="one JSON object per input instead of text")
    args = parser.parse_args(argv)
    try:
        model, meta = _load(args.model)
    except (ValueError, OSError) as err:
        print(f"ddcnn-predict: error: {err}", file=sys.stderr)
        return 2
    failed = 0
    for path in args.files:
        try:
            predictions = predict_files(model, meta, [path])
        except (InputError, OSError) as err:
            print(f"ddcnn-predict: error: {err}", file=sys.stderr)
            failed += 1
            continue
        for pred in predictions:
            if args.json:
                probs = dict(zip(meta["class_names"], pred.probabilities, strict=True))
                print(
                    json.dumps(
                        {"file": pred.name, "class": pred.class_name, "index": pred.index, "probabilities": probs}
                    )
                )
            else:
                print(_format(pred, meta["class_names"], args.top))
    return 2 if failed else 0


def export_main(argv: Sequence[str] | None = None) -> int:
    """``ddcnn-export RUN_DIR [--out FILE]``: write the run's CNN-DNN with its preprocessing as TorchScript."""
    parser = argparse.ArgumentParser(
        prog="ddcnn-export",
        description="Export the CNN-DNN of a finished run (local nets + coarse DNN + preprocessing) as one "
        "TorchScript file that torch.jit.load reads without ddcnn.",
    )
    parser.add_argument("run_dir", type=Path, help="a run directory whose local and coarse stages finished")
    parser.add_argument("--out", type=Path, default=None, help="output file (default RUN_DIR/export/cnn_dnn.pt)")
    args = parser.parse_args(argv)
    from ddcnn.export import export_run

    try:
        path = export_run(args.run_dir, args.out)
    except (ValueError, OSError) as err:
        print(f"ddcnn-export: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def predict_cli() -> None:
    """Console script ``ddcnn-predict``."""
    sys.exit(predict_main())


def export_cli() -> None:
    """Console script ``ddcnn-export``."""
    sys.exit(export_main())
