"""Overlapping decomposition of an image or volume into a grid of equally shaped sub-domains.

This is the spatial side of the CNN-DNN of Klawonn, Lanser and Weber (SIAM J. Sci. Comput. 46(5), 2024;
arXiv 2302.06564): the input domain is cut into ``N = prod(grid)`` sub-domains, each of which is the
input of its own local CNN.

Layout (used everywhere in ddcnn: file names, plots, reports):
    Sub-domain index ``i`` runs **row-major** over the grid, last axis fastest. In 2D with
    ``grid=(2, 2)`` on an image of shape ``(H, W)``::

        i=0: top-left     i=1: top-right
        i=2: bottom-left  i=3: bottom-right

    In 3D with ``grid=(gd, gh, gw)`` on a volume ``(D, H, W)``, ``i = (a * gh + b) * gw + c`` for the
    grid position ``(a, b, c)``. ``Decomposition.position(i)`` and ``Decomposition.index(pos)`` convert.

Geometry along one axis of length ``L`` cut into ``g`` parts with overlap ``delta``:
    every part has the same length ``s = ceil((L + (g - 1) * delta) / g)`` and the start of part ``k``
    is ``round(k * (L - s) / (g - 1))`` (0 for ``g == 1``). The first part starts at 0, the last one
    ends at ``L``, so the parts cover the axis, and the gap between consecutive starts is at most
    ``s - delta``, so neighbours share at least ``delta`` pixels (slightly more where the lengths do
    not divide evenly; ``Decomposition.overlaps`` reports the exact values).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Decomposition"]


def _as_int_tuple(value: int | Sequence[int], length: int, name: str) -> tuple[int, ...]:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer or a sequence of {length} integers, got {value!r}.")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{name} must hold whole numbers, got {value!r}.")
        value = int(value)
    if isinstance(value, int):
        return (value,) * length
    try:
        values = tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer or a sequence of {length} integers, got {value!r}.") from None
    if len(values) == 1:
        values = values * length
    if len(values) != length:
        raise ValueError(
            f"{name} has {len(values)} entries {values} but the grid has {length} axes; "
            f"give one value for all axes or exactly {length} values."
        )
    out = []
    for v in values:
        if isinstance(v, bool) or not float(v).is_integer():
            raise ValueError(f"{name} must hold whole numbers, got {values}.")
        out.append(int(v))
    return tuple(out)


@dataclass(frozen=True)
class Decomposition:
    """A grid of ``N`` overlapping, equally shaped sub-domains of a fixed image or volume shape.

    Args:
        grid: Number of sub-domains along each spatial axis, e.g. ``(2, 2)``, ``(4, 4)``, ``(2, 2, 2)``.
        image_shape: Spatial shape of the full input, ``(H, W)`` or ``(D, H, W)``.
        overlap: Minimum number of pixels/voxels that neighbouring sub-domains share, one value for all
            axes or one per axis (anisotropic overlap for thick CT slices).

    Raises:
        ValueError: For impossible requests, with a message that says what would work.
    """

    grid: tuple[int, ...]
    image_shape: tuple[int, ...]
    overlap: tuple[int, ...] | int = 0
    sub_shape: tuple[int, ...] = field(init=False)
    starts: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.grid, int) or not hasattr(self.grid, "__len__"):
            raise ValueError(f"grid must list the sub-domains per axis, e.g. (2, 2) or (2, 2, 2); got {self.grid!r}.")
        grid = _as_int_tuple(self.grid, len(self.grid), "grid")
        ndim = len(grid)
        if ndim not in (1, 2, 3):
            raise ValueError(f"grid {grid} has {ndim} axes; ddcnn decomposes 2D images (2 axes) or 3D volumes (3).")
        shape = _as_int_tuple(self.image_shape, len(tuple(self.image_shape)), "image_shape")
        if len(shape) != ndim:
            raise ValueError(
                f"grid {grid} has {ndim} axes but the image shape {shape} has {len(shape)}: give a grid with one "
                f"entry per spatial axis of the data, e.g. {(2,) * len(shape)}."
            )
        overlap = _as_int_tuple(self.overlap, ndim, "overlap")
        if any(g < 1 for g in grid):
            raise ValueError(f"grid {grid} must have at least one sub-domain per axis (all entries >= 1).")
        if any(n < 1 for n in shape):
            raise ValueError(f"image_shape {shape} must be positive along every axis.")
        if any(d < 0 for d in overlap):
            raise ValueError(f"overlap {overlap} must be >= 0 along every axis.")
        sub, starts_per_axis = [], []
        for axis, (g, n, d) in enumerate(zip(grid, shape, overlap, strict=True)):
            if g > n:
                raise ValueError(
                    f"grid {grid} asks for {g} sub-domains along axis {axis} but the image has only {n} pixels "
                    f"there; use at most {n} sub-domains on that axis or resize the data to at least {g} pixels."
                )
            if g == 1:
                sub.append(n)
                starts_per_axis.append((0,))
                continue
            s = math.ceil((n + (g - 1) * d) / g)
            if s > n:
                max_overlap = (g * n - n) // (g - 1)
                raise ValueError(
                    f"overlap {d} on axis {axis} with {g} sub-domains makes each sub-domain {s} pixels long, "
                    f"more than the image's {n}; use an overlap of at most {max_overlap} on that axis "
                    f"(or fewer sub-domains)."
                )
            starts_per_axis.append(tuple(round(k * (n - s) / (g - 1)) for k in range(g)))
            sub.append(s)
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "image_shape", shape)
        object.__setattr__(self, "overlap", overlap)
        object.__setattr__(self, "sub_shape", tuple(sub))
        object.__setattr__(self, "starts", tuple(starts_per_axis))

    # --- layout -------------------------------------------------------------------------------
    @property
    def spatial_dims(self) -> int:
        return len(self.grid)

    @property
    def num_subdomains(self) -> int:
        return math.prod(self.grid)

    def __len__(self) -> int:
        return self.num_subdomains

    def position(self, index: int) -> tuple[int, ...]:
        """Grid position of sub-domain ``index`` (row-major, last axis fastest)."""
        if not 0 <= index < self.num_subdomains:
            raise ValueError(f"sub-domain index {index} is outside 0..{self.num_subdomains - 1} for grid {self.grid}.")
        pos = []
        for g in reversed(self.grid):
            pos.append(index % g)
            index //= g
        return tuple(reversed(pos))

    def index(self, position: Sequence[int]) -> int:
        """Sub-domain index of a grid position; inverse of :meth:`position`."""
        idx = 0
        for p, g in zip(position, self.grid, strict=True):
            if not 0 <= p < g:
                raise ValueError(f"grid position {tuple(position)} is outside grid {self.grid}.")
            idx = idx * g + p
        return idx

    def box(self, index: int) -> tuple[slice, ...]:
        """Slices of sub-domain ``index`` into the spatial axes of the full image."""
        pos = self.position(index)
        return tuple(slice(self.starts[a][p], self.starts[a][p] + self.sub_shape[a]) for a, p in enumerate(pos))

    def boxes(self) -> list[tuple[slice, ...]]:
        return [self.box(i) for i in range(self.num_subdomains)]

    @property
    def overlaps(self) -> tuple[int, ...]:
        """Smallest number of pixels shared by neighbours along each axis (0 where the grid has one part)."""
        out = []
        for a, g in enumerate(self.grid):
            st = self.starts[a]
            out.append(min(st[k] + self.sub_shape[a] - st[k + 1] for k in range(g - 1)) if g > 1 else 0)
        return tuple(out)

    def coverage(self) -> torch.Tensor:
        """How many sub-domains contain each pixel (an integer tensor of ``image_shape``)."""
        count = torch.zeros(self.image_shape, dtype=torch.int64)
        for b in self.boxes():
            count[b] += 1
        return count

    # --- extraction ---------------------------------------------------------------------------
    def _index_tensors(self, device: torch.device) -> list[torch.Tensor]:
        # For axis a: (g_a, s_a) absolute pixel indices of every part along that axis.
        return [
            torch.tensor(self.starts[a], device=device)[:, None] + torch.arange(self.sub_shape[a], device=device)
            for a in range(self.spatial_dims)
        ]

    def _check_input(self, x: torch.Tensor) -> None:
        d = self.spatial_dims
        if x.dim() != d + 2 or tuple(x.shape[2:]) != self.image_shape:
            raise ValueError(
                f"expected a batch of shape (B, C, {', '.join(map(str, self.image_shape))}) for this decomposition, "
                f"got {tuple(x.shape)}; resize the data to {self.image_shape} or build the Decomposition for the "
                f"data's shape."
            )

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """Cut a batch ``(B, C, *image_shape)`` into ``(B, N, C, *sub_shape)`` without a loop over samples.

        Sub-domain ``i`` of the result is ``x[(..., *self.box(i))]``.
        """
        self._check_input(x)
        b, c = x.shape[:2]
        idx = self._index_tensors(x.device)
        out = x
        # Gather along each spatial axis in turn: axis (2 + a) of length L becomes (g_a, s_a).
        for a in range(self.spatial_dims):
            ax = 2 + 2 * a
            flat = idx[a].reshape(-1)
            out = out.index_select(ax, flat)
            out = out.unflatten(ax, idx[a].shape)
        # out: (B, C, g1, s1, g2, s2, ...) -> (B, g1, g2, ..., C, s1, s2, ...)
        d = self.spatial_dims
        grid_axes = [2 + 2 * a for a in range(d)]
        sub_axes = [3 + 2 * a for a in range(d)]
        out = out.permute(0, *grid_axes, 1, *sub_axes)
        return out.reshape(b, self.num_subdomains, c, *self.sub_shape)

    def subdomain(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Sub-domain ``index`` of a batch ``(B, C, *image_shape)`` as ``(B, C, *sub_shape)`` (a view)."""
        self._check_input(x)
        return x[(slice(None), slice(None), *self.box(index))]

    def describe(self) -> str:
        return (
            f"grid {'x'.join(map(str, self.grid))} ({self.num_subdomains} sub-domains) of "
            f"{'x'.join(map(str, self.image_shape))}, sub-domain {'x'.join(map(str, self.sub_shape))}, "
            f"overlap >= {'x'.join(map(str, self.overlap))} (actual {'x'.join(map(str, self.overlaps))})"
        )
