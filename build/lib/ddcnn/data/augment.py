"""Augmentation of whole images/volumes, applied before the decomposition.

The random parameters of sample ``j`` in epoch ``e`` depend only on ``(seed, e, j)``: every local net,
trained independently in its own process, sees the same augmented version of a sample, so the local views
stay consistent with each other (and with the global net when it uses the same seed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["Augment"]


class Augment:
    """Random flips along chosen spatial axes and a small rotation, per sample.

    Args:
        flip_axes: Spatial axes (0-based, after batch and channel) that may be flipped, each with probability 1/2.
        rotate_deg: Maximum absolute rotation angle in degrees, drawn uniformly; 2D: in the image plane;
            3D: about the first axis (in the plane of the last two axes, i.e. within a slice).
        seed: Seed of the per-sample parameters.
    """

    def __init__(self, flip_axes: Sequence[int] = (), rotate_deg: float = 0.0, seed: int = 0) -> None:
        self.flip_axes = tuple(int(a) for a in flip_axes)
        self.rotate_deg = float(rotate_deg)
        self.seed = int(seed)
        if self.rotate_deg < 0 or self.rotate_deg > 45:
            raise ValueError(f"augment.rotate_deg must be between 0 and 45 degrees, got {rotate_deg}.")

    @property
    def active(self) -> bool:
        return bool(self.flip_axes) or self.rotate_deg > 0

    def _params(self, index: torch.Tensor, epoch: int, n: int) -> torch.Tensor:
        """``(B, n)`` uniform numbers in [0, 1) fixed by ``(seed, epoch, sample index)``."""
        out = torch.empty(len(index), n)
        for row, j in enumerate(index.tolist()):
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 10_000_019 + int(j))
            out[row] = torch.rand(n, generator=g)
        return out

    def __call__(self, x: torch.Tensor, index: torch.Tensor, epoch: int) -> torch.Tensor:
        spatial = x.dim() - 2
        if any(not 0 <= a < spatial for a in self.flip_axes):
            raise ValueError(f"augment.flip_axes {self.flip_axes} must be spatial axes 0..{spatial - 1}.")
        u = self._params(index, epoch, len(self.flip_axes) + 1)
        out = x
        for k, axis in enumerate(self.flip_axes):
            flip = (u[:, k] < 0.5).view(-1, *([1] * (x.dim() - 1)))
            out = torch.where(flip, out.flip(2 + axis), out)
        if self.rotate_deg > 0:
            angle = (u[:, -1] * 2 - 1) * math.radians(self.rotate_deg)
            out = _rotate_last_two_axes(out, angle)
        return out


def _rotate_last_two_axes(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate every sample by its angle in the plane of the last two axes (bilinear, zero padding)."""
    b, spatial = x.shape[0], x.dim() - 2
    cos, sin = angle.cos(), angle.sin()
    theta = torch.zeros(b, spatial, spatial + 1, dtype=x.dtype)
    for i in range(spatial):
        theta[:, i, i] = 1.0
    # affine_grid's coordinates are (x=last axis, y=second last, z=...); rotate x and y.
    theta[:, 0, 0], theta[:, 0, 1], theta[:, 1, 0], theta[:, 1, 1] = cos, -sin, sin, cos
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
