"""From raw arrays to normalised in-memory tensors, and the loaders every stage trains on.

:func:`prepare` turns a :class:`~ddcnn.data.sources.Splits` into float tensors: values scaled to
``[0, 1]``, optionally resized, a validation split carved from training with a fixed seed when the
source has none, and per-channel normalisation statistics computed from the training split only.

:class:`TensorDataModule` serves such tensors to Lightning. Whole batches are taken by one index
operation (no per-sample ``__getitem__`` and collate), which keeps the framework overhead of small
local nets negligible. An optional ``view`` turns each batch of full images into what the network
sees, e.g. sub-domain ``i`` of the decomposition, after an optional augmentation of the whole image.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

from ddcnn.data.sources import Splits, stratified_split

__all__ = ["Prepared", "prepare", "TensorDataModule", "SPLITS"]

SPLITS = ("train", "val", "test")


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


class _BatchTensorDataset(Dataset):
    """Indexed by a list of sample indices; returns the whole batch in one tensor operation."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"inputs ({len(x)}) and labels ({len(y)}) differ in length.")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: list[int] | torch.Tensor | tuple[int, torch.Tensor]):
        epoch = 0
        if isinstance(index, tuple):  # (epoch, indices) from the training sampler
            epoch, index = index
        idx = torch.as_tensor(index, dtype=torch.long)
        return self.x[idx], self.y[idx], idx, epoch


class _EpochBatchSampler:
    """Shuffled batches whose order depends only on ``(seed, epoch)``.

    Lightning calls :meth:`set_epoch` before every epoch, so a run resumed from a checkpoint sees exactly
    the batches an uninterrupted run would have seen.
    """

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.seed, self.epoch = n, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    @staticmethod
    def _rank_world() -> tuple[int, int]:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.n, generator=gen)
        rank, world = self._rank_world()
        if world > 1:
            # DDP: every rank takes every world-th sample of the same permutation, padded by wrapping around so
            # that all ranks run the same number of steps (as torch's DistributedSampler does).
            total = -(-self.n // world) * world
            order = torch.cat([order, order[: total - self.n]])[rank::world]
        for idx in order.split(self.batch_size):
            yield self.epoch, idx

    def __len__(self) -> int:
        _, world = self._rank_world()
        per_rank = -(-self.n // world)
        return -(-per_rank // self.batch_size)


class _ViewCollate:
    """Applies ``augment`` (training only) then ``view`` to a batch of full inputs."""

    def __init__(self, view: Callable | None, augment: Callable | None) -> None:
        self.view, self.augment = view, augment

    def __call__(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, idx, epoch = batch
        if self.augment is not None:
            x = self.augment(x, idx, epoch)
        if self.view is not None:
            x = self.view(x)
        return x.contiguous(), y


class TensorDataModule(L.LightningDataModule):
    """Serves in-memory ``(x, y)`` tensors of the three splits in shuffled (train) or ordered batches.

    Args:
        x, y: Per split (``train``, ``val``, ``test``) inputs and labels.
        batch_size: Training batch size.
        eval_batch_size: Batch size for validation and prediction (defaults to ``4 * batch_size``).
        seed: Seed of the shuffling generator, so that runs repeat exactly.
        view: Maps a batch of stored inputs to network inputs (e.g. cuts sub-domain ``i``).
        augment: ``(x, sample_indices, epoch) -> x`` applied to training batches of full inputs before
            ``view`` (e.g. :class:`ddcnn.data.augment.Augment`, whose draws depend only on the sample and the
            epoch, so every local net sees a consistent view of the same augmented image).
    """

    def __init__(
        self,
        x: dict[str, torch.Tensor],
        y: dict[str, torch.Tensor],
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        seed: int = 0,
        view: Callable | None = None,
        augment: Callable | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.data = {s: _BatchTensorDataset(x[s], y[s]) for s in x}
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size or 4 * batch_size)
        self.seed = int(seed)
        self.view = view
        self.augment = augment

    def loader(self, split: str, shuffle: bool = False) -> DataLoader:
        ds = self.data[split]
        if shuffle:
            sampler = _EpochBatchSampler(len(ds), self.batch_size, self.seed)
        else:
            sampler = BatchSampler(SequentialSampler(ds), self.eval_batch_size, drop_last=False)
        augment = self.augment if shuffle else None
        return DataLoader(ds, sampler=sampler, batch_size=None, collate_fn=_ViewCollate(self.view, augment))

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("val")

    def test_dataloader(self) -> DataLoader:
        return self.loader("test")
