"""Augmentation of whole images/volumes, applied before the decomposition.

The random parameters of sample ``j`` in epoch ``e`` depend only on ``(seed, e, j)``: every local net,
trained independently in its own process, sees the same augmented version of a sample, so the local views
stay consistent with each other (and with the global net when it uses the same seed).

They come from a counter-based generator (:func:`uniforms`, :data:`RNG_VERSION`): a SplitMix64 hash of
``(seed, epoch, sample, draw)`` computed with torch's int64 operations, vectorised over a batch on the device its
sample indices live on, with no generator state and no host round-trip. Integer arithmetic is exact on every device,
so the draws are bitwise the same on CPU and CUDA, for data held on the device and for streamed batches.

A local net needs only its box of the augmented image: :meth:`Augment.support` gives the region of the image that
box depends on (the box itself for flips, read mirrored for a flipped sample; a slightly larger box for a small
rotation), and :meth:`Augment.rotate_box` computes the box from that region alone, with the whole image's sampling
coordinates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ddcnn.rundir import AUGMENT_RNG

__all__ = ["Augment", "RNG_VERSION", "uniforms"]

# The generator of the augmentation's draws. A change of the draws changes augmented results, so it enters augmented
# runs' fingerprints (ddcnn.rundir.result_settings: data.augment.rng); unaugmented runs do not depend on it.
RNG_VERSION = AUGMENT_RNG
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / golden ratio)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix_int(z: int) -> int:
    """SplitMix64's finaliser of a Python int (mod 2^64)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (multiplication wraps mod 2^64 on every device)."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def uniforms(seed: int, epoch: int, index: torch.Tensor, n: int) -> torch.Tensor:
    """``(B, n)`` float32 numbers in [0, 1) (24 random bits each: exact in float32), fixed by ``(seed, epoch, sample
    index, draw)``, on ``index``'s device."""
    key = _mix_int(_mix_int(int(seed) + _GOLDEN) + int(epoch) * _GOLDEN)
    index = torch.as_tensor(index, dtype=torch.long)
    z = _mix(index.view(-1, 1) * _signed(_GOLDEN) + _signed(key))
    draws = torch.arange(1, n + 1, dtype=torch.long, device=index.device) * _signed(_GOLDEN)
    z = _mix(z + draws)
    return _shr(z, 40).to(torch.float32) * (2.0**-24)


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

    def check(self, spatial_dims: int) -> None:
        """Raise a clear error for flip axes that images of ``spatial_dims`` axes do not have."""
        if any(not 0 <= a < spatial_dims for a in self.flip_axes):
            raise ValueError(f"augment.flip_axes {self.flip_axes} must be spatial axes 0..{spatial_dims - 1}.")

    def draw(self, index: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The random parameters of samples ``index`` in ``epoch``, on ``index``'s device: ``flips (B,
        len(flip_axes))`` (bool) and rotation ``angles (B,)`` in radians (zero without rotation)."""
        u = uniforms(self.seed, epoch, index, len(self.flip_axes) + 1)
        flips = u[:, : len(self.flip_axes)] < 0.5
        angles = (
            (u[:, -1] * 2 - 1) * math.radians(self.rotate_deg) if self.rotate_deg > 0 else torch.zeros_like(u[:, 0])
        )
        return flips, angles

    def __call__(self, x: torch.Tensor, index: torch.Tensor, epoch: int) -> torch.Tensor:
        self.check(x.dim() - 2)
        flips, angle = self.draw(index, epoch)
        out = x
        for k, axis in enumerate(self.flip_axes):
            flip = flips[:, k].to(x.device, non_blocking=True).view(-1, *([1] * (x.dim() - 1)))
            out = torch.where(flip, out.flip(2 + axis), out)
        if self.rotate_deg > 0:
            out = _rotate_last_two_axes(out, angle)
        return out

    def rotate(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Every sample of ``x`` rotated by its angle in the plane of the last two axes (bilinear, zero padding)."""
        return _rotate_last_two_axes(x, angles)

    # --- the augmented view of one box, from the region of the image it depends on -------------------------------
    def support(self, box: Sequence[slice], image_shape: Sequence[int]) -> tuple[slice, ...]:
        """The region of the (flipped) image that the rotated image's ``box`` is computed from: ``box`` itself
        without rotation; with it, ``box`` grown in the plane of the last two axes by what any angle up to
        ``rotate_deg`` brings in (bilinear neighbours included), clipped to the image."""
        box = tuple(slice(*b.indices(n)[:2]) for b, n in zip(box, image_shape, strict=True))
        if self.rotate_deg <= 0:
            return box
        h, w = int(image_shape[-2]), int(image_shape[-1])
        ys = torch.tensor([box[-2].start, box[-2].stop - 1], dtype=torch.float64)
        xs = torch.tensor([box[-1].start, box[-1].stop - 1], dtype=torch.float64)
        limit = math.radians(self.rotate_deg)
        angles = torch.linspace(-limit, limit, 721, dtype=torch.float64)
        ix, iy = _source_pixels(ys[:, None, None], xs[None, :, None], angles[None, None, :], h, w)
        y0 = max(0, math.floor(float(iy.min())) - 1)
        y1 = min(h, math.floor(float(iy.max())) + 3)
        x0 = max(0, math.floor(float(ix.min())) - 1)
        x1 = min(w, math.floor(float(ix.max())) + 3)
        return (*box[:-2], slice(y0, y1), slice(x0, x1))

    def rotate_box(
        self,
        region_x: torch.Tensor,
        angles: torch.Tensor,
        region: Sequence[slice],
        box: Sequence[slice],
        image_shape: Sequence[int],
    ) -> torch.Tensor:
        """``box`` of the rotated image, from ``region_x``: the normalised (and flipped) image's ``region``.

        Equal to rotating the whole image and cutting ``box`` out of it, up to float rounding: the sampling
        coordinates are the whole image's, moved to the region (flips alone are exact).
        """
        h, w = int(image_shape[-2]), int(image_shape[-1])
        dev = region_x.device  # the sampling grid is computed there, whichever device the angles were drawn on
        ys = torch.arange(box[-2].start, box[-2].stop, dtype=torch.float64, device=dev)
        xs = torch.arange(box[-1].start, box[-1].stop, dtype=torch.float64, device=dev)
        a = angles.to(device=dev, dtype=torch.float64, non_blocking=True).view(-1, 1, 1)
        ix, iy = _source_pixels(ys.view(1, -1, 1), xs.view(1, 1, -1), a, h, w)  # (B, bh, bw) pixels of the image
        rh, rw = region[-2].stop - region[-2].start, region[-1].stop - region[-1].start
        gx = (2 * (ix - region[-1].start) + 1) / rw - 1  # the same points in the region's normalised coordinates
        gy = (2 * (iy - region[-2].start) + 1) / rh - 1
        if region_x.dim() == 4:
            grid = torch.stack([gx, gy], dim=-1)
        else:  # 3D: the first axis is not rotated; the region spans exactly the box's slices along it
            depth = region[0].stop - region[0].start
            gz = (2 * torch.arange(depth, dtype=torch.float64, device=dev) + 1) / depth - 1
            b, bh, bw = gx.shape
            grid = torch.stack(
                [
                    gx[:, None].expand(b, depth, bh, bw),
                    gy[:, None].expand(b, depth, bh, bw),
                    gz.view(1, -1, 1, 1).expand(b, depth, bh, bw),
                ],
                dim=-1,
            )
        grid = grid.to(device=dev, dtype=region_x.dtype)
        return F.grid_sample(region_x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _source_pixels(
    ys: torch.Tensor, xs: torch.Tensor, angle: torch.Tensor, h: int, w: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel coordinates ``(ix, iy)`` in the image that output pixel ``(ys, xs)`` of the rotation by ``angle`` samples
    (the arithmetic of ``affine_grid`` + ``grid_sample`` with ``align_corners=False``; broadcasting)."""
    xn, yn = (2 * xs + 1) / w - 1, (2 * ys + 1) / h - 1
    cos, sin = angle.cos(), angle.sin()
    gx, gy = cos * xn - sin * yn, sin * xn + cos * yn
    return ((gx + 1) * w - 1) / 2, ((gy + 1) * h - 1) / 2


def _rotate_last_two_axes(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate every sample by its angle in the plane of the last two axes (bilinear, zero padding)."""
    b, spatial = x.shape[0], x.dim() - 2
    angle = angle.to(device=x.device, dtype=x.dtype)
    cos, sin = angle.cos(), angle.sin()
    theta = torch.zeros(b, spatial, spatial + 1, dtype=x.dtype, device=x.device)
    for i in range(spatial):
        theta[:, i, i] = 1.0
    # affine_grid's coordinates are (x=last axis, y=second last, z=...); rotate x and y.
    theta[:, 0, 0], theta[:, 0, 1], theta[:, 1, 0], theta[:, 1, 1] = cos, -sin, sin, cos
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
