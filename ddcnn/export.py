"""One file per finished run: the CNN-DNN with its preprocessing, as TorchScript, for ``ddcnn-predict``.

Format choice: **TorchScript** (``torch.jit.script``), written with ``torch.jit.save`` to
``RUN_DIR/export/cnn_dnn.pt``. ``torch.jit.load(path)`` needs only torch: no ddcnn, no Hydra configuration,
no Python source of the networks. Scripting (rather than ``torch.export``) keeps the input checks and the
data-dependent steps (scale ``uint8`` or not, resize only when the shape differs) inside the model and
accepts any batch size and input size without declaring dynamic shapes; the CNN-DNN was written to script
(:mod:`ddcnn.models.cnn_dnn`). Recent torch releases mark ``torch.jit`` as deprecated in favour of
``torch.export`` and warn that TorchScript may break on Python 3.14+; it works on the Python 3.10-3.13 and
torch 2.x this package targets, and ``tests/test_export.py`` checks the file on every run. Moving to
``torch.export`` would mean fixing the input dtype at export time and moving the shape checks out of the model.

The scripted module (:class:`ExportedCNNDNN`) takes raw inputs ``(B, C, *spatial)`` and applies exactly what
training applied to the data (:mod:`ddcnn.data.prepare`, :mod:`ddcnn.data.encoding`):

1. ``uint8`` values are divided by 255, any other dtype is used as float32 unchanged;
2. when the run used ``data.image_size``, inputs of another spatial shape are resized to it (bilinear or
   trilinear, ``align_corners=False``, antialiasing when shrinking 2D images); without it, the shape must be
   the training shape;
3. when training stored its values as float16 (``data.float_storage=float16``), they are rounded to float16;
4. the intensity window (``data.window``) and the per-channel normalisation with the training split's mean and std,
   by the module the training batches go through (:class:`ddcnn.data.encoding.Normalize`).

``model(x)`` returns class logits ``(B, K)``; ``model.predict_proba(x)`` returns probabilities;
``model.preprocess(x)`` shows what the networks see. The file's extra file ``metadata.json`` (read with
``torch.jit.load(path, _extra_files={"metadata.json": ""})``) holds the class names, the input channels,
``spatial_dims``, the training image shape, the preprocessing, how files were read in training (image mode
and size of image-folder sources, NIfTI settings of NIfTI sources) and where the model came from.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddcnn.data.encoding import Normalize
from ddcnn.settings import DataSettings, RunSettings

log = logging.getLogger(__name__)

__all__ = [
    "EXPORT_FILE",
    "METADATA_FILE",
    "FORMAT_VERSION",
    "Preprocess",
    "ExportedCNNDNN",
    "export_context",
    "export_run",
    "load_exported",
    "exported_path",
]

EXPORT_DIR = "export"
EXPORT_FILE = "cnn_dnn.pt"
METADATA_FILE = "metadata.json"
FORMAT_VERSION = 1

# NiftiPreprocess fields that a ddcnn.data.sources.nifti source passes on; predict reads NIfTI files the same way.
_NIFTI_KEYS = ("target_shape", "spacing", "window", "normalize", "channel_axis")


@contextlib.contextmanager
def _jit_deprecation_quiet():
    """Recent torch releases (2.14 here) warn that torch.jit is deprecated on every call; see the module docstring.

    Only the plain "is deprecated" notice is silenced: the warning that TorchScript may break on Python 3.14+
    still shows.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=FutureWarning)
        yield


class Preprocess(nn.Module):
    """Raw input ``(B, C, *spatial)`` -> what the networks were trained on (scale, resize, normalise).

    Args:
        image_shape: Spatial shape the networks take (after ``data.image_size``).
        mean, std: Per-channel normalisation statistics of the training split.
        resize: Whether training resized its data (``data.image_size``); if not, other shapes are an error.
        round_float16: Whether training stored its values as float16 (they are rounded the same way).
        window: The intensity window of training (``data.window``), or ``None``.
    """

    def __init__(
        self,
        image_shape: Sequence[int],
        mean: torch.Tensor,
        std: torch.Tensor,
        resize: bool,
        round_float16: bool = False,
        window: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        self.spatial_dims = len(image_shape)
        if self.spatial_dims not in (2, 3):
            raise ValueError(f"Preprocess: image_shape must have 2 or 3 axes, got {tuple(image_shape)}.")
        self.image_shape: list[int] = [int(s) for s in image_shape]
        self.in_channels = int(mean.numel())
        self.resize = bool(resize)
        self.mode = "bilinear" if self.spatial_dims == 2 else "trilinear"
        self.round_float16 = bool(round_float16)
        self.normalize = Normalize(mean.detach(), std.detach(), self.spatial_dims, scale_uint8=False, window=window)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 + self.spatial_dims:
            raise ValueError(
                "expected a batch (B, C, *spatial) with "
                + str(self.spatial_dims)
                + " spatial axes, got shape "
                + str(list(x.shape))
            )
        if x.shape[1] != self.in_channels:
            raise ValueError(
                "expected " + str(self.in_channels) + " channel(s) on axis 1, got shape " + str(list(x.shape))
            )
        # As the preparation of the training data: uint8 is scaled to [0, 1], everything else is taken as it is.
        x = x.to(torch.float32) / 255.0 if x.dtype == torch.uint8 else x.to(torch.float32)
        size: list[int] = list(x.shape[2:])
        if size != self.image_shape:
            if not self.resize:
                raise ValueError(
                    "expected spatial shape "
                    + str(self.image_shape)
                    + " (training did not resize), got "
                    + str(size)
                    + "; resize the input to the training shape"
                )
            # As ddcnn.data.prepare._resize: antialiasing exists for 2D only, used when shrinking.
            shrink = False
            for a in range(self.spatial_dims):
                if self.image_shape[a] < size[a]:
                    shrink = True
            antialias = self.spatial_dims == 2 and shrink
            x = F.interpolate(x, size=self.image_shape, mode=self.mode, align_corners=False, antialias=antialias)
        if self.round_float16:
            x = x.to(torch.float16).to(torch.float32)
        return self.normalize(x)


class ExportedCNNDNN(nn.Module):
    """Preprocessing + CNN-DNN: raw inputs in, class logits out (``predict_proba``: probabilities)."""

    def __init__(self, preprocess: Preprocess, model: nn.Module) -> None:
        super().__init__()
        self.preprocess = preprocess
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(self.preprocess(x))

    @torch.jit.export
    def predict_proba(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x).softmax(dim=-1)


def _file_reading(data: DataSettings) -> dict:
    """How the training source read files, so ``ddcnn-predict`` reads image and NIfTI files the same way."""
    source = data.source or {}
    target = str(source.get("_target_", ""))
    images: dict[str, Any] = {"mode": "L" if int(data.in_channels) == 1 else "RGB", "size": None}
    nifti: dict[str, Any] = {}
    if target.endswith(".image_folder"):
        size = source.get("image_size")
        images["size"] = [size, size] if isinstance(size, int) else size
        # ddcnn.data.images decodes every PIL mode, then brings the image to size as resize_mode says
        images["resize_mode"] = str(source.get("resize_mode") or "stretch")
        images["background"] = int(source.get("background") or 0)
    if target.endswith(".nifti") or target.endswith(".dicom"):
        nifti = {k: source[k] for k in _NIFTI_KEYS if source.get(k) is not None}
    out = {"image_files": images, "nifti": nifti}
    if target.endswith(".dicom"):  # the series rule and corrections of the training, for a study folder
        series = source.get("series")
        if isinstance(series, Mapping):
            series = {
                k: list(v) if isinstance(v, Sequence) and not isinstance(v, str) else v for k, v in series.items()
            }
        out["dicom"] = {
            "series": series,
            "regrid": bool(source.get("regrid")),
            "correct_tilt": bool(source.get("correct_tilt")),
        }
    return out


def _model_name(settings: RunSettings) -> str:
    return str(settings.model.get("name", settings.model.get("_target_", "")))


def _metadata(ctx, model_results: dict | None = None) -> dict:
    import ddcnn
    from ddcnn.context import finished_coarse_input

    settings, data, dec = ctx.settings, ctx.data, ctx.decomposition
    image_size = settings.data.image_size
    return {
        "format": "ddcnn-cnn-dnn-torchscript",
        "format_version": FORMAT_VERSION,
        "class_names": list(data.class_names),
        "num_classes": data.num_classes,
        "in_channels": data.in_channels,
        "spatial_dims": data.spatial_dims,
        "image_shape": list(data.image_shape),
        "input": "a batch (B, C, *spatial) of raw values: uint8 (0..255) or float as in the training data",
        "output": "forward: class logits (B, K); predict_proba: class probabilities (B, K)",
        "preprocessing": {
            "scale": "uint8 / 255; other dtypes as float32 unchanged",
            "resize": None
            if image_size is None
            else {
                "to": list(data.image_shape),
                "mode": "bilinear" if data.spatial_dims == 2 else "trilinear",
                "align_corners": False,
                "antialias": "2D when shrinking",
            },
            "stored_as": "float16" if data.stored_dtype == torch.float16 else None,
            "window": list(data.window) if data.window is not None else None,
            "normalize": {"mean": data.mean.tolist(), "std": data.std.tolist()},
            **_file_reading(settings.data),
        },
        "decomposition": {
            "grid": list(dec.grid),
            "overlap": list(dec.overlap),
            "sub_shape": list(dec.sub_shape),
            "num_subdomains": dec.num_subdomains,
        },
        "coarse_input": finished_coarse_input(ctx),
        "model": _model_name(settings),
        "data": data.name,
        "run_dir": str(Path(ctx.run.root).resolve()),
        "test_accuracy": model_results,
        "ddcnn_version": ddcnn.__version__,
        "torch_version": torch.__version__,
    }


def _script(wrapped: ExportedCNNDNN, model: nn.Module, ctx) -> torch.jit.ScriptModule:
    """Script the CNN-DNN with its preprocessing.

    Every network of ddcnn, timm, torchvision and MONAI tried scripts (tests/test_export.py); a local net that does not
    (Python TorchScript cannot compile) is traced instead: the CNN-DNN hands each local net crops of one fixed shape,
    the sub-domain's, so a trace at that shape is the same function for every input it will get. The rest (input
    checks, resizing, the coarse DNN) stays scripted.
    """
    try:
        with _jit_deprecation_quiet():
            return torch.jit.script(wrapped)
    except Exception as err:  # TorchScript's errors have no common base class
        reason = " ".join(str(err).split())[:300]
    example = torch.zeros(2, ctx.data.in_channels, *ctx.decomposition.sub_shape)
    try:
        with _jit_deprecation_quiet(), torch.no_grad():
            model.local_nets = nn.ModuleList(torch.jit.trace(net.eval(), example) for net in model.local_nets)
            scripted = torch.jit.script(wrapped)
    except Exception as err:
        raise ValueError(
            f"cannot export the CNN-DNN of {ctx.run.root} as TorchScript: its model "
            f"({_model_name(ctx.settings)}) neither scripts ({reason}) nor traces at "
            f"the sub-domain shape ({' '.join(str(err).split())[:300]}). The run's results are complete without it; "
            f"report.export=false skips the export."
        ) from err
    log.info(
        "export: the local nets do not script (%s); traced at their sub-domain shape %s, the only shape they receive",
        reason,
        list(ctx.decomposition.sub_shape),
    )
    return scripted


def exported_path(run_dir: str | Path) -> Path:
    """Where a run's exported model lives: ``RUN_DIR/export/cnn_dnn.pt``."""
    return Path(run_dir) / EXPORT_DIR / EXPORT_FILE


def export_context(ctx, path: str | Path | None = None) -> Path:
    """Script the CNN-DNN of a finished run (local nets + coarse DNN) with its preprocessing and save it.

    Args:
        ctx: The run's :class:`~ddcnn.context.Context` (configuration, data, decomposition).
        path: Output file; default ``RUN_DIR/export/cnn_dnn.pt``.

    Returns:
        The written file.

    Raises:
        FileNotFoundError: The local or coarse stage has not finished.
    """
    from ddcnn.context import assemble_cnn_dnn
    from ddcnn.io import atomic_write_bytes

    model = assemble_cnn_dnn(ctx)
    data = ctx.data
    pre = Preprocess(
        data.image_shape,
        data.mean,
        data.std,
        resize=ctx.settings.data.image_size is not None,
        round_float16=data.stored_dtype == torch.float16,
        window=data.window,
    )
    wrapped = ExportedCNNDNN(pre, model).eval()
    scripted = _script(wrapped, model, ctx)
    meta = _metadata(ctx, ctx.run.meta("coarse").get("accuracy", {}).get("test"))  # assembled: coarse has finished
    buffer = io.BytesIO()
    with _jit_deprecation_quiet():
        torch.jit.save(scripted, buffer, _extra_files={METADATA_FILE: json.dumps(meta, indent=2)})
    out = Path(path) if path is not None else exported_path(ctx.run.root)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, buffer.getvalue())
    log.info("export: CNN-DNN with preprocessing as TorchScript in %s", out)
    return out


def export_run(run_dir: str | Path, path: str | Path | None = None) -> Path:
    """Export a finished run directory (reads its ``config.yaml``; loads the data for the normalisation).

    Raises:
        FileNotFoundError: ``run_dir`` holds no ``config.yaml`` or its local/coarse stages have not finished.
    """
    from ddcnn.context import open_context
    from ddcnn.rundir import RunDir

    root = Path(run_dir)
    config = root / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(
            f"{root} is not a ddcnn run directory (no config.yaml); pass the directory ddcnn-train wrote "
            f"(hydra.run.dir)."
        )
    # The networks come from the run's net.pt files: a pretrained weights file it started from is not needed.
    ctx = open_context(RunSettings.from_config(RunDir(root).recorded_config()), root, weights=False)
    return export_context(ctx, path)


def load_exported(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[torch.jit.ScriptModule, dict]:
    """Load an exported model and its metadata (needs only torch; shown here for ``ddcnn-predict``).

    Returns:
        ``(model in eval mode, metadata dict)``.

    Raises:
        ValueError: The file is not a model exported by ddcnn.
    """
    path = Path(path)
    extra = {METADATA_FILE: ""}
    try:
        with _jit_deprecation_quiet():
            model = torch.jit.load(str(path), map_location=map_location, _extra_files=extra)
    except (RuntimeError, ValueError) as err:
        raise ValueError(
            f"{path} is not a TorchScript file ({' '.join(str(err).split())[:200]}); pass a model written by "
            f"ddcnn-export (RUN_DIR/export/{EXPORT_FILE}) or a run directory."
        ) from err
    raw = extra[METADATA_FILE]
    if not raw:
        raise ValueError(
            f"{path} is a TorchScript file without ddcnn metadata ({METADATA_FILE}); export it with "
            f"ddcnn-export RUN_DIR."
        )
    meta = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return model.eval(), meta
