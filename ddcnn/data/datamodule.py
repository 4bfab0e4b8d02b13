"""The batches every stage trains on, through one protocol: :class:`Batches`.

The training loop reads batches through one small protocol (:class:`Batches`): it owns the order of the samples
(from ``(seed, epoch)``, sharded by rank under DDP) and asks the data for the batch of a list of sample indices,
ready for the network on the training device.

:class:`PreparedBatches` implements it for the images of a :class:`~ddcnn.data.prepare.Prepared` dataset, for one
network: the full images (global CNN) or the box of one sub-domain (local net ``i``). It reads only what that
network sees of the samples of a batch, in their compact stored type, from this process's memory or from the
memory-mapped store, moves it to the device, and there normalises it, augments it (training only) and cuts the box:

- no augmentation: the box alone is read;
- flips: the box is read mirrored for a flipped sample, then flipped;
- a rotation: the slightly larger region the rotated box is computed from (:meth:`Augment.support`) is read, then
  rotated with the whole image's sampling coordinates (:meth:`Augment.rotate_box`).

For data held in memory (small data, ``data.memory.mode``) and no augmentation, the network's inputs of every split
are made once and kept (float32, the box only): each step is then one gather from contiguous memory, the fastest
path for small networks whose steps take a millisecond.

:class:`TensorDataModule` implements the protocol for tensors that are already network inputs (the coarse DNN's
features).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from ddcnn.data.augment import Augment
from ddcnn.data.prepare import Prepared, gather, prepare

__all__ = [
    "Prepared",
    "prepare",
    "Batches",
    "PreparedBatches",
    "RowSubset",
    "TensorDataModule",
    "Crop",
    "release_device_copies",
    "pinned_empty",
]

# The splits placed on a device, one copy per process and device for each host dataset: the local nets a process
# trains one after another (and its global CNN) share it. Kept while the host dataset lives (a weak reference to it),
# or until release_device_copies().
_DEVICE_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLACED_SPLITS = ("train", "val")


def _device_copy(data: Prepared, device: torch.device) -> tuple[Prepared, dict[str, torch.Tensor]]:
    """``data`` with its train and val splits held on ``device``, and their labels there: made on first use in this
    process, then shared."""
    copies = _DEVICE_COPIES.setdefault(data, {})
    key = str(device)
    if key not in copies:
        labels = {s: data.y[s].to(device, copy=True) for s in _PLACED_SPLITS}
        copies[key] = (data.on_device(device, _PLACED_SPLITS), labels)
    return copies[key]


def release_device_copies(data: Prepared | None = None) -> None:
    """Free the device copies of ``data``'s splits (default: of every dataset) that :meth:`PreparedBatches.placed`
    made in this process; a later placement copies them again."""
    for key in [data] if data is not None else list(_DEVICE_COPIES):
        _DEVICE_COPIES.pop(key, None)


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

    # Optional: ``index_device`` (a ``torch.device``), where the source cuts its batches; a loop builds its sample
    # indices there (once per epoch) so that cutting a batch needs no copy between host and device. Absent: the CPU.

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


class _TensorSplit:
    """One split's inputs and labels, checked to be of the same length."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"inputs ({len(x)}) and labels ({len(y)}) differ in length.")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)


class Crop:
    """Cuts one box out of a batch (a picklable function, so data modules survive ``ddp_spawn``)."""

    def __init__(self, box: tuple[slice, ...]) -> None:
        self.box = box

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.box]


class RowSubset:
    """A :class:`Batches` source restricted to some rows of some splits (e.g. the training folds of a k-fold
    cross-fitting): sample ``i`` of a restricted split is row ``rows[split][i]`` of ``base``. Training batches keep
    the base's sample indices, so augmentation draws the same as for the full source.

    Args:
        base: The full source.
        rows: Per split, the rows kept (a 1-d index tensor); splits not named are served whole.
    """

    def __init__(self, base: Batches, rows: dict[str, torch.Tensor]) -> None:
        self.base = base
        self.rows = {}
        for split, kept in rows.items():
            kept = torch.as_tensor(kept, dtype=torch.long).cpu()
            n = base.size(split)
            if kept.dim() != 1 or (len(kept) and (int(kept.min()) < 0 or int(kept.max()) >= n)):
                raise ValueError(f"rows of split {split!r} must be a 1-d index into its {n} samples.")
            self.rows[split] = kept
        self.batch_size, self.eval_batch_size, self.seed = base.batch_size, base.eval_batch_size, base.seed

    @property
    def index_device(self) -> torch.device:
        return getattr(self.base, "index_device", torch.device("cpu"))

    def _map(self, split: str, idx: torch.Tensor) -> torch.Tensor:
        kept = self.rows.get(split)
        idx = torch.as_tensor(idx, dtype=torch.long)
        if kept is None:
            return idx
        return kept[idx.to(kept.device, non_blocking=True) if idx.device != kept.device else idx]

    def size(self, split: str) -> int:
        return len(self.rows[split]) if split in self.rows else self.base.size(split)

    def labels(self, split: str) -> torch.Tensor:
        labels = self.base.labels(split)
        return labels[self.rows[split]] if split in self.rows else labels

    def train_batch(self, idx: torch.Tensor, epoch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.train_batch(self._map("train", idx), epoch, device)

    def eval_batch(self, split: str, idx: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.eval_batch(split, self._map(split, idx), device)

    def placed_nbytes(self, device=None) -> int | None:
        nbytes = getattr(self.base, "placed_nbytes", None)
        return nbytes(device) if callable(nbytes) else None

    def placed(self, device, pin: bool = False) -> RowSubset:
        """This subset of ``base.placed(device, pin)`` (see :meth:`PreparedBatches.placed`)."""
        out = copy.copy(self)
        out.base = self.base.placed(device, pin)
        where = out.index_device
        out.rows = {split: kept.to(where) for split, kept in self.rows.items()}  # cut where the base cuts
        return out


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
        self.data = {s: _TensorSplit(x[s], y[s]) for s in x}
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


class PreparedBatches:
    """Batches of a prepared dataset for one network: the full images, or one box (a sub-domain), on a device.

    Args:
        data: The prepared data (in memory or memory-mapped).
        batch_size: Training batch size.
        eval_batch_size: Batch size for validation and prediction (defaults to ``4 * batch_size``).
        seed: Seed of the training order.
        box: Spatial slices of the box the network sees (``None``: the full images).
        augment: Whole-image augmentation of training batches (its draws depend only on the sample and the epoch,
            so every local net sees its box of the same augmented image).
        cache: Keep the network inputs of every split (float32, the box only) after first use instead of reading
            them per batch; ``None``: when the data are held in memory and there is no augmentation.
    """

    def __init__(
        self,
        data: Prepared,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        seed: int = 0,
        box: Sequence[slice] | None = None,
        augment: Augment | None = None,
        cache: bool | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.data = data
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size or 4 * batch_size)
        self.seed = int(seed)
        shape = data.image_shape
        if box is not None:
            box = tuple(slice(*b.indices(n)[:2]) for b, n in zip(box, shape, strict=True))
            if box == tuple(slice(0, n) for n in shape):
                box = None
        self.box = box
        self.augment = augment if augment is not None and augment.active else None
        if self.augment is not None:
            self.augment.check(len(shape))
            self.support = self.augment.support(self.box, shape) if self.box is not None else None
        self.cache = (data.holding == "memory" and self.augment is None) if cache is None else bool(cache)
        self._cached: dict[str, torch.Tensor] = {}
        self._labels: dict[str, torch.Tensor] = {}  # labels of the splits held on a device (placed), there
        self.pin = False

    # --- where the batches come from (ddcnn.engine.gpu.place_data) ---
    def placed_nbytes(self, device=None) -> int:
        """Bytes of the stored train and val splits that :meth:`placed` would add on ``device``: 0 when this process
        holds them there already."""
        held = _DEVICE_COPIES.get(self.data, {})
        if device is not None and str(torch.device(device)) in held:
            return 0
        return self.data.nbytes("train") + self.data.nbytes("val")

    def placed(self, device, pin: bool = False) -> PreparedBatches:
        """These batches with the stored (compact) train and val splits and their labels held on ``device``
        (``None``: where they are; the copy is made once per process and shared, see :func:`release_device_copies`),
        so that batches, crops and augmentation are cut there, with indices that live
        there (:attr:`index_device`); ``pin``: every host batch goes through pinned memory, so that its copy to a GPU
        can overlap with computation (``non_blocking``). Either way the stored (compact) values travel and are
        decoded (normalised) on the training device. The batches are the same values as these."""
        out = copy.copy(self)
        out._cached, out._labels, out.pin = {}, {}, bool(pin)
        if device is not None:  # one copy per process and device, shared by the trainings on these data
            out.data, out._labels = _device_copy(self.data, torch.device(device))
        if device is not None or pin:
            out.cache = False  # one gather of compact values per batch; a float32 copy would take (and move) 4x
        return out

    @property
    def index_device(self) -> torch.device:
        """Where batches are cut: the device the stored training split is held on (the CPU unless placed)."""
        return self.data.stored["train"].device

    # --- the Batches protocol ---
    def size(self, split: str) -> int:
        return len(self.data.y[split])

    def labels(self, split: str) -> torch.Tensor:
        return self.data.y[split]

    def eval_batch(self, split: str, idx: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        idx = torch.as_tensor(idx, dtype=torch.long)
        y = self._to(self._y(split, idx), device)
        if self.cache:
            return self._to(self._inputs(split)[_at(idx, torch.device("cpu"))], device), y
        x = self.data.read(split, idx, self.box, into=self._host_memory)
        return self.data.normalizer(device)(self._to(x, device)), y

    def train_batch(self, idx: torch.Tensor, epoch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The training batch of samples ``idx`` in ``epoch``: without augmentation the evaluation batch; with it,
        the draws of ``(seed, epoch, sample)`` made where ``idx`` lives, the (flipped) region read as one gather
        where the data are, its compact values moved and normalised on ``device``, then rotated there."""
        if self.augment is None:
            return self.eval_batch("train", idx, device)
        device = torch.device(device)
        aug = self.augment
        idx = torch.as_tensor(idx, dtype=torch.long)
        y = self._to(self._y("train", idx), device)
        flips, angles = aug.draw(idx, epoch)
        region = self.support if self.box is not None else None
        x = self.data.read("train", idx, region, flips, aug.flip_axes, into=self._host_memory)
        x = self.data.normalizer(device)(self._to(x, device))
        if aug.rotate_deg > 0:
            angles = self._to(angles, device)
            if self.box is None:  # the whole image, as the global CNN sees it
                x = aug.rotate(x, angles)
            else:
                x = aug.rotate_box(x, angles, region, self.box, self.data.image_shape)
        return x.contiguous(), y

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_cached"] = {}  # a DDP rank or a worker makes its own (it may not need them)
        return state

    # --- internals ---
    def _y(self, split: str, idx: torch.Tensor) -> torch.Tensor:
        """Labels of samples ``idx``, cut where they are held (the device of :meth:`placed`, or the host)."""
        y = self._labels.get(split, self.data.y[split])
        return gather(y, (_at(idx, y.device),), self._host_memory if y.device.type == "cpu" else None)

    @property
    def _host_memory(self) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None:
        """Where a batch gathered on the host is written: pinned memory when :meth:`placed` asked for it (the batch
        is gathered there and copied to the GPU from there, one host copy), else a new tensor."""
        return pinned_empty if self.pin else None

    def _to(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``x`` on ``device``; from the host through pinned memory when :meth:`placed` asked for it, so that the
        copy does not block the host (a batch gathered into pinned memory is copied from there as it is)."""
        if self.pin and x.device.type == "cpu":
            x = x.pin_memory()  # the tensor itself when it is pinned already
        return x if x.device == device else x.to(device, non_blocking=True)

    def _inputs(self, split: str) -> torch.Tensor:
        if split not in self._cached:
            self._cached[split] = self.data.inputs(split, region=self.box).contiguous()
        return self._cached[split]


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised pinned host tensor from torch's caching host allocator: a block is handed out again only once
    the copies that read it have finished (torch records an event on the stream of each ``non_blocking`` copy), so
    the streamed batches reuse a few pinned buffers with no host synchronisation (needs CUDA)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _at(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Indices on ``device`` (a copy only when they are elsewhere)."""
    return idx if idx.device == device else idx.to(device, non_blocking=True)
