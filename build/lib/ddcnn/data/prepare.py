"""From raw arrays to normalised in-memory tensors: the data every stage and process starts from.

:func:`prepare` turns a :class:`~ddcnn.data.sources.Splits` into float tensors: values scaled to
``[0, 1]``, optionally resized, a validation split carved from training with a fixed seed when the
source has none, and per-channel normalisation statistics computed from the training split only.
It needs no Lightning: a coordinating process (the parent of parallel workers, a SLURM submitter)
checks the data and the decomposition without paying Lightning's import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ddcnn.data.sources import Splits, stratified_split
from ddcnn.rundir import SPLITS

__all__ = ["Prepared", "prepare"]


@dataclass
class Prepared:
    """Normalised tensors of the train, val and test splits of one dataset."""

    x: dict[str, torch.Tensor]
    y: dict[str, torch.Tensor]
    class_names: list[str]
    mean: torch.Tensor
    std: torch.Tensor
    name: str = "data"
    info: dict = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def in_channels(self) -> int:
        return int(self.x["train"].shape[1])

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.x["train"].shape[2:])

    @property
    def spatial_dims(self) -> int:
        return self.x["train"].dim() - 2


def _to_float(x: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x))
    if t.dtype == torch.uint8:
        return t.to(torch.float32).div_(255.0)
    return t.to(torch.float32)


def _resize(x: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    if tuple(x.shape[2:]) == size:
        return x
    mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[len(size)]
    # Antialiasing only exists for 2D; it avoids aliasing when shrinking large images.
    antialias = len(size) == 2 and any(s < n for s, n in zip(size, x.shape[2:], strict=True))
    return F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=antialias)


def _subset(y: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A class-stratified subset of ``n`` indices, fixed by ``seed`` (for fast benchmarks)."""
    if n >= len(y):
        return np.arange(len(y))
    from sklearn.model_selection import train_test_split

    try:
        held, _ = train_test_split(np.arange(len(y)), train_size=n, stratify=y, random_state=seed)
    except ValueError:  # a class too small to stratify: fall back to a plain seeded sample
        held = np.random.default_rng(seed).permutation(len(y))[:n]
    return np.sort(held)


def prepare(
    splits: Splits,
    *,
    num_classes: int,
    in_channels: int,
    spatial_dims: int,
    image_size: Sequence[int] | None = None,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    train_subset: int | None = None,
    test_subset: int | None = None,
    normalize: bool = True,
) -> Prepared:
    """Scale, resize, split and normalise a dataset; check it against the declared configuration.

    Args:
        splits: Raw arrays from a source.
        num_classes, in_channels, spatial_dims: What the configuration declares; a mismatch with the data
            is an error (models are built from the declaration before the data is read).
        image_size: Resize every image/volume to this spatial shape (bilinear/trilinear).
        val_fraction: Share of the training split held out (stratified) when the source has no validation split.
        split_seed: Seed of that split and of the subsets; fixed so that every stage sees the same data.
        train_subset, test_subset: Use only this many (stratified) samples, for quick benchmarks.
        normalize: Subtract the training mean and divide by the training std, per channel.
    """
    where = f"dataset {splits.name!r}"
    if splits.x_train.ndim != spatial_dims + 2:
        raise ValueError(
            f"{where} has images of shape {splits.x_train.shape[1:]} (channels first), which is "
            f"{splits.x_train.ndim - 2}D, but data.spatial_dims={spatial_dims}; set data.spatial_dims to match."
        )
    if splits.in_channels != in_channels:
        raise ValueError(
            f"{where} has {splits.in_channels} channel(s) but data.in_channels={in_channels}; set data.in_channels="
            f"{splits.in_channels}."
        )
    raw_x = {"train": splits.x_train, "test": splits.x_test}
    raw_y = {"train": splits.y_train, "test": splits.y_test}
    if splits.x_val is not None and splits.y_val is not None:
        raw_x["val"], raw_y["val"] = splits.x_val, splits.y_val
    else:
        keep, held = stratified_split(splits.y_train, val_fraction, split_seed)
        raw_x["val"], raw_y["val"] = splits.x_train[held], splits.y_train[held]
        raw_x["train"], raw_y["train"] = splits.x_train[keep], splits.y_train[keep]
    for split, n in (("train", train_subset), ("test", test_subset)):
        if n is not None:
            if n < 1:
                raise ValueError(f"data.{split}_subset must be a positive number of samples or null, got {n}.")
            idx = _subset(raw_y[split], int(n), split_seed)
            raw_x[split], raw_y[split] = raw_x[split][idx], raw_y[split][idx]

    for split in SPLITS:
        y = raw_y[split]
        if len(y) == 0:
            raise ValueError(f"{where}: the {split} split is empty; provide more data or lower data.val_fraction.")
        if y.min() < 0 or y.max() >= num_classes:
            raise ValueError(
                f"{where}: {split} labels range over [{y.min()}, {y.max()}] but data.num_classes={num_classes}; "
                f"labels must be 0..{num_classes - 1}. Set data.num_classes to {int(y.max()) + 1} if that is right."
            )
    if len(np.unique(raw_y["train"])) < 2:
        raise ValueError(f"{where}: the training split holds a single class; a classifier needs at least two.")

    x = {s: _to_float(raw_x[s]) for s in SPLITS}
    for s in SPLITS:
        if not torch.isfinite(x[s]).all():
            bad = int((~torch.isfinite(x[s])).flatten(1).any(1).nonzero()[0, 0])
            raise ValueError(f"{where}: {s} sample {bad} holds NaN or infinite values; clean the data first.")
    if image_size is not None:
        size = tuple(int(v) for v in image_size)
        if len(size) != spatial_dims or min(size) < 1:
            raise ValueError(f"data.image_size={list(size)} must give {spatial_dims} positive sizes.")
        x = {s: _resize(v, size) for s, v in x.items()}
    reduce_dims = [0] + list(range(2, spatial_dims + 2))
    if normalize:
        mean = x["train"].mean(dim=reduce_dims)
        std = x["train"].std(dim=reduce_dims).clamp_min(1e-6)
    else:
        mean = torch.zeros(in_channels)
        std = torch.ones(in_channels)
    shape = (1, -1) + (1,) * spatial_dims
    x = {s: ((v - mean.view(shape)) / std.view(shape)).contiguous() for s, v in x.items()}
    y = {s: torch.from_numpy(np.asarray(raw_y[s], dtype=np.int64)) for s in SPLITS}
    info = {f"n_{s}": len(y[s]) for s in SPLITS}
    return Prepared(x, y, list(splits.class_names), mean, std, splits.name, info)
