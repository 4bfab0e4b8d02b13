"""Compact storage of prepared data, and the one function that turns stored values into network inputs.

Prepared data keep the source's compact type where that loses nothing: ``uint8`` images stay ``uint8`` (divided by 255
when they are read), other integer types (``int16`` CT in Hounsfield units, ``uint16``, ``int8``, booleans as
``uint8``) stay as they are. Values that are not integers (a float source, or images resized by ``data.image_size``)
are kept as ``float32``, or as ``float16`` with ``data.float_storage=float16``: half the memory and
disk, each value rounded to 11 significant bits (a relative error of at most 2^-11 = 4.9e-4; for values in [0, 1],
as after a CT window or a ``uint8`` source's scaling, an absolute error of at most 2^-12 = 2.4e-4, which is 0.34 HU
for the window [-1000, 400]).

:class:`Normalize` is the only place where stored values become the network's inputs: ``uint8 / 255`` (for values
stored raw), the optional intensity window (``data.window``), then ``(x - mean) / std`` with the training split's
per-channel statistics (computed once, in float64). It runs on the training device, per batch
(:mod:`ddcnn.data.datamodule`), and inside the TorchScript export (:mod:`ddcnn.export`), so the two cannot drift
apart. For lossless storage the network sees bitwise the numbers of float32 storage: ``uint8`` values are divided
by 255 on the CPU, and looked up in a table made by that division on other devices (where a division by a constant
may be compiled as a multiplication by its reciprocal), so the result is the same on every device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["FLOAT_STORAGE", "Normalize", "storage_dtype", "uint8_table", "check_window", "check_float_storage"]

# data.float_storage: how values that are not integers are kept (None: float32, exact).
FLOAT_STORAGE = (None, "float32", "float16")


def check_float_storage(value) -> str | None:
    """``data.float_storage``, checked: ``None`` (float32), ``"float32"`` or ``"float16"``."""
    if value not in FLOAT_STORAGE:
        raise ValueError(
            f"data.float_storage must be null (float32, exact), float32 or float16 (half the memory, values rounded to "
            f"11 significant bits), got {value!r}."
        )
    return None if value in (None, "float32") else str(value)


def check_window(window) -> tuple[float, float] | None:
    """``data.window`` as ``(low, high)`` with ``low < high``, or ``None``."""
    if window is None:
        return None
    values = tuple(float(v) for v in window)
    if len(values) != 2 or not values[0] < values[1]:
        raise ValueError(f"data.window must be [low, high] with low < high (e.g. [-1000, 400] for CT), got {window!r}.")
    return values


def storage_dtype(source_dtypes: Sequence[np.dtype], resized: bool, float_storage: str | None) -> tuple[np.dtype, bool]:
    """The type prepared data are kept in, and whether they are ``uint8`` read as ``value / 255``.

    Args:
        source_dtypes: The element types of the source's splits.
        resized: Whether the images are resized (``data.image_size``): the values are then no longer integers.
        float_storage: ``data.float_storage`` (checked).
    """
    kinds = {np.dtype(d) for d in source_dtypes}
    if len(kinds) == 1 and not resized:
        (dtype,) = kinds
        if dtype == np.uint8:
            return np.dtype(np.uint8), True
        if dtype.kind == "b":
            return np.dtype(np.uint8), False
        if dtype in (np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.uint16)):
            return dtype, False
        if dtype == np.float16:  # float16 -> float32 is exact: kept as it is
            return dtype, False
    if any(np.dtype(d).kind not in "biuf" for d in kinds):
        raise ValueError(f"images of type {sorted(str(d) for d in kinds)} cannot be used; convert them to numbers.")
    return np.dtype(np.float16 if float_storage == "float16" else np.float32), False


def uint8_table() -> torch.Tensor:
    """``float32(v) / 255`` for every ``uint8`` value ``v``, by the CPU operation the float32 data path always used."""
    return torch.arange(256, dtype=torch.uint8).to(torch.float32).div_(255.0)


class Normalize(nn.Module):
    """Stored values ``(B, C, *spatial)`` -> network inputs, on the device of the input (scriptable).

    Args:
        mean, std: Per-channel statistics of the training split (after decoding).
        spatial_dims: 2 or 3.
        scale_uint8: Stored values are raw ``uint8``: read them as ``value / 255``.
        window: ``(low, high)``: clip to it and map it to [0, 1] before normalising (``data.window``).
    """

    def __init__(
        self,
        mean: torch.Tensor,
        std: torch.Tensor,
        spatial_dims: int,
        scale_uint8: bool = False,
        window: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        view = [1, -1] + [1] * int(spatial_dims)
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).reshape(view).clone())
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).reshape(view).clone())
        self.register_buffer("table", uint8_table())
        self.scale_uint8 = bool(scale_uint8)
        self.windowed = window is not None
        self.low = float(window[0]) if window is not None else 0.0
        self.high = float(window[1]) if window is not None else 1.0

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Stored values -> the float values that are normalised (``uint8`` scaling, window)."""
        raw = self.scale_uint8 and x.dtype == torch.uint8
        if raw and x.device.type != "cpu":  # there a division by a constant may be a multiplication by its reciprocal
            x = self.table[x.long()]
        else:
            x = x.to(torch.float32)
            if raw:  # the table's own operation, element by element: the same values, faster than a lookup
                x = x.div_(255.0)
        if self.windowed:
            x = (x.clamp(self.low, self.high) - self.low) / (self.high - self.low)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.decode(x) - self.mean) / self.std
