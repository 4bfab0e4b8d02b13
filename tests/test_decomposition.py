"""Properties of the overlapping grid decomposition in 2D and 3D."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddcnn.decomposition import Decomposition


@st.composite
def decompositions(draw, spatial_dims: int):
    grid, shape, overlap = [], [], []
    for _ in range(spatial_dims):
        g = draw(st.integers(1, 5))
        n = draw(st.integers(g, 40))
        # Largest overlap that still fits: each part at most n long.
        max_d = (g * n - n) // (g - 1) if g > 1 else 5
        grid.append(g)
        shape.append(n)
        overlap.append(draw(st.integers(0, max_d)))
    return Decomposition(tuple(grid), tuple(shape), tuple(overlap))


def _check_properties(dec: Decomposition) -> None:
    # Equal shapes for every sub-domain, inside the image.
    for box in dec.boxes():
        assert tuple(s.stop - s.start for s in box) == dec.sub_shape
        assert all(s.start >= 0 and s.stop <= n for s, n in zip(box, dec.image_shape, strict=True))
    # Exact cover: every pixel in at least one sub-domain.
    assert int(dec.coverage().min()) >= 1
    # Neighbours share at least the requested overlap.
    for axis, g in enumerate(dec.grid):
        if g > 1:
            assert dec.overlaps[axis] >= dec.overlap[axis]


@settings(max_examples=60, deadline=None)
@given(decompositions(2))
def test_properties_2d(dec: Decomposition) -> None:
    _check_properties(dec)


@settings(max_examples=40, deadline=None)
@given(decompositions(3))
def test_properties_3d(dec: Decomposition) -> None:
    _check_properties(dec)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([2, 3]).flatmap(decompositions), st.integers(1, 3), st.integers(1, 2))
def test_split_matches_boxes(dec: Decomposition, batch: int, channels: int) -> None:
    x = torch.randn(batch, channels, *dec.image_shape)
    parts = dec.split(x)
    assert parts.shape == (batch, dec.num_subdomains, channels, *dec.sub_shape)
    for i in range(dec.num_subdomains):
        assert torch.equal(parts[:, i], x[(slice(None), slice(None), *dec.box(i))])
        assert torch.equal(parts[:, i], dec.subdomain(x, i))


def test_layout_is_row_major_last_axis_fastest() -> None:
    dec = Decomposition((2, 2), (16, 16), overlap=2)
    assert dec.sub_shape == (9, 9)
    # 0: top-left, 1: top-right, 2: bottom-left, 3: bottom-right.
    assert [dec.position(i) for i in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert dec.box(1) == (slice(0, 9), slice(7, 16))
    assert dec.box(2) == (slice(7, 16), slice(0, 9))
    dec3 = Decomposition((2, 3, 4), (8, 9, 12))
    for i in range(dec3.num_subdomains):
        a, b, c = dec3.position(i)
        assert i == (a * 3 + b) * 4 + c == dec3.index((a, b, c))


def test_no_overlap_tiles_exactly() -> None:
    dec = Decomposition((4, 4), (28, 28), overlap=0)
    assert dec.sub_shape == (7, 7)
    assert torch.equal(dec.coverage(), torch.ones(28, 28, dtype=torch.int64))


def test_anisotropic_overlap_3d() -> None:
    dec = Decomposition((2, 2, 2), (28, 28, 16), overlap=(4, 4, 0))
    assert dec.sub_shape == (16, 16, 8)
    assert dec.overlaps == (4, 4, 0)


def test_split_is_differentiable_and_keeps_device_dtype() -> None:
    dec = Decomposition((2, 2), (10, 10), overlap=2)
    x = torch.randn(2, 1, 10, 10, dtype=torch.float64, requires_grad=True)
    parts = dec.split(x)
    assert parts.dtype == torch.float64
    parts.sum().backward()
    # Pixels in the overlap are counted once per sub-domain that holds them.
    assert torch.equal(x.grad[0, 0], dec.coverage().to(torch.float64))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(grid=(20, 2), image_shape=(16, 16)), "at most 16 sub-domains"),
        (dict(grid=(2, 2), image_shape=(16, 16), overlap=17), "overlap of at most 16"),
        (dict(grid=(4, 4), image_shape=(8, 8), overlap=9), "overlap of at most 8"),
        (dict(grid=(2, 2, 2), image_shape=(16, 16)), "one entry per spatial axis"),
        (dict(grid=2, image_shape=(16, 16)), "e.g. (2, 2)"),
        (dict(grid=(2, 2), image_shape=(16, 16), overlap=-1), ">= 0"),
        (dict(grid=(0, 2), image_shape=(16, 16)), "at least one sub-domain"),
        (dict(grid=(2, 2), image_shape=(16, 16), overlap=(1, 2, 3)), "3 entries"),
        (dict(grid=(2, 2), image_shape=(16, 16), overlap=1.5), "whole numbers"),
        (dict(grid=(2, 2, 2, 2), image_shape=(4, 4, 4, 4)), "2D images"),
    ],
)
def test_impossible_requests_say_what_works(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Decomposition(**kwargs)


def test_wrong_input_shape_is_explained() -> None:
    dec = Decomposition((2, 2), (16, 16), overlap=2)
    with pytest.raises(ValueError, match="resize the data to"):
        dec.split(torch.zeros(2, 1, 28, 28))
    with pytest.raises(ValueError, match="outside"):
        dec.box(4)
