"""The loaders every stage trains on: in-memory tensors served one whole batch at a time.

The training loop reads batches through one small protocol (:class:`Batches`): it owns the order of the samples
(from ``(seed, epoch)``, sharded by rank under DDP) and asks the data for the batch of a list of sample indices,
ready for the network on the training device. :class:`TensorDataModule` implements it for in-memory tensors.

:class:`TensorDataModule` holds the tensors of :func:`ddcnn.data.prepare.prepare` for ddcnn's plain loop (which reads
them directly, :mod:`ddcnn.engine.train`) and serves them to Lightning as data loaders. Whole
batches are taken by one index operation (no per-sample ``__getitem__`` and collate), which keeps the
framework overhead of small local nets negligible. An optional ``view`` turns each batch of full images
into what the network sees, e.g. sub-domain ``i`` of the decomposition, after an optional augmentation of
the whole image.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

from ddcnn.data.prepare import Prepared, prepare

__all__ = ["Prepared", "prepare", "Batches", "TensorDataModule", "Crop"]


@runtime_checkable
class Batches(Protocol):
    """What a training loop trains on: batches of given samples, ready for the network on a device.

    The loop decides which samples form a batch (``idx``, a 1-D ``int64`` tensor of sample indices of the split) and
    where it trains; the implementation reads those samples (only the part of each the network sees), moves them to
    ``device``, and normalises, augments (training only) and crops them there.

    Attributes:
        batch_size: Samples per training step.
        eval_batch_size: Samples per evaluation batch.
        seed: Seed of the training order (the loop draws epoch ``e``'s permutation from ``(seed, e)``).
    """

    batch_size: int
    eval_batch_size: int
    seed: int

    def size(self, split: str) -> int:
        """Number of samples of ``split`` (``train``, ``val`` or ``test``)."""
        ...

    def labels(self, split: str) -> torch.Tensor:
        """All labels of ``split`` (``int64``, on the host), in sample order."""
        ...

    def train_batch(self, idx: torch.Tensor, epoch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Network inputs and labels of training samples ``idx`` in epoch ``epoch`` (augmented), on ``device``."""
        ...

    def eval_batch(self, split: str, idx: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Network inputs and labels of samples ``idx`` of ``split`` (not augmented), on ``device``."""
        ...


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


class _ShardedBatchSampler:
    """Ordered batches of this DDP rank's share (every world-th sample, no padding); all samples outside DDP.

    Validation under DDP: each rank evaluates its share and the metrics' sums and counts are added over the ranks,
    so every sample counts once.
    """

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size = n, batch_size

    def _indices(self) -> torch.Tensor:
        rank, world = _EpochBatchSampler._rank_world()
        return torch.arange(rank, self.n, world)

    def __iter__(self):
        yield from (idx.tolist() for idx in self._indices().split(self.batch_size))

    def __len__(self) -> int:
        return -(-len(self._indices()) // self.batch_size)


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


class Crop:
    """Cuts one box out of a batch (a picklable function, so data modules survive ``ddp_spawn``)."""

    def __init__(self, box: tuple[slice, ...]) -> None:
        self.box = box

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.box]


class TensorDataModule:
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
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.data = {s: _BatchTensorDataset(x[s], y[s]) for s in x}
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size or 4 * batch_size)
        self.seed = int(seed)
        self.view = view
        self.augment = augment

    # --- the Batches protocol (what the training loop reads) ---
    def size(self, split: str) -> int:
        return len(self.data[split])

    def labels(self, split: str) -> torch.Tensor:
        return self.data[split].y

    def train_batch(self, idx: torch.Tensor, epoch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        ds = self.data["train"]
        x, y = ds.x[idx], ds.y[idx]
        if self.augment is not None:
            x = self.augment(x, idx, epoch)
        if self.view is not None:
            x = self.view(x)
        return x.contiguous().to(device, non_blocking=True), y.to(device, non_blocking=True)

    def eval_batch(self, split: str, idx: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        ds = self.data[split]
        x, y = ds.x[idx], ds.y[idx]
        if self.view is not None:
            x = self.view(x)
        return x.contiguous().to(device, non_blocking=True), y.to(device, non_blocking=True)

    # --- loaders for Lightning's Trainer ---
    def loader(self, split: str, shuffle: bool = False, shard: bool = False) -> DataLoader:
        ds = self.data[split]
        if shuffle:
            sampler = _EpochBatchSampler(len(ds), self.batch_size, self.seed)
        elif shard:
            sampler = _ShardedBatchSampler(len(ds), self.eval_batch_size)
        else:
            sampler = BatchSampler(SequentialSampler(ds), self.eval_batch_size, drop_last=False)
        augment = self.augment if shuffle else None
        return DataLoader(ds, sampler=sampler, batch_size=None, collate_fn=_ViewCollate(self.view, augment))

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("val", shard=True)

    def test_dataloader(self) -> DataLoader:
        return self.loader("test")
