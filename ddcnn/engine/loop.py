"""ddcnn's one training loop, on Lightning Fabric: every training of a run (local nets, the coarse DNN, the global CNN,
the optional methods, the DDP baseline) trains here.

:func:`fit_batches` trains a classifier on a :class:`~ddcnn.data.datamodule.Batches` source with cross-entropy and
selects its weights on validation. Fabric does what depends on where it runs (:mod:`ddcnn.engine.launch`): the device,
DDP (spawned on this machine, or across the tasks of an ``srun`` step), the precision (``32-true``, ``bf16-mixed``,
``16-mixed`` with a loss scaler, ``64-true``) with ``backward`` and gradient clipping. The loss is computed in the
network's dtype (float32; float64 under ``64-true``; float32 for the half-precision outputs of autocast). The loop
owns the order of the samples and everything a run directory promises:

- **exact resume**: everything random depends only on ``(seed, epoch)``. Epoch ``e`` visits the permutation drawn
  from ``torch.Generator().manual_seed(seed * 100_003 + e)`` (under DDP every rank takes every world-th sample of it,
  padded by wrapping around so that all ranks run the same steps), and the global generators (dropout) are seeded
  from the same generator during that epoch, then restored (:func:`torch.random.fork_rng`). ``last.ckpt`` (written
  atomically every ``checkpoint_every_s`` seconds of training or every ``checkpoint_every`` epochs, and after the last
  one) holds the weights, the optimizer, the schedule, the loss scaler, the best weights so far and the history, so a
  killed training resumes to exactly the weights an uninterrupted one reaches;
- **one improvement rule** (:func:`improves`): an epoch improves when its monitored metric (``monitor``,
  ``monitor_mode``) beats the kept epoch's by more than ``min_delta`` (absolute; 0: strictly better, ties keep the
  earlier epoch); NaN never does. Selection keeps the last epoch that improved; early stopping counts the epochs since
  it; ``ReduceLROnPlateau`` is built with the same rule (``mode``, ``threshold_mode="abs"``, ``threshold=min_delta``)
  and its patience must be at least 2 below early stopping's;
- ``logs/metrics.csv``: one row per epoch, every epoch once across a resume;
- **one timing rule**: the training clock runs from the caller's ``start`` and adds the time of the earlier processes
  that worked on the training (carried in ``last.ckpt``). Left out of it, alike for every training: process start-up
  and DDP's launch and rendezvous (``startup_s``), the device warm-up (an untimed training forward and backward of
  every batch shape of the epoch, the full batch and a partial last one, and an evaluation batch of every shape,
  which leave weights, buffers, optimizer and generators as they were: ``warmup_s``), the ``after_epoch`` hook
  (``hook_time_s``) and the progress and loggers (``report_time_s``).

What a fit may ask of the loop beyond plain mini-batch steps:

- **closure optimizers** (``torch.optim.LBFGS``): each step re-evaluates the batch through a closure; with a batch as
  large as the training split every step sees all of it (full-batch L-BFGS);
- **gradient accumulation** (``accumulate_grad_batches``), **clipping** (``gradient_clip_val`` by norm or value);
- **a per-epoch hook with the network** (``after_epoch``), e.g. the test accuracy of every epoch for accuracy-versus-
  time curves. Its time is kept out of the training clock; the metrics it returns join the epoch's row and
  ``logs/metrics.csv``; every row has ``time_s``, the training clock at the end of that epoch;
- **divergence detection** (``divergence_restarts`` not ``None``): an epoch has diverged when its mean training loss
  is not finite or exceeds ``divergence_factor`` times the larger of the initial loss (the loss of the first training
  batch before the first step; under DDP the global batch's) and ``ln K`` (the loss of a uniform guess over the ``K``
  classes: a network that starts better than chance may wander above its initial loss without diverging), or when its
  validation loss is not finite (the epoch's last steps left weights that are not: a training loss is taken before
  its step, so only the validation after the epoch sees them; torch 2.14's oneDNN 3D convolution on the CPU returns
  a non-finite weight gradient now and then for kernels as large as the input). Non-finite weights are restarted even
  with ``divergence_restarts=None``: at most :data:`NOT_FINITE_RETRIES` times, at the same learning rates. With
  ``divergence_restarts=0`` the fit raises :class:`Diverged`; with ``R > 0`` it starts again from the initial weights
  with every learning rate multiplied by ``divergence_lr_factor``, at most ``R`` times. The restarts are recorded in
  the result (``restarts``) and in ``last.ckpt``, so a resumed fit continues the same attempt;
- **early stopping** (``patience``, ``min_epochs``): the fit ends once ``patience`` epochs have passed since the kept
  epoch, but not before ``min_epochs`` epochs have run; the epoch it stopped after is in the result (``stopped_epoch``)
  and in ``last.ckpt``;
- **a convergence record** (:func:`convergence`): whether the training converged, and why not, in the result.

The loop reads every batch through the ``Batches`` protocol (``train_batch``, ``eval_batch``: on the device, ready for
the network); it prepares no batch itself. The network is set up on the device in one place (:meth:`_Training.setup`)
and trained by one step function (:meth:`_Training.train_step`). The settings of a training are one frozen
:class:`_FitSettings`, checked once; what it carries from epoch to epoch is one :class:`TrainState`, which writes
``last.ckpt`` and resumes from it (its keys: :data:`CHECKPOINT_KEYS`). :meth:`_Training.fit` runs
:meth:`_Training.fit_epoch` until the budget or early stopping ends the training, as ``fit`` does in Lightning Fabric's
trainer example; each step of an epoch is a method of its own.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import itertools
import logging
import math
import os
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import hydra
import torch
import torch.nn.functional as F
from torch import nn

from ddcnn.data.datamodule import Batches, TensorDataModule
from ddcnn.engine.common import data_splits
from ddcnn.engine.gpu import (
    POLICY_OFF,
    amp_optimizer,
    math_flags,
    memory_format,
    peak_memory_bytes,
    place_data,
    prefetched,
    profiled,
    reset_peak_memory,
    resolve_policy,
)
from ddcnn.engine.launch import LAUNCHERS, RankFailed, build_fabric, failures_stop_every_rank, isolated_launch
from ddcnn.engine.sync_norm import convert_batch_norm, has_batch_norm
from ddcnn.io import ArtifactWriteError, atomic_torch_save, atomic_write_text, is_space_or_permission
from ddcnn.rundir import TARGET_SPLIT
from ddcnn.settings.fit import LOOP_SETTINGS, MONITORS, check_schedule, loop_setting, num_batches

log = logging.getLogger(__name__)

__all__ = [
    "FitResult",
    "Diverged",
    "Reporter",
    "fit_batches",
    "fit_tensors",
    "build_optimizer",
    "build_scheduler",
    "scheduler_factory",
    "improves",
    "early_stop_due",
    "convergence",
    "convergence_advice",
    "torch_threads",
    "num_batches",
    "shard_order",
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_KEYS",
    "TrainState",
    "METRIC_COLUMNS",
    "MONITORS",
    "EVAL_CHUNK",
]

# Stored in every checkpoint. The plain loop before the Fabric loop wrote the same layout as ``ddcnn.tensor_fit/1``,
# which resumes here too; a last.ckpt of Lightning's Trainer (older ddcnn) is refused with what to do.
CHECKPOINT_FORMAT = "ddcnn.loop/1"
_RESUMABLE_FORMATS = (CHECKPOINT_FORMAT, "ddcnn.tensor_fit/1")
# logs/metrics.csv: one row per epoch (0-based, as Lightning's CSVLogger counts), ``step`` = optimizer steps so far,
# ``time_s`` = the training clock at the end of the epoch; metrics returned by an ``after_epoch`` hook follow.
METRIC_COLUMNS = ("epoch", "step", "lr", "train_loss", "train_acc", "val_loss", "val_acc", "time_s")
# What a spawned DDP rank 0 hands back to the parent, in the training's folder (removed once read).
_SPAWN_RESULT = ".spawned_result.pt"
# What a failing spawned DDP rank hands to the parent, in the training's folder (removed once read).
_SPAWN_ERROR = ".spawned_error.{}.pt"
# Rows per forward pass when evaluating the coarse DNN's tensors; bounds the memory of a hidden layer.
EVAL_CHUNK = 65_536
# The settings an exact resume depends on: a checkpoint written under others is refused (a key missing from both
# the checkpoint and the current settings counts as equal: the later ones are recorded only where they are set).
_RESUME_SETTINGS = (
    "seed",
    "batch_size",
    "max_epochs",
    "monitor",
    "monitor_mode",
    "n_train",
    "limit_train_batches",
    "limit_val_batches",
    "divergence_restarts",
    "patience",
    "min_delta",
    "min_epochs",
    "world_size",
    "precision",
    "accumulate_grad_batches",
)


# Restarts of a training whose weights became non-finite where divergence is not checked (divergence_restarts null).
NOT_FINITE_RETRIES = 3


class Diverged(RuntimeError):
    """A training diverged (see the module doc for the rule) and no restart was allowed or left.

    Attributes:
        epoch: The epoch that diverged.
        reason: Why (``train_loss nan``, ``train_loss 9.1 > 2 x initial 3.6``).
    """

    def __init__(self, message: str, epoch: int, reason: str) -> None:
        super().__init__(message)
        self.epoch, self.reason = epoch, reason

    def __reduce__(self):  # picklable (a spawned DDP rank raises it to the parent)
        return (type(self), (str(self), self.epoch, self.reason))


@dataclass
class FitResult:
    """What :func:`fit_batches` returns.

    Attributes:
        net: The trained network with the weights of the best validation epoch (on the training device; on CPU after
            spawned DDP).
        best_epoch: That epoch (0-based; ``None`` for a result that did not come from the loop).
        best_metric: Its value of the monitored metric.
        history: Per epoch, the row written to ``logs/metrics.csv``.
        fit_time_s: Training time of every process that worked on this training, this one included (work after the
            last checkpoint of a killed process is lost and not counted); see the module doc for what is left out.
        previous_time_s: The part of ``fit_time_s`` spent by earlier processes (0 for an uninterrupted training).
        resumed_from_epoch: The last finished epoch of the checkpoint this process resumed from, else ``None``.
        hook_time_s: Time this process spent in the ``after_epoch`` hook, outside ``fit_time_s``.
        stopped_epoch: The epoch after which early stopping (``patience``) ended the fit, else ``None``.
        restarts: One entry per divergence restart: ``{"epoch", "reason", "lr_scale"}`` (the scale after it).
        initial_loss: The loss of the first training batch before the first step (of the last attempt).
        startup_s: Process start-up this training paid outside ``fit_time_s``: spawning the DDP ranks (interpreters,
            imports, data) and the rendezvous of the ranks; 0 on one device.
        warmup_s: The device warm-up before the clock (see the module doc).
        report_time_s: Progress bars, log lines and loggers (the ``reporter``), outside ``fit_time_s``.
        global_rank: This process's rank in the training (0 unless DDP across the tasks of an ``srun`` step).
        world_size: The processes that trained it together (DDP), 1 otherwise.
        precision: The precision it trained in.
        engine: The GPU policy it trained under (:mod:`ddcnn.engine.gpu`): ``channels_last``, ``memory_format``,
            ``tf32``, ``cudnn_benchmark``, ``compile``, ``data_on_device`` (the stored splits on the device),
            ``data_placement`` (``device``, ``pinned`` or ``host``), ``prefetch``, ``profile_steps``.
        gpu_peak_memory_bytes: The peak GPU memory of the training (this rank's device), ``None`` off CUDA.
        compile_time_s: With ``compile``: the warm-up that compiled the network, outside ``fit_time_s``.
        min_epochs: The epochs early stopping had to wait for (0: none).
        stopped_by: What ended the training: ``early_stopping`` or ``budget`` (``max_epochs``); ``None`` for a
            result that did not come from the loop.
        convergence: Whether the training converged, and why not (:func:`convergence`); ``None`` for a result that
            did not come from the loop.
    """

    net: nn.Module | None
    best_epoch: int | None = None
    best_metric: float | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    fit_time_s: float = 0.0
    previous_time_s: float = 0.0
    resumed_from_epoch: int | None = None
    hook_time_s: float = 0.0
    stopped_epoch: int | None = None
    restarts: list[dict] = field(default_factory=list)
    initial_loss: float | None = None
    startup_s: float = 0.0
    warmup_s: float = 0.0
    report_time_s: float = 0.0
    global_rank: int = 0
    world_size: int = 1
    precision: str = "32-true"
    engine: dict[str, Any] = field(default_factory=dict)
    gpu_peak_memory_bytes: int | None = None
    compile_time_s: float | None = None
    min_epochs: int = 0
    stopped_by: str | None = None
    convergence: dict[str, Any] | None = None


class Reporter(Protocol):
    """What shows a training's progress (rank 0 only; its time is left out of the training clock)."""

    def epoch(self, epoch: int, row: Mapping[str, float]) -> None:
        """After each epoch (once its checkpoint, if any, is written): its row of ``logs/metrics.csv``."""

    def steps(self, points: list[tuple[int, float]]) -> None:
        """After each epoch with ``log_every_n_steps``: ``(optimizer step, mean training loss of the last n)``."""

    def close(self, status: str) -> None:
        """When the training ends (``success``) or fails (``failed``)."""


# --- optimizers, schedules, threads ------------------------------------------------------------------------------
def _spec(node: Any) -> Any:
    """A ``_target_`` spec (a mapping, an OmegaConf node included: its items resolve) as plain dicts and lists; any
    other value (a callable, ``None``) as it is."""
    if isinstance(node, Mapping):
        return {key: _spec(value) for key, value in node.items()}
    if isinstance(node, Sequence) and not isinstance(node, str | bytes):
        return [_spec(value) for value in node]
    return node


def build_optimizer(node: Any, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of a Hydra ``_partial_`` node (``{_target_: torch.optim.AdamW, _partial_: true, lr: ...}``).

    A callable ``params -> Optimizer`` is accepted as well.
    """
    factory = hydra.utils.instantiate(_spec(node)) if isinstance(node, Mapping) else node
    if not callable(factory):
        raise ValueError(
            f"the optimizer setting must be a Hydra node with _partial_: true (e.g. coarse.optimizer) or a callable, "
            f"got {node!r}."
        )
    return factory(params)


def scheduler_factory(
    node: Any, max_epochs: int, plateau: Mapping[str, Any] | None = None
) -> Callable[[torch.optim.Optimizer], Any] | None:
    """The learning-rate schedule of a Hydra ``_partial_`` node as ``optimizer -> LRScheduler``, or ``None``.

    ``None`` or an empty node means a constant rate. ``T_max: null`` (cosine annealing) becomes ``max_epochs``: every
    training (local nets, coarse DNN, optional stages) anneals over its own epochs. ``plateau``: the arguments a
    ``ReduceLROnPlateau`` node gets (the loop's improvement rule: ``mode``, ``threshold_mode``, ``threshold``).
    """
    if not node:
        return None
    spec = _spec(node)
    if isinstance(spec, Mapping):
        spec = dict(spec)
        if "T_max" in spec and spec["T_max"] is None:
            spec["T_max"] = max_epochs
        if plateau and str(spec.get("_target_", "")).rsplit(".", 1)[-1] == "ReduceLROnPlateau":
            spec.update(plateau)
        spec = hydra.utils.instantiate(spec)
    return spec


def build_scheduler(
    node: Any, optimizer: torch.optim.Optimizer, max_epochs: int, plateau: Mapping[str, Any] | None = None
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The schedule of ``node`` (:func:`scheduler_factory`) on ``optimizer``, stepped once per epoch."""
    factory = scheduler_factory(node, max_epochs, plateau)
    return None if factory is None else factory(optimizer)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op CPU threads, then restore the previous number (``None``: unchanged).

    A small MLP gains nothing from a second thread, and on a CPU that other processes share, threads that wait for
    each other at every one of its many small operations made the coarse DNN several times slower (measured: one
    epoch of 10000 rows at batch 1024 took 0.16 s with one thread, 1.0 s with two, on two busy cores).
    """
    previous = torch.get_num_threads()
    if threads is not None:
        if int(threads) < 1:
            raise ValueError(f"the number of CPU threads must be >= 1 (or null to keep {previous}), got {threads!r}.")
        torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def _deterministic(enabled: bool) -> Iterator[None]:
    """``trainer.deterministic``: torch's deterministic algorithms within the block."""
    if not enabled:
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


# --- small pieces ------------------------------------------------------------------------------------------------
SYNC_DEBUG_ENV = "DDCNN_SYNC_DEBUG"


def sync_debug_mode(device: torch.device) -> str | None:
    """``warn`` or ``error`` from ``$DDCNN_SYNC_DEBUG`` for a CUDA training (``None``: unset, or not CUDA)."""
    mode = os.environ.get(SYNC_DEBUG_ENV, "").strip().lower()
    if mode in ("", "0", "off", "default"):
        return None
    if mode not in ("warn", "error"):
        raise ValueError(f"{SYNC_DEBUG_ENV}={mode!r}: use warn or error (or leave it unset).")
    return mode if torch.device(device).type == "cuda" else None


def _on_training_stream(items: Iterator, device: torch.device) -> Iterator:
    """``(idx, batch)`` of batches made on a side stream (``(idx, (batch, ready event))``), usable on the current
    stream: it waits for the event, and each tensor is recorded as used there."""
    current = torch.cuda.current_stream(device)
    for idx, (batch, ready) in items:
        current.wait_event(ready)
        for tensor in batch:
            tensor.record_stream(current)
        yield idx, batch


def _under_sync_debug(items: Iterator, mode: str) -> Iterator:
    """``items``, with torch's CUDA sync debug mode ``mode`` while the caller works on each one."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield from items
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _compiled_frames() -> int:
    """Frames ``torch.compile`` (dynamo) has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 100_003 + int(epoch))


def shard_order(order: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s share of one epoch's sample order under DDP: every ``world``-th sample, padded by wrapping
    around so that every rank has the same number (as torch's ``DistributedSampler``); the order itself outside.

    The ranks' batches together are then one device's batches, so DDP takes one device's steps (to rounding; tested
    in float64), except that the up to ``world - 1`` wrapped samples count twice in an epoch's last batch when the
    training split does not divide by ``world``, and that dropout draws its masks per rank."""
    if world <= 1:
        return order
    total = -(-len(order) // world) * world
    return torch.cat([order, order[: total - len(order)]])[rank::world]


def _seed_global_rng(seed: int, device: torch.device) -> None:
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def improves(value: float | None, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """The one improvement rule of a training: whether ``value`` of the monitored metric beats the reference ``best``
    by more than ``min_delta`` (absolute, in the metric's units; ``mode`` ``max`` or ``min``). NaN never improves; any
    number improves on no reference (``None``) or a NaN one.

    Selection (the kept epoch is replaced only by an epoch that improves on it), early stopping (it counts the epochs
    since the kept epoch) and ``ReduceLROnPlateau`` (built with ``threshold_mode="abs"``, ``threshold=min_delta``
    and this ``mode``: its test ``value > best + threshold``, ``value < best - threshold``, is this one) use it
    alike. With ``min_delta`` = 0 it is "strictly better": ties keep the earlier epoch, as Lightning's
    ModelCheckpoint.
    """
    if value is None or math.isnan(value):
        return False
    if best is None or math.isnan(best):
        return True
    return value > best + min_delta if mode == "max" else value < best - min_delta


def early_stop_due(epoch: int, best_epoch: int, patience: int | None, min_epochs: int, max_epochs: int) -> bool:
    """Early stopping after ``epoch`` (0-based): ``patience`` epochs have passed since the kept epoch ``best_epoch``
    (the last one that :func:`improves` on the kept one before it; ``-1``: none yet), at least ``min_epochs`` epochs
    have run, and the budget is not over anyway."""
    if patience is None or best_epoch < 0 or epoch >= max_epochs - 1:
        return False
    return epoch - best_epoch >= patience and epoch + 1 >= min_epochs


# The convergence test (docs/protocol.md, "Convergence"): the epochs it needs to judge, the training loss trend it
# reads (the mean of the last 3 epochs against the mean of the 3 before them: one epoch's loss under a constant rate
# moves by tens of percent from batch noise alone), how much that mean may still fall, and how high a scheduled
# learning rate may still be when the budget ends, as a fraction of its start. Below LOSS_FLOOR x ln K (the loss of a
# uniform guess over K classes) the training data are fit almost exactly: a loss falling from 5e-4 to 3e-4 by then
# is no sign of a training that needs more epochs.
JUDGE_EPOCHS = 3
LOSS_WINDOW = 3
LOSS_STILL_FALLING = 0.01
LOSS_FLOOR = 0.01
LR_STILL_HIGH = 0.1


def _loss_trend(losses: list[Any]) -> float | None:
    """The relative change of the mean training loss of the last ``LOSS_WINDOW`` epochs against the mean of the as
    many epochs before them (fewer in a shorter training, at least 1 each); ``None`` when unknown."""
    w = min(LOSS_WINDOW, len(losses) // 2)
    if w < 1 or any(v is None or not math.isfinite(float(v)) for v in losses[-2 * w :]):
        return None
    before = sum(float(v) for v in losses[-2 * w : -w]) / w
    last = sum(float(v) for v in losses[-w:]) / w
    return (last - before) / before if before > 0 else None


def convergence(
    history: list[Mapping[str, Any]],
    stopped_by: str,
    min_epochs: int = 0,
    scheduled: bool = False,
    num_classes: int | None = None,
) -> dict[str, Any]:
    """Whether a training converged, from its per-epoch ``history`` (rows with ``train_loss`` and ``lr``), what ended
    it (``early_stopping``, ``budget``), the epochs early stopping had to wait for and whether its learning rate
    followed a schedule (docs/protocol.md, "Convergence" says why this test).

    Not converged (one short reason each): fewer than 3 epochs (too short to judge); stopped by early stopping before
    ``min_epochs``; ended by the budget with a scheduled learning rate still above 10% of its start; ended by the
    budget at a constant rate while its training loss still fell: the mean of its last 3 epochs more than 1% below
    the mean of the 3 before, and above 1% of ``ln num_classes`` (below it, the training data are fit almost exactly).
    Converged otherwise: early stopping ended it after ``min_epochs``, or the budget ended it with its schedule decayed
    (below 10% of its start) or its loss flat (or near zero) at a constant rate.

    Returns:
        ``{"converged", "reasons", "epochs", "min_epochs", "stopped_by", "lr_ratio", "train_loss_change_last3"}``:
        ``lr_ratio`` is the last epoch's learning rate over the first's, ``train_loss_change_last3`` the relative
        change of the mean training loss of the last 3 epochs against the 3 before them (fewer when shorter;
        ``None`` when unknown).
    """
    epochs = len(history)
    losses = [row.get("train_loss") for row in history]
    change = _loss_trend(losses)
    recent = [float(v) for v in losses[-LOSS_WINDOW:] if v is not None]
    floor = LOSS_FLOOR * math.log(max(int(num_classes), 2)) if num_classes else 0.0
    fit_exactly = bool(recent) and sum(recent) / len(recent) < floor
    lrs = [row.get("lr") for row in history]
    lr_ratio = float(lrs[-1]) / float(lrs[0]) if epochs and None not in (lrs[0], lrs[-1]) and lrs[0] > 0 else None
    reasons = []
    if epochs < JUDGE_EPOCHS:
        reasons.append(f"too short to judge: {epochs} epoch(s), fewer than {JUDGE_EPOCHS}")
    elif stopped_by == "early_stopping" and epochs < min_epochs:
        reasons.append(f"stopped after {epochs} epochs, before min_epochs={min_epochs}")
    elif stopped_by == "budget" and scheduled:
        if lr_ratio is not None and lr_ratio > LR_STILL_HIGH * (1 + 1e-9):
            reasons.append(f"budget ended with the learning rate still at {lr_ratio:.0%} of its start")
    elif stopped_by == "budget" and change is not None and change < -LOSS_STILL_FALLING and not fit_exactly:
        reasons.append(f"budget ended while the training loss still fell ({change:+.1%} over the last 3 epochs)")
    return {
        "converged": not reasons,
        "reasons": reasons,
        "epochs": epochs,
        "min_epochs": int(min_epochs),
        "stopped_by": stopped_by,
        "lr_ratio": lr_ratio,
        "train_loss_change_last3": change,
    }


def convergence_advice(record: Mapping[str, Any], names: Mapping[str, str] | None = None) -> str:
    """What to try for an unconverged training (:func:`convergence`). ``names`` maps ``epochs`` (the budget),
    ``patience`` and ``min_epochs`` to the settings to name (default ``trainer.max_epochs``, ``engine.patience``,
    ``engine.min_epochs``; ``min_epochs`` ``""`` when the training has none) and ``plateau`` to ``""`` where the
    plateau scheduler is not an option."""
    name = {"epochs": "trainer.max_epochs", "patience": "engine.patience", "min_epochs": "engine.min_epochs"}
    name |= {"plateau": "yes", **(names or {})}
    stopped_by, tips = record.get("stopped_by"), []
    if stopped_by == "max_iter":
        tips.append(f"more iterations ({name['epochs']})")
    if stopped_by == "early_stopping" or record.get("epochs", 0) < JUDGE_EPOCHS:
        larger = " or ".join(n for n in (name["patience"], name["min_epochs"]) if n)
        tips.append(f"more epochs ({name['epochs']}), a larger {larger}")
    if stopped_by == "budget":
        if not tips:  # (a too-short training already has "more epochs" above)
            tips.append(f"more epochs ({name['epochs']})")
        if name["plateau"]:
            tips.append(
                f"{name['patience']} with the plateau scheduler (scheduler={{_target_:torch.optim.lr_scheduler."
                f"ReduceLROnPlateau,_partial_:true,patience:0}}) so that the budget adapts"
            )
    return "; ".join(dict.fromkeys(tips)) or f"more epochs ({name['epochs']})"


def _cpu_state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}


def _csv_value(key: str, value: Any) -> Any:
    if value is None:
        return ""
    return int(value) if key in ("epoch", "step") else repr(float(value))


def _loss_dtype(logits: torch.Tensor) -> torch.Tensor:
    """Logits in the dtype the loss is computed in: the network's own (float32; float64 under ``64-true``), float32
    for the float16/bfloat16 outputs of an autocast region."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def _needs_closure(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step`` must be given a closure that re-evaluates the loss (L-BFGS)."""
    return isinstance(opt, torch.optim.LBFGS) or bool(getattr(opt, "needs_closure", False))


def _divergence(loss: float, initial: float | None, num_classes: int, factor: float) -> str | None:
    """Why an epoch with mean training loss ``loss`` diverged (the module doc's rule), or ``None``."""
    if not math.isfinite(loss):
        return f"train_loss {loss}"
    chance = math.log(max(num_classes, 2))
    reference = max(initial, chance) if initial is not None and math.isfinite(initial) else chance
    if loss > factor * reference:
        what = f"initial {initial:.4g}" if reference != chance else f"ln K {chance:.4g}"
        return f"train_loss {loss:.4g} > {factor:g} x {what}"
    return None


def _metrics_csv(history: list[dict[str, float]]) -> str:
    out = io.StringIO()
    extra = list(dict.fromkeys(k for row in history for k in row if k not in METRIC_COLUMNS))
    writer = csv.DictWriter(out, fieldnames=[*METRIC_COLUMNS, *extra], extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: _csv_value(k, v) for k, v in row.items()})
    return out.getvalue()


def _load_checkpoint(path: Path, settings: Mapping[str, Any]) -> dict | None:
    """The resumable state in ``path``, ``None`` when there is none.

    Raises:
        ValueError: For a checkpoint of Lightning's Trainer (older ddcnn) or one written under other settings, with
            what to do.
    """
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("format") not in _RESUMABLE_FORMATS:
        lightning = isinstance(state, dict) and ("pytorch-lightning_version" in state or "state_dict" in state)
        who = "Lightning's Trainer (ddcnn before its one Fabric loop)" if lightning else "another program"
        raise ValueError(
            f"{path} was written by {who}; this ddcnn cannot resume it. Delete {path} and run the same command "
            f"again: this training starts over, finished stages stay finished (or finish it with the ddcnn version "
            f"that started it)."
        )
    saved = state.get("settings", {})
    differ = {k: (saved.get(k), settings.get(k)) for k in _RESUME_SETTINGS if saved.get(k) != settings.get(k)}
    if differ:
        shown = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in differ.items())
        raise ValueError(
            f"{path} belongs to a training with other settings ({shown}); resuming it would not give the result of "
            f"either. Restore those settings to resume, or delete {path} (force=true for a stage) to start over."
        )
    return state


class _Clock:
    """The training clock of one process: from ``start``, plus the earlier processes' time, minus what is left out."""

    def __init__(self, start: float) -> None:
        self.start, self.previous = float(start), 0.0
        self.left_out: dict[str, float] = {"startup": 0.0, "warmup": 0.0, "hook": 0.0, "report": 0.0, "target": 0.0}

    def __call__(self) -> float:
        return self.previous + time.perf_counter() - self.start - sum(self.left_out.values())

    @contextlib.contextmanager
    def outside(self, what: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.left_out[what] += time.perf_counter() - began


# --- the settings of a training and its state -----------------------------------------------------------------------
@dataclass(frozen=True)
class _FitSettings:
    """The settings of one training: :func:`fit_batches`' keywords (see there for each), checked once, here, in the
    order of its signature, and held normalised (numbers as ``int``/``float``, Hydra nodes as plain containers, the
    precision as Fabric's name, ``min_epochs`` ``None`` as 0, ``gpu`` with every policy key). Frozen: nothing
    changes them during the training. Picklable, so that spawned DDP ranks receive them (hooks then must be
    picklable too)."""

    optimizer: Any
    scheduler: Any
    max_epochs: int
    seed: int
    monitor: str
    monitor_mode: str
    checkpoint_every: int
    checkpoint_every_s: float | None
    precision: str
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    accumulate_grad_batches: int
    limit_train_batches: int | float | None
    limit_val_batches: int | float | None
    deterministic: bool
    log_every_n_steps: int | None
    reporter: Reporter | None
    on_epoch_end: Callable[[int, Mapping[str, float]], None] | None
    after_epoch: Callable[[int, Mapping[str, float], nn.Module], Mapping[str, float] | None] | None
    divergence_restarts: int | None
    divergence_factor: float
    divergence_lr_factor: float
    patience: int | None
    min_delta: float
    min_epochs: int
    write_best: bool
    gpu: Mapping[str, Any]

    def __post_init__(self) -> None:
        """Refuse a bad setting, naming it, its value and what would work (the settings a run's configuration also
        gives are checked by the same :func:`~ddcnn.settings.fit.loop_setting`); hold the normalised values."""
        normalised = {key: loop_setting(key, getattr(self, key)) for key in LOOP_SETTINGS}
        if int(self.checkpoint_every) < 1:
            raise ValueError(
                f"checkpoint_every must be >= 1 (epochs between checkpoints), got {self.checkpoint_every!r}."
            )
        least = self.min_epochs
        if least is not None and (isinstance(least, bool) or int(least) < 0):
            raise ValueError(f"min_epochs must be a whole number of epochs >= 0 (or null: 0), got {least!r}.")
        restarts = self.divergence_restarts
        if restarts is not None and int(restarts) < 0:
            raise ValueError(f"divergence_restarts must be >= 0 or null (no check), got {restarts!r}.")
        if float(self.divergence_factor) <= 1.0:
            raise ValueError(f"divergence_factor must be > 1, got {self.divergence_factor!r}.")
        if not 0.0 < float(self.divergence_lr_factor) < 1.0:
            raise ValueError(
                f"divergence_lr_factor must lie strictly between 0 and 1, got {self.divergence_lr_factor!r}."
            )
        check_schedule(
            self.scheduler,
            patience=normalised["patience"],
            monitor_mode=normalised["monitor_mode"],
            min_delta=normalised["min_delta"],
            refuse_fixed=False,
            names={"patience": "patience", "monitor_mode": "monitor_mode", "min_delta": "min_delta"},
        )
        unknown = sorted(set(self.gpu or {}) - set(POLICY_OFF))
        if unknown:
            raise ValueError(f"gpu settings {unknown} are not ones the loop knows; it knows {', '.join(POLICY_OFF)}.")
        gpu = {**POLICY_OFF, **(self.gpu or {})}
        if int(gpu["profile_steps"]) < 0:
            raise ValueError(f"profile_steps must be >= 0 (0: no profile), got {gpu['profile_steps']!r}.")
        normalised |= {
            "optimizer": _spec(self.optimizer),
            "scheduler": _spec(self.scheduler),
            "seed": int(self.seed),
            "checkpoint_every": int(self.checkpoint_every),
            "deterministic": bool(self.deterministic),
            "divergence_restarts": None if restarts is None else int(restarts),
            "divergence_factor": float(self.divergence_factor),
            "divergence_lr_factor": float(self.divergence_lr_factor),
            "min_epochs": int(least or 0),
            "write_best": bool(self.write_best),
            "gpu": gpu,
        }
        for key, value in normalised.items():
            object.__setattr__(self, key, value)


# last.ckpt: its keys, in the order TrainState.state_dict writes them and TrainState.load_state_dict reads them back.
# A resume reads the keys of _LATER_KEYS with these defaults: a checkpoint of an older ddcnn may lack them.
CHECKPOINT_KEYS = (
    "format",
    "epoch",
    "settings",
    "net",
    "optimizer",
    "scheduler",
    "precision_state",
    "best",
    "history",
    "fit_time_s",
    "resumed_from",
    "restarts",
    "lr_scale",
    "initial_loss",
    "num_classes",
    "initial_state",
    "stopped_epoch",
)
_LATER_KEYS: dict[str, Any] = {
    "scheduler": None,
    "precision_state": None,
    "resumed_from": [],
    "restarts": [],
    "lr_scale": 1.0,
    "initial_loss": None,
    "num_classes": 2,
    "initial_state": None,
    "stopped_epoch": None,
}


@dataclass
class TrainState:
    """What one training carries from epoch to epoch: with its stateful objects (the network, the optimizer, the
    schedule, Fabric's precision plugin with the loss scaler), everything an exact resume needs. Saved whole by
    :meth:`state_dict` and restored whole by :meth:`load_state_dict`, the one pair that knows the keys of
    ``last.ckpt`` (:data:`CHECKPOINT_KEYS`).

    Attributes:
        clock: The training clock (the time of earlier processes is in ``last.ckpt``).
        epoch: The next epoch to train (0-based); ``last.ckpt`` records the last finished one.
        step: Optimizer steps so far (in the current attempt).
        history: Per finished epoch, its row of ``logs/metrics.csv``.
        best_epoch: The kept epoch (the last one that improved), ``-1`` before the first.
        best_metric: Its monitored metric.
        best_net: Its weights (on the CPU).
        restarts: One entry per divergence restart: ``{"epoch", "reason", "lr_scale"}``.
        lr_scale: What the current attempt multiplies the learning rates by.
        initial_loss: The first training batch's loss before the first step (of the current attempt).
        num_classes: The number of the network's outputs, for the divergence rule's ``ln K``.
        initial_net: The weights a restart starts from (on the CPU): the network's at the start of the training.
        save_initial: Whether ``last.ckpt`` keeps them (where divergence is checked); otherwise a resumed process
            restarts from the weights the stage built, those of the same seed.
        stopped_epoch: The epoch after which early stopping ended the training.
        resumed_from: The last finished epoch of each checkpoint this training resumed from.
    """

    clock: _Clock
    epoch: int = 0
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    best_epoch: int = -1
    best_metric: float | None = None
    best_net: dict[str, torch.Tensor] | None = None
    restarts: list[dict] = field(default_factory=list)
    lr_scale: float = 1.0
    initial_loss: float | None = None
    num_classes: int = 2
    initial_net: dict[str, torch.Tensor] | None = None
    save_initial: bool = True
    stopped_epoch: int | None = None
    resumed_from: list[int] = field(default_factory=list)

    def finished(self, max_epochs: int) -> bool:
        return self.epoch >= max_epochs or self.stopped_epoch is not None

    def state_dict(self, stateful: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
        """``last.ckpt``'s content: this state, the state of the objects in ``stateful`` (:meth:`_Training.stateful`)
        and the ``settings`` a resume must agree on (:func:`_load_checkpoint`)."""
        scheduler = stateful["scheduler"]
        values = {
            "format": CHECKPOINT_FORMAT,
            "epoch": self.epoch - 1,
            "settings": settings,
            "net": _cpu_state(stateful["net"]),
            "optimizer": stateful["optimizer"].state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "precision_state": stateful["precision_state"].state_dict(),
            "best": {
                "epoch": self.best_epoch,
                "metric": self.best_metric,
                "monitor": settings["monitor"],
                "net": self.best_net,
            },
            "history": self.history,
            "fit_time_s": self.clock(),
            "resumed_from": self.resumed_from,
            "restarts": self.restarts,
            "lr_scale": self.lr_scale,
            "initial_loss": self.initial_loss,
            "num_classes": self.num_classes,
            "initial_state": self.initial_net if self.save_initial else None,
            "stopped_epoch": self.stopped_epoch,
        }
        return {key: values[key] for key in CHECKPOINT_KEYS}

    def load_state_dict(self, checkpoint: Mapping[str, Any], stateful: Mapping[str, Any]) -> None:
        """Restore this state and the objects in ``stateful`` from ``checkpoint`` (a :meth:`state_dict`).

        The optimizer's state brings its learning rates (those of the attempt it was in) and the schedule's its own,
        so they may have been built with any learning-rate scale."""
        missing = [key for key in CHECKPOINT_KEYS if key not in checkpoint and key not in _LATER_KEYS]
        if missing:
            raise ValueError(
                f"the checkpoint lacks {missing}: it is damaged. Delete it (last.ckpt; force=true for a stage) to "
                f"start this training over."
            )
        saved = {key: checkpoint[key] if key in checkpoint else _LATER_KEYS[key] for key in CHECKPOINT_KEYS}
        stateful["net"].load_state_dict(saved["net"])
        stateful["optimizer"].load_state_dict(saved["optimizer"])
        if stateful["scheduler"] is not None and saved["scheduler"] is not None:
            stateful["scheduler"].load_state_dict(saved["scheduler"])
        if saved["precision_state"]:
            stateful["precision_state"].load_state_dict(saved["precision_state"])
        self.epoch, self.clock.previous = int(saved["epoch"]) + 1, float(saved["fit_time_s"])
        self.history = list(saved["history"])
        self.step = int(self.history[-1]["step"]) if self.history else 0
        best = saved["best"]
        self.best_net, self.best_metric, self.best_epoch = best["net"], best["metric"], best["epoch"]
        self.resumed_from = [*saved["resumed_from"], int(saved["epoch"])]
        self.restarts, self.lr_scale = list(saved["restarts"]), float(saved["lr_scale"])
        self.initial_loss, self.num_classes = saved["initial_loss"], int(saved["num_classes"])
        self.stopped_epoch = saved["stopped_epoch"]
        if saved["initial_state"] is not None:
            self.initial_net = saved["initial_state"]

    def add(self, row: dict[str, float]) -> None:
        """A finished epoch's row."""
        self.history.append(row)
        self.epoch += 1

    def restart(self, epoch: int, reason: str, lr_factor: float) -> None:
        """A new attempt after ``epoch`` diverged: from epoch 0, with the learning rates times ``lr_factor`` once
        more (the network and the optimizer are the caller's)."""
        self.lr_scale *= lr_factor
        self.restarts.append({"epoch": epoch, "reason": reason, "lr_scale": self.lr_scale})
        self.history, self.best_net, self.best_metric, self.best_epoch = [], None, None, -1
        self.step, self.initial_loss, self.epoch = 0, None, 0


# --- the loop -----------------------------------------------------------------------------------------------------
class _Training:
    """One training: :func:`fit_batches`' settings, network, data and folder; :meth:`run` trains it in one rank
    (every rank under DDP). Picklable, so that spawned DDP ranks receive it whole.

    Its steps, in the order of an epoch (:meth:`fit_epoch`): :meth:`train_epoch`, :meth:`restart` after a
    divergence, :meth:`validate`, :meth:`run_after_epoch` (the stage's hook), :meth:`select`,
    :meth:`step_scheduler`, :meth:`checkpoint_due`, :meth:`decide_stop`, :meth:`save`, :meth:`report` and the
    ``on_epoch_end`` hook."""

    # Set by run(), from the data and the device: the batches of an epoch and of a validation (this rank's), where
    # the data are placed, the network on the device (module: plain; model: as Fabric set it up) and its optimizer.
    n_train: int
    batch: int
    train_batches: int
    eval_batch_size: int
    val_batches: int
    prefetch: bool
    policy: dict[str, Any]
    format: torch.memory_format
    net_dtype: torch.dtype
    fabric: Any
    module: nn.Module
    model: nn.Module
    raw_opt: torch.optim.Optimizer
    opt: torch.optim.Optimizer
    sched: Any
    closure_steps: bool
    resume_settings: dict[str, Any]
    last_write: float

    def __init__(
        self, settings: _FitSettings, net: nn.Module, data: Batches, folder: str, start: float, threads: int | None
    ) -> None:
        self.settings, self.net, self.data, self.folder = settings, net, data, folder
        # The clock's start (perf_counter), the CPU threads of a spawned rank, and the start-up left out of the clock.
        self.start, self.threads, self.startup_s = start, threads, 0.0

    # -- the network on the device: the one place where it is set up --
    def setup(self, fabric) -> None:
        net = self.net
        if fabric.world_size > 1 and has_batch_norm(net):
            # DDP normalises over the global batch, as the one-device run does: exact DDP (see ddcnn.engine.sync_norm).
            net = convert_batch_norm(net, fabric.device)
        if self.policy["channels_last"]:
            net = net.to(memory_format=memory_format(self.policy))
        self.module = net
        # Fabric unwraps a compiled module, sets it up and compiles it again; evaluation runs the plain module.
        self.model = fabric.setup_module(torch.compile(net) if self.policy["compile"] else net)
        self.fabric = fabric

    def train_batch(self, idx: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb, yb = self.data.train_batch(idx, epoch, self.fabric.device)
        return (xb.contiguous(memory_format=self.format) if self.policy["channels_last"] else xb), yb

    def eval_batch(self, split: str, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xb, yb = self.data.eval_batch(split, idx, self.fabric.device)
        if self.settings.precision == "64-true" and xb.is_floating_point():  # evaluation runs the plain module
            xb = xb.double()
        return (xb.contiguous(memory_format=self.format) if self.policy["channels_last"] else xb), yb

    def batches_ahead(self, batches: list[torch.Tensor], epoch: int) -> Iterator[tuple[torch.Tensor, tuple]]:
        """``(idx, batch)`` of this epoch's training batches, the next one read by a background thread while this
        one trains when the batches stream from pinned host memory to a GPU (``prefetch``). On CUDA with
        ``DDCNN_SYNC_DEBUG`` set (``warn`` or ``error``), torch's sync debug mode is on while they are read and
        trained on (every step of the epoch, nothing after it): a host synchronisation there warns or fails.

        Streamed to a GPU, each batch is copied (and decoded) on a side stream, so that its copy overlaps the current
        batch's computation; the training stream waits for it (an event, no host synchronisation) and the batch's
        memory is marked as used there, so the allocator does not hand it out early."""
        device = self.fabric.device
        side = torch.cuda.Stream(device) if self.prefetch and device.type == "cuda" else None

        def fetch(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                if side is None:
                    return self.train_batch(idx, epoch)
                with torch.cuda.stream(side):
                    batch = self.train_batch(idx, epoch)
                    ready = torch.cuda.Event()
                    ready.record(side)
                return batch, ready

        items = prefetched(fetch, batches, self.prefetch)
        if side is not None:
            items = _on_training_stream(items, device)
        mode = sync_debug_mode(device)
        return items if mode is None else _under_sync_debug(items, mode)

    def build_optimizer(self, lr_scale: float) -> None:
        s = self.settings
        spec = amp_optimizer(_spec(s.optimizer), self.fabric.device, s.precision, s.gradient_clip_val)
        opt = build_optimizer(spec, self.module.parameters())
        if lr_scale != 1.0:
            for group in opt.param_groups:
                group["lr"] = float(group["lr"]) * lr_scale
                if "initial_lr" in group:
                    group["initial_lr"] = float(group["initial_lr"]) * lr_scale
        self.raw_opt = opt
        rule = {"mode": s.monitor_mode, "threshold_mode": "abs", "threshold": s.min_delta}
        self.sched = build_scheduler(s.scheduler, opt, s.max_epochs, plateau=rule)
        if isinstance(self.sched, torch.optim.lr_scheduler.ReduceLROnPlateau):  # also one a Python factory built
            built = {key: getattr(self.sched, key) for key in rule}
            if built != rule:
                raise ValueError(
                    f"the ReduceLROnPlateau scheduler counts an improvement by {built}, the loop's rule (selection, "
                    f"early stopping) by {rule}: build it with those arguments (or pass it as a Hydra node, which "
                    f"gets them)."
                )
            if s.patience is not None and s.patience < self.sched.patience + 2:
                raise ValueError(
                    f"patience={s.patience} with a ReduceLROnPlateau of patience {self.sched.patience}: early "
                    f"stopping needs patience >= {self.sched.patience + 2}."
                )
        self.opt = self.fabric.setup_optimizers(opt)
        self.closure_steps = _needs_closure(opt)
        if self.closure_steps and s.accumulate_grad_batches > 1:
            raise ValueError(
                f"{type(opt).__name__} steps with a closure over one batch; it cannot accumulate gradients over "
                f"{s.accumulate_grad_batches} batches: set trainer.accumulate_grad_batches=1 (or null)."
            )
        if self.closure_steps and s.precision == "16-mixed":
            raise ValueError(
                f"{type(opt).__name__} cannot step through a float16 loss scaler: use trainer.precision=32-true or "
                f"bf16-mixed for it."
            )

    @property
    def stateful(self) -> dict[str, Any]:
        """The objects whose state ``last.ckpt`` holds, by their key there (:class:`TrainState`)."""
        precision = self.fabric.strategy.precision
        return {"net": self.module, "optimizer": self.raw_opt, "scheduler": self.sched, "precision_state": precision}

    def clip(self) -> None:
        s = self.settings
        if s.gradient_clip_val is None:
            return
        if s.gradient_clip_algorithm == "value":
            self.fabric.clip_gradients(self.model, self.opt, clip_val=s.gradient_clip_val)
        else:
            self.fabric.clip_gradients(self.model, self.opt, max_norm=s.gradient_clip_val, error_if_nonfinite=False)

    def no_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled and self.fabric.world_size > 1:
            return self.fabric.no_backward_sync(self.model)
        return contextlib.nullcontext()

    # -- one training step: the one step function --
    def train_step(self, xb: torch.Tensor, yb: torch.Tensor, stepping: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one batch, then (``stepping``) the optimizer step; its loss and logits before
        the step."""
        fabric, model, opt = self.fabric, self.model, self.opt
        if self.closure_steps:
            first: list[tuple[torch.Tensor, torch.Tensor]] = []

            def closure() -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                logits = model(xb)
                loss = F.cross_entropy(_loss_dtype(logits), yb)
                fabric.backward(loss)
                self.clip()
                if not first:
                    first.append((loss.detach(), logits.detach()))
                return loss

            opt.step(closure)
            return first[0]
        accumulate = self.settings.accumulate_grad_batches
        with self.no_sync(not stepping):
            logits = model(xb)
            loss = F.cross_entropy(_loss_dtype(logits), yb)
            fabric.backward(loss / accumulate if accumulate > 1 else loss)
        if stepping:
            self.clip()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach(), logits.detach()

    @torch.inference_mode()
    def evaluate(self, split: str = "val") -> torch.Tensor:
        """``(loss sum, correct, count)`` over this rank's share of ``split`` (every world-th sample)."""
        fabric, module = self.fabric, self.module
        module.eval()
        sums = torch.zeros(3, device=fabric.device, dtype=torch.float64)
        idx = torch.arange(fabric.global_rank, self.data.size(split), fabric.world_size, device=self.index_device)
        for k, chunk in enumerate(idx.split(self.eval_batch_size)):
            if k >= self.val_batches:
                break
            xb, yb = self.eval_batch(split, chunk)
            with fabric.autocast():
                logits = module(xb)
            sums[0] += F.cross_entropy(_loss_dtype(logits), yb, reduction="sum").double()
            sums[1] += (logits.argmax(-1) == yb).sum()
            sums[2] += len(yb)
        if fabric.world_size > 1:
            sums = fabric.all_reduce(sums, reduce_op="sum")
        return sums

    @property
    def index_device(self) -> torch.device:
        """Where the data cut their batches (``Batches.index_device``: the device for data held there, else the
        CPU): the sample indices live there, so that cutting a batch copies nothing between host and device."""
        return torch.device(getattr(self.data, "index_device", None) or "cpu")

    def epoch_batches(self, epoch: int) -> list[torch.Tensor]:
        """The sample indices of this rank's training batches in ``epoch``, and seeds the global generators.

        The order is drawn on the CPU (the same permutation on every device) and moved where the data cut their
        batches once per epoch, in one copy; the batches are views of it."""
        gen = _epoch_generator(self.settings.seed, epoch)
        order = torch.randperm(self.n_train, generator=gen) if self.batch < self.n_train else torch.arange(self.n_train)
        order = shard_order(order, self.fabric.global_rank, self.fabric.world_size)
        _seed_global_rng(int(torch.randint(2**62, (1,), generator=gen)), self.fabric.device)
        order = order[: self.train_batches * self.batch]
        if self.index_device.type != "cpu":
            order = order.pin_memory().to(self.index_device, non_blocking=True)
        return list(order.split(self.batch))

    def warm_up(self, epoch: int) -> None:
        """A training step's forward and backward for every batch shape of the epoch (the full batch and a partial
        last one) and an evaluation batch of every shape validation uses, which leave no trace: no optimizer step,
        gradients cleared, buffers (batch-norm statistics) and generators restored. The device's first-use costs
        (CUDA context, cuDNN handles, kernels, allocator; oneDNN primitives on CPU), cuDNN's autotuning of each shape
        and, with ``compile``, the compilation of each shape are then paid here, outside the clock, by every training
        alike, whichever process or calibration used the device before."""
        fabric, module = self.fabric, self.module
        saved = [b.detach().clone() for b in module.buffers()]
        devices = [fabric.device] if fabric.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            batches = self.epoch_batches(epoch)
            shapes = {len(idx): idx for idx in reversed(batches)}  # one batch per size (the first of each)
            self.model.train()
            for idx in reversed(shapes.values()):
                xb, yb = self.train_batch(idx, epoch)
                with self.no_sync(True):
                    loss = F.cross_entropy(_loss_dtype(self.model(xb)), yb)
                    fabric.backward(loss)
                self.opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for buffer, value in zip(module.buffers(), saved, strict=True):
                    buffer.copy_(value)
            with torch.inference_mode(), fabric.autocast():
                module.eval()
                idx = torch.arange(
                    fabric.global_rank, self.data.size("val"), fabric.world_size, device=self.index_device
                )
                chunks = list(idx.split(self.eval_batch_size))[: self.val_batches]
                for chunk in {len(chunk): chunk for chunk in reversed(chunks)}.values():
                    module(self.eval_batch("val", chunk)[0])
        if fabric.device.type == "cuda":
            torch.cuda.synchronize(fabric.device)

    # -- the training, start to end --
    def run(self, fabric, prefit_s: float | None = None) -> FitResult:
        """Train in this rank (see :func:`fit_batches`); ``prefit_s``: a spawned rank's share of the parent's time."""
        status = "failed"
        data = self.data
        try:
            result = self._run(fabric, prefit_s)
            status = "success"
            return result
        finally:
            self.data = data  # the placed view goes; the device copy of the splits is the process's (datamodule)
            if self.settings.reporter is not None and fabric.global_rank == 0:
                self.settings.reporter.close(status)

    def _run(self, fabric, prefit_s: float | None) -> FitResult:
        """Plan the batches, place data and network, start or resume, train, hand back the kept weights."""
        clock = self.start_clock(prefit_s)
        self.plan(fabric.world_size)
        engine = self.place(fabric, clock)
        state = self.start_or_resume(clock)
        first_epoch = state.epoch
        compile_time_s = self.fit(state, engine)
        return self.finish(state, engine, first_epoch, compile_time_s)

    def start_clock(self, prefit_s: float | None) -> _Clock:
        """The training clock, from the caller's start (a spawned DDP rank: from now, plus the parent's set-up of the
        training), the start-up already left out."""
        if prefit_s is not None:
            self.start = time.perf_counter() - prefit_s
            if self.threads is not None:
                torch.set_num_threads(self.threads)
        clock = _Clock(self.start)
        clock.left_out["startup"] = self.startup_s
        return clock

    def plan(self, world: int) -> None:
        """The batches of an epoch and of a validation in this rank, and the settings a resume must agree on."""
        s = self.settings
        self.n_train = self.data.size("train")
        self.batch = min(int(self.data.batch_size), self.n_train)
        per_rank = -(-self.n_train // world)
        self.train_batches = num_batches(-(-per_rank // self.batch), s.limit_train_batches, "limit_train_batches")
        self.eval_batch_size = int(self.data.eval_batch_size)
        per_rank_val = -(-self.data.size("val") // world)
        self.val_batches = num_batches(
            -(-per_rank_val // self.eval_batch_size), s.limit_val_batches, "limit_val_batches"
        )
        if self.val_batches == 0 and s.monitor.startswith("val_"):
            raise ValueError(
                f"limit_val_batches={s.limit_val_batches!r} skips validation, so monitor={s.monitor} has nothing "
                f"to select on: monitor train_loss (mode min) or train_acc (max), or validate."
            )
        recorded = {
            "seed": int(s.seed),
            "batch_size": self.batch,
            "max_epochs": s.max_epochs,
            "monitor": s.monitor,
            "monitor_mode": s.monitor_mode,
            "n_train": self.n_train,
        }
        optional = {  # recorded only where set, so that checkpoints written before they existed still resume
            "limit_train_batches": s.limit_train_batches,
            "limit_val_batches": s.limit_val_batches,
            "divergence_restarts": s.divergence_restarts,
            "patience": s.patience,
            "min_delta": s.min_delta or None,
            "min_epochs": s.min_epochs if s.patience is not None and s.min_epochs > 0 else None,
            "world_size": world if world > 1 else None,
            "precision": s.precision if s.precision != "32-true" else None,
            "accumulate_grad_batches": s.accumulate_grad_batches if s.accumulate_grad_batches > 1 else None,
        }
        self.resume_settings = recorded | {k: v for k, v in optional.items() if v is not None}

    def place(self, fabric, clock: _Clock) -> dict[str, Any]:
        """The data and the network on the device, under the GPU policy; the policy used (``FitResult.engine``)."""
        gpu = self.settings.gpu
        reset_peak_memory(fabric.device)
        # Where the batches come from: the stored splits on the device when they fit, else pinned host memory
        # (CUDA) with the next batch prefetched. Inside the clock: the streamed path pays its copies there too.
        self.data, placement = place_data(self.data, fabric.device, gpu["data_on_device"], gpu["device_data_fraction"])
        self.prefetch = placement == "pinned"
        with clock.outside("warmup"):  # the network on the device (the first use of a device pays for its context)
            # A 2D convnet's weights are 4D as its inputs are (5D: 3D); anything else has no channels-last format.
            weight_dims = max((p.dim() for p in self.net.parameters()), default=0)
            self.net_dtype = next((p.dtype for p in self.net.parameters() if p.is_floating_point()), torch.float32)
            self.policy = resolve_policy(
                fabric.device,
                deterministic=self.settings.deterministic,
                channels_last=gpu["channels_last"],
                tf32=gpu["tf32"],
                cudnn_benchmark=gpu["cudnn_benchmark"],
                compile=gpu["compile"],
                input_dims=weight_dims,
            )
            self.format = memory_format(self.policy)
            self.setup(fabric)
        return {
            **self.policy,
            "data_on_device": placement == "device",
            "data_placement": placement,
            "prefetch": self.prefetch,
            "profile_steps": int(gpu["profile_steps"]),
        }

    def start_or_resume(self, clock: _Clock) -> TrainState:
        """A fresh state (the outputs of an earlier training of this folder removed), or the one of ``last.ckpt``,
        with the optimizer built."""
        folder = Path(self.folder)
        last = folder / "last.ckpt"
        checked = self.settings.divergence_restarts is not None
        # a restart starts from the initial weights (also for non-finite weights where divergence is not checked)
        state = TrainState(clock=clock, initial_net=_cpu_state(self.module), save_initial=checked)
        checkpoint = _load_checkpoint(last, self.resume_settings)
        self.build_optimizer(state.lr_scale)  # a resumed optimizer's state brings its attempt's learning rates
        rank = self.fabric.global_rank
        if checkpoint is None:
            if rank == 0:  # outputs of an earlier training of this folder (force=true) must not pass for this one's
                (folder / "logs" / "metrics.csv").unlink(missing_ok=True)
                (folder / "best.ckpt").unlink(missing_ok=True)
            return state
        state.load_state_dict(checkpoint, self.stateful)
        if rank == 0:
            log.info("%s: resuming from %s (after epoch %d)", folder, last, checkpoint["epoch"])
        return state

    def fit(self, state: TrainState, engine: dict[str, Any]) -> float | None:
        """Train the epochs left (after the warm-up, outside the clock), under the training's generators (restored
        afterwards), deterministic algorithms, math flags and profiler; the compile time of the warm-up, if any."""
        s, fabric, clock = self.settings, self.fabric, state.clock
        devices = [fabric.device] if fabric.device.type == "cuda" else []
        steps = s.gpu["profile_steps"] if fabric.global_rank == 0 else 0
        profile = profiled(steps, Path(self.folder) / "profile" / "trace.json", fabric.device)
        compile_time_s = None
        self.last_write = time.perf_counter()
        with (
            torch.random.fork_rng(devices=devices),
            _deterministic(s.deterministic),
            math_flags(self.policy, fabric.device),
            contextlib.closing(profile),
        ):
            if not state.finished(s.max_epochs):
                began_warmup = time.perf_counter()
                with clock.outside("warmup"):
                    self.warm_up(state.epoch)
                if self.policy["compile"]:  # the first training and evaluation passes compile the network
                    compile_time_s = time.perf_counter() - began_warmup
            compiled_before = _compiled_frames() if self.policy["compile"] else None
            while not state.finished(s.max_epochs):
                self.fit_epoch(state, profile)
            if compiled_before is not None:  # compilations inside the clock: a shape the warm-up did not cover
                engine["compile_recompiles"] = _compiled_frames() - compiled_before
        return compile_time_s

    def fit_epoch(self, state: TrainState, profile) -> None:
        """One epoch: train; after a divergence, restart; else validate, hand the row to the hooks, select, step the
        schedule, decide on stopping and checkpointing, report."""
        epoch, lr = state.epoch, float(self.raw_opt.param_groups[0]["lr"])
        sums, points = self.train_epoch(state, profile)
        train_loss = float(sums[0] / sums[2])
        reason = self.divergence(state, train_loss)
        if reason is not None:
            self.restart(state, epoch, reason)
            return
        row = self.validate(epoch, lr, state.step, sums, state.clock)
        if not math.isfinite(row["val_loss"] or 0.0):
            self.restart(state, epoch, f"val_loss {row['val_loss']}: the weights after the epoch are not finite")
            return
        self.run_after_epoch(row, state.clock)
        state.add(row)
        self.select(state, row)
        self.step_scheduler(row)
        due = self.checkpoint_due(epoch)
        self.decide_stop(state, epoch)
        if due or state.finished(self.settings.max_epochs):
            if self.fabric.global_rank == 0:
                self.save(state)
            self.last_write = time.perf_counter()
        self.report(state.clock, epoch, row, points)
        if self.settings.on_epoch_end is not None:
            self.settings.on_epoch_end(epoch, row)

    def train_epoch(self, state: TrainState, profile) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """One pass over this rank's batches of ``state.epoch``: ``(loss sum, correct, count)`` over every rank, and
        the mean loss of every ``log_every_n_steps`` steps for the reporter. The first epoch of an attempt records
        the initial loss (under DDP the global first batch's) and the number of classes."""
        s, fabric, world = self.settings, self.fabric, self.fabric.world_size
        batches = self.epoch_batches(state.epoch)
        self.model.train()
        sums = torch.zeros(3, device=fabric.device, dtype=torch.float64)
        window, points = [], []
        report = s.reporter if fabric.global_rank == 0 else None
        log_steps = bool(s.log_every_n_steps and report is not None and getattr(report, "wants_steps", True))
        first = None  # the first batch's loss, read after the epoch's steps: no host sync among them
        for k, (_, (xb, yb)) in enumerate(self.batches_ahead(batches, state.epoch)):
            stepping = (k + 1) % s.accumulate_grad_batches == 0 or k == len(batches) - 1
            loss, logits = self.train_step(xb, yb, stepping)
            profile.step()
            if state.initial_loss is None and first is None:
                first = fabric.all_reduce(loss.clone(), reduce_op="mean") if world > 1 else loss
                state.num_classes = int(logits.shape[-1])
            sums[0] += loss.double() * len(yb)
            sums[1] += (logits.argmax(-1) == yb).sum()
            sums[2] += len(yb)
            if stepping:
                state.step += 1
                if log_steps:
                    window.append(loss)
                    if state.step % s.log_every_n_steps == 0:
                        points.append((state.step, torch.stack(window).float().mean()))
                        window = []
        if world > 1:
            sums = fabric.all_reduce(sums, reduce_op="sum")
        if first is not None:
            state.initial_loss = float(first)
        return sums, points

    def divergence(self, state: TrainState, train_loss: float) -> str | None:
        """Why the epoch with mean training loss ``train_loss`` diverged, ``None`` if it did not (or unchecked)."""
        s = self.settings
        if s.divergence_restarts is None:
            return None
        return _divergence(train_loss, state.initial_loss, state.num_classes, s.divergence_factor)

    def restart(self, state: TrainState, epoch: int, reason: str) -> None:
        """Start again from the initial weights with lower learning rates, or raise :class:`Diverged` when no
        restart is left. Weights that are not finite (a validation loss that is not) start again even where
        divergence is not checked (``divergence_restarts`` null), at most :data:`NOT_FINITE_RETRIES` times and then
        at the same rates: the same attempt again, whose draws are those of ``(seed, epoch)``, so only a kernel's
        occasional fault differs."""
        s = self.settings
        where = f"the training in {Path(self.folder)} diverged in epoch {epoch} ({reason})"
        checked = s.divergence_restarts is not None
        allowed = int(s.divergence_restarts) if checked else NOT_FINITE_RETRIES
        if len(state.restarts) >= allowed:
            advice = "Lower the learning rate (or scale the inputs), then run again with force=true."
            if not checked:  # the same attempt failed alike every time
                advice = (
                    "The same training, at the same learning rates, left weights that are not finite every time: a "
                    "learning rate too high (lower it) or a numerical fault of a kernel (torch 2.14's oneDNN 3D "
                    "convolution on the CPU, for kernels as large as the sub-domain: larger sub-domains, more overlap "
                    "or a smaller stem). Then run again with force=true."
                )
            raise Diverged(
                f"{where}, after {len(state.restarts)} restart(s)"
                + (" with lower learning rates" if checked else "")
                + f". {advice}",
                epoch,
                reason,
            )
        state.restart(epoch, reason, s.divergence_lr_factor if checked else 1.0)
        if self.fabric.global_rank == 0:
            log.warning("%s: restarting from the initial weights with the learning rate x %g", where, state.lr_scale)
        self.module.load_state_dict(state.initial_net)
        self.build_optimizer(state.lr_scale)

    def validate(self, epoch: int, lr: float, step: int, sums: torch.Tensor, clock: _Clock) -> dict[str, float]:
        """The epoch's row of ``logs/metrics.csv``: its training sums ``sums`` and the validation's metrics."""
        if self.val_batches:
            val = self.evaluate("val")
            val_loss, val_acc = float(val[0] / val[2]), float(val[1] / val[2])
        else:
            val_loss = val_acc = None
        return {
            "epoch": epoch,
            "step": step,
            "lr": lr,
            "train_loss": float(sums[0] / sums[2]),
            "train_acc": float(sums[1] / sums[2]),
            "val_loss": val_loss,
            "val_acc": val_acc,
            "time_s": clock(),
            **self.target_metrics(clock),
        }

    def target_metrics(self, clock: _Clock) -> dict[str, float]:
        """``val_target_acc``: the accuracy on the held-out target split where the data have one
        (``data.val_target_fraction``), outside the clock: a measurement for the fixed targets, never a choice."""
        if not self.val_batches or TARGET_SPLIT not in data_splits(self.data):
            return {}
        with clock.outside("target"):
            sums = self.evaluate(TARGET_SPLIT)
        return {"val_target_acc": float(sums[1] / sums[2])}

    def run_after_epoch(self, row: dict[str, float], clock: _Clock) -> None:
        """The stage's ``after_epoch`` hook (rank 0, outside the clock): the metrics it returns join ``row``."""
        hook, fabric = self.settings.after_epoch, self.fabric
        if hook is None:
            return
        with clock.outside("hook"):
            extra = None
            if fabric.global_rank == 0:
                self.module.eval()
                extra = hook(row["epoch"], dict(row), self.module)
            if fabric.world_size > 1:
                extra = fabric.broadcast(extra, src=0)
            row.update({k: v for k, v in (extra or {}).items() if k not in row})

    def select(self, state: TrainState, row: Mapping[str, float]) -> None:
        """Keep this epoch's weights when its monitored metric improves on the kept epoch's (:func:`improves`)."""
        s = self.settings
        if improves(row[s.monitor], state.best_metric, s.monitor_mode, s.min_delta):
            state.best_net, state.best_metric, state.best_epoch = _cpu_state(self.module), row[s.monitor], row["epoch"]

    def step_scheduler(self, row: Mapping[str, float]) -> None:
        if self.sched is None:
            return
        if isinstance(self.sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.sched.step(row[self.settings.monitor])
        else:
            self.sched.step()

    def checkpoint_due(self, epoch: int) -> bool:
        """Whether the cadence (``checkpoint_every_s`` or ``checkpoint_every``) asks for a checkpoint after ``epoch``;
        every rank follows rank 0's clock."""
        s = self.settings
        if s.checkpoint_every_s is not None:
            due = time.perf_counter() - self.last_write >= s.checkpoint_every_s
        else:
            due = (epoch + 1) % s.checkpoint_every == 0
        if self.fabric.world_size > 1:
            due = bool(self.fabric.broadcast(due, src=0))
        return due

    def decide_stop(self, state: TrainState, epoch: int) -> None:
        """Early stopping after ``epoch`` (:func:`early_stop_due`): the same on every rank (the monitored metric is
        the all-reduced one)."""
        s = self.settings
        if not early_stop_due(epoch, state.best_epoch, s.patience, s.min_epochs, s.max_epochs):
            return
        state.stopped_epoch = epoch
        if self.fabric.global_rank == 0:
            log.debug(
                "%s: no improvement of %s by more than %g for %d epochs, stopping after epoch %d",
                Path(self.folder),
                s.monitor,
                s.min_delta,
                s.patience,
                epoch,
            )

    def save(self, state: TrainState) -> None:
        """``last.ckpt`` and ``logs/metrics.csv``, atomically (rank 0)."""
        folder = Path(self.folder)
        atomic_torch_save(state.state_dict(self.stateful, self.resume_settings), folder / "last.ckpt")
        atomic_write_text(folder / "logs" / "metrics.csv", _metrics_csv(state.history))

    def report(self, clock: _Clock, epoch: int, row: Mapping[str, float], points: list) -> None:
        """The epoch's row and step losses to the reporter (rank 0, outside the clock)."""
        reporter = self.settings.reporter
        if reporter is None or self.fabric.global_rank != 0:
            return
        with clock.outside("report"):
            if points:
                reporter.steps([(s, float(v)) for s, v in points])
            reporter.epoch(epoch, row)

    def finish(
        self, state: TrainState, engine: dict[str, Any], first_epoch: int, compile_time_s: float | None
    ) -> FitResult:
        """``best.ckpt``, the network with the kept weights in the layout and dtype it came in, and the result."""
        s, fabric, clock = self.settings, self.fabric, state.clock
        folder = Path(self.folder)
        best_path = folder / "best.ckpt"
        if state.best_net is None:
            raise ValueError(
                f"{s.monitor} was NaN in every epoch of the training in {folder}: it diverged. Lower the learning "
                f"rate, then run again with force=true."
            )
        if s.write_best and fabric.global_rank == 0 and (first_epoch < s.max_epochs or not best_path.is_file()):
            best = {"format": CHECKPOINT_FORMAT, "epoch": state.best_epoch, "monitor": s.monitor}
            atomic_torch_save({**best, "metric": state.best_metric, "net": state.best_net}, best_path)
        self.module.load_state_dict(state.best_net)
        if self.policy["channels_last"]:  # the caller gets the network in the layout it handed over
            self.module.to(memory_format=torch.contiguous_format)
        if s.precision == "64-true":  # and in the dtype it handed over (predictions, exports read it so)
            self.module.to(self.net_dtype)
        stopped_by = "early_stopping" if state.stopped_epoch is not None else "budget"
        left_out = clock.left_out
        return FitResult(
            net=self.module,
            best_epoch=int(state.best_epoch),
            best_metric=float(state.best_metric),
            history=state.history,
            fit_time_s=clock(),
            previous_time_s=clock.previous,
            resumed_from_epoch=state.resumed_from[-1] if state.resumed_from else None,
            hook_time_s=left_out["hook"],
            stopped_epoch=state.stopped_epoch,
            restarts=state.restarts,
            initial_loss=state.initial_loss,
            startup_s=left_out["startup"],
            warmup_s=left_out["warmup"],
            report_time_s=left_out["report"],
            global_rank=fabric.global_rank,
            world_size=fabric.world_size,
            precision=s.precision,
            engine=engine,
            gpu_peak_memory_bytes=peak_memory_bytes(fabric.device),
            compile_time_s=compile_time_s,
            min_epochs=s.min_epochs,
            stopped_by=stopped_by,
            convergence=convergence(state.history, stopped_by, s.min_epochs, bool(s.scheduler), state.num_classes),
        )


def _run_spawned(fabric, training: _Training, prefit_s: float) -> str | None:
    """Body of a spawned DDP rank: rank 0 hands its result back to the parent (the weights as a CPU state dict).

    Through a file whose path is returned: Fabric's launcher reads rank 0's return value only after every rank
    exited, so a large one would block rank 0 on the full pipe forever, and a tensor sent through multiprocessing
    would be a handle to the memory of a process that is gone.

    A rank that fails writes its error to ``.spawned_error.<rank>.pt`` (unless another rank failed first: then its
    own error is that one's consequence) before the failure is recorded for the other ranks, and raises: its process
    ends with status 1, the launcher ends the others, and the parent raises the error of the rank that failed first
    (:func:`_spawned_failure`). The others stop within seconds anyway (:func:`failures_stop_every_rank`)."""
    with torch.no_grad():
        # The network arrived through multiprocessing, its tensors in memory shared with the other ranks (torch shares
        # what it sends): each rank must train its own copy, or every rank's step lands on the same weights.
        for tensor in itertools.chain(training.net.parameters(), training.net.buffers()):
            tensor.data = tensor.data.clone()
    path = Path(training.folder) / _SPAWN_RESULT
    with failures_stop_every_rank(fabric) as failures:
        try:
            result = training.run(fabric, prefit_s=prefit_s)
        except Exception as err:
            if failures is None or not failures.other_failed_first():
                _save_error(err, Path(training.folder) / _SPAWN_ERROR.format(fabric.global_rank), fabric.global_rank)
            raise
    # Every rank leaves the process group while its interpreter is whole: left to the interpreter's end, gloo's
    # worker threads may still hold tensors whose release then aborts the process (SIGABRT, "terminate called
    # without an active exception"), and the parent would take a finished training for a failed one.
    _leave_process_group(fabric)
    if fabric.global_rank != 0:
        return None
    atomic_torch_save({"state": _cpu_state(result.net), "result": dataclasses.replace(result, net=None)}, path)
    return str(path)


def _save_error(err: Exception, path: Path, rank: int) -> None:
    """A rank's error for the parent: the exception itself (a ``RuntimeError`` with its message when it does not
    pickle) and its traceback."""
    trace = "".join(traceback.format_exception(err))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_torch_save({"error": err, "rank": rank, "traceback": trace}, path)
    except Exception:
        atomic_torch_save(
            {"error": RuntimeError(f"{type(err).__name__}: {err}"), "rank": rank, "traceback": trace}, path
        )


def _spawned_failure(folder: Path, launch_error: Exception) -> Exception:
    """What the parent raises when spawned ranks failed: the error of the rank that failed first (its traceback
    logged), as it was raised there; the error files are removed."""
    found = []
    for path in sorted(folder.glob(_SPAWN_ERROR.format("*"))):
        with contextlib.suppress(Exception):
            found.append(torch.load(path, map_location="cpu", weights_only=False))
        path.unlink(missing_ok=True)
    # The rank that failed first left its own error; a rank that met the same refusal did too (the lowest wins).
    found.sort(key=lambda out: (isinstance(out["error"], RankFailed), int(out["rank"])))
    if not found:
        return RuntimeError(
            f"a spawned DDP rank of the training in {folder} ended without reporting an error ({launch_error}); it "
            f"was likely killed (out of memory?). Run it again on fewer devices, or see the system log."
        )
    first = found[0]
    log.error("DDP rank %d of the training in %s failed:\n%s", first["rank"], folder, first["traceback"].rstrip())
    return first["error"]


def fit_batches(
    net: nn.Module,
    data: Batches,
    folder: str | Path,
    *,
    optimizer: Any,
    max_epochs: int,
    scheduler: Any = None,
    seed: int | None = None,
    monitor: str = "val_acc",
    monitor_mode: str = "max",
    checkpoint_every: int = 1,
    checkpoint_every_s: float | None = None,
    device: str | torch.device | None = None,
    num_devices: int = 1,
    launcher: str | None = None,
    precision: str = "32-true",
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str = "norm",
    accumulate_grad_batches: int = 1,
    limit_train_batches: int | float | None = None,
    limit_val_batches: int | float | None = None,
    deterministic: bool = False,
    log_every_n_steps: int | None = None,
    reporter: Reporter | None = None,
    on_epoch_end: Callable[[int, Mapping[str, float]], None] | None = None,
    after_epoch: Callable[[int, Mapping[str, float], nn.Module], Mapping[str, float] | None] | None = None,
    divergence_restarts: int | None = None,
    divergence_factor: float = 2.0,
    divergence_lr_factor: float = 0.1,
    patience: int | None = None,
    min_delta: float = 0.0,
    min_epochs: int | None = None,
    start: float | None = None,
    write_best: bool = True,
    gpu: Mapping[str, Any] | None = None,
) -> FitResult:
    """Train classifier ``net`` on ``data`` with cross-entropy, selecting its weights on validation (module doc).

    Resumes from ``folder/last.ckpt`` when it exists (and was written by this loop under the same settings); otherwise
    starts afresh and removes a stale ``folder/logs/metrics.csv``. At the end, ``folder/best.ckpt`` holds the selected
    weights (keys ``format``, ``epoch``, ``monitor``, ``metric``, ``net``) unless ``write_best`` is false.

    Args:
        net: Maps a batch of ``data`` to class logits ``(B, K)``; trained in place (and moved to the device).
        data: The batches (:class:`~ddcnn.data.datamodule.Batches`): ``batch_size`` samples per step and per device,
            ``eval_batch_size`` per evaluation batch; splits ``train`` and ``val``.
        folder: Where ``last.ckpt``, ``best.ckpt`` and ``logs/metrics.csv`` go (created if missing).
        optimizer: A Hydra ``_partial_`` node of an optimizer, e.g. ``cfg.optimizer``, or a callable
            ``params -> Optimizer``. ``torch.optim.LBFGS`` (or an optimizer with ``needs_closure = True``) is stepped
            with a closure.
        max_epochs: Passes over the training samples.
        scheduler: A Hydra ``_partial_`` node ``optimizer -> LRScheduler`` (``T_max: null`` = ``max_epochs``) stepped
            after every epoch, a callable, or ``None``. ``ReduceLROnPlateau`` is stepped with the monitored metric and
            gets the loop's improvement rule (``mode`` = ``monitor_mode``, ``threshold_mode="abs"``,
            ``threshold=min_delta``); a node or scheduler that says otherwise is refused, and so is ``patience`` below
            its patience + 2.
        seed: Seeds the order of the samples and the dropout of every epoch, with the epoch index (default
            ``data.seed``).
        monitor: The metric that selects the returned weights: ``val_acc``, ``val_loss``, ``train_acc`` or
            ``train_loss``.
        monitor_mode: ``max`` or ``min``.
        checkpoint_every: Write ``last.ckpt`` and ``logs/metrics.csv`` after every this many epochs, and always after
            the last one.
        checkpoint_every_s: Instead of ``checkpoint_every``: write them after the first epoch that ends this many
            seconds after the previous write (``0``: after every epoch), and after the last one.
        device: Where to train (default CPU); with DDP spawned over ``num_devices`` GPUs, the first of them.
        num_devices: DDP ranks (1: one device).
        launcher: ``local`` (one device in this process), ``spawn`` (DDP ranks started by this process; also with
            ``num_devices=1``, a one-rank DDP) or ``srun`` (DDP across the tasks of this ``srun`` step); default
            ``local`` for one device, ``spawn`` otherwise.
        precision: ``32-true``, ``bf16-mixed`` (bfloat16 autocast), ``16-mixed`` (float16 autocast with a loss
            scaler whose state is in ``last.ckpt``), on any device, or ``64-true`` (the network and its inputs in
            float64 during the training; it is handed back in its own dtype).
        gradient_clip_val: Clip the gradients before every step to this global 2-norm (``gradient_clip_algorithm``
            ``norm``) or each entry to ``[-v, v]`` (``value``); ``None``: no clipping.
        accumulate_grad_batches: Batches whose gradients add up to one optimizer step (the loss of each is divided by
            this number; the last group of an epoch steps with what it has).
        limit_train_batches, limit_val_batches: Batches per epoch and per validation (per rank under DDP), as
            Lightning's Trainer arguments of these names (a whole number caps them, a fraction keeps that share,
            ``0`` validation batches skips validation); ``None``: all.
        deterministic: Run with torch's deterministic algorithms.
        log_every_n_steps: Hand the mean training loss of every ``n`` optimizer steps to ``reporter.steps``.
        reporter: Shows the progress (rank 0; outside the clock): :class:`Reporter`.
        on_epoch_end: Called as ``on_epoch_end(epoch, metrics_row)`` after each epoch (in every rank), once its
            checkpoint (if any) is written; an exception it raises stops the training as a kill at that moment would.
            Its time is training time.
        after_epoch: Called as ``after_epoch(epoch, metrics_row, net)`` (rank 0) after each epoch's validation, with
            ``net`` in eval mode holding that epoch's weights; the metrics it returns join the row (and
            ``metrics.csv``). Its time is not training time: it is left out of ``fit_time_s`` and the rows' ``time_s``.
        divergence_restarts: ``None``: no divergence check (a NaN epoch is simply never selected); ``0``: raise
            :class:`Diverged` when an epoch diverges; ``R > 0``: restart from the initial weights with the learning
            rates times ``divergence_lr_factor``, at most ``R`` times (see the module doc for the rule).
        divergence_factor: An epoch whose mean training loss exceeds this multiple of the initial loss diverged.
        divergence_lr_factor: What each restart multiplies the learning rates by.
        patience: Stop once this many epochs have passed since the kept epoch (``None``: train ``max_epochs``).
        min_delta: An improvement (selection, early stopping, ``ReduceLROnPlateau``) is one by more than this, in the
            monitored metric's units (:func:`improves`).
        min_epochs: Early stopping never ends the fit before this many epochs (``None``: 0).
        start: ``time.perf_counter()`` at the start of the caller's stage, which the training time counts from
            (default: the call of this function).
        write_best: Also write ``best.ckpt`` with the selected weights at the end.
        gpu: The GPU policy settings (:mod:`ddcnn.engine.gpu`; the ``engine`` settings of those names):
            ``channels_last``, ``tf32``, ``cudnn_benchmark``, ``data_on_device`` (``auto``, ``True``, ``False``),
            ``device_data_fraction``, ``compile``, ``profile_steps``; missing keys are off (``POLICY_OFF``), so a
            direct call (the coarse DNN) trains as before. The policy used is in the result (``engine``).

    With ``launcher="spawn"`` the network, the data and the hooks travel to the ranks by pickling: hooks must then be
    module-level functions or picklable objects (no lambdas or closures).

    Returns:
        The network with its best weights and the training's history and times (:class:`FitResult`). Under DDP
        across ``srun`` tasks every rank returns (``global_rank`` says which); spawned DDP returns rank 0's result.

    Raises:
        ValueError: For a bad setting (naming it), a ``last.ckpt`` of another program or written under other settings.
        Diverged: With ``divergence_restarts`` set, when the last allowed attempt diverges too.
        ArtifactWriteError: When the disk is full or not writable (the training resumes from its last checkpoint).
    """
    keywords = dict(locals())  # the settings of the training: _FitSettings' fields, by name
    start = time.perf_counter() if start is None else float(start)
    launcher = launcher or ("local" if int(num_devices) == 1 else "spawn")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}.")
    given = {f.name: keywords[f.name] for f in dataclasses.fields(_FitSettings)}
    settings = _FitSettings(**given | {"seed": data.seed if seed is None else seed})
    _check_data(data)
    threads = max(1, torch.get_num_threads() // int(num_devices)) if launcher == "spawn" else None
    began = time.perf_counter()
    training = _Training(settings, net, data, str(folder), start, threads)
    fabric = build_fabric(device, int(num_devices), launcher, settings.precision)
    with _disk_errors(folder):
        if launcher == "spawn":
            return _fit_spawned(fabric, training, net, start)
        return _fit_here(fabric, training, launcher, began)


def _check_data(data: Batches) -> None:
    for split in ("train", "val"):
        if data.size(split) == 0:
            raise ValueError(f"{split}: no samples; the {split} split must not be empty.")
    if int(data.batch_size) < 1 or int(data.eval_batch_size) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {data.batch_size} and {data.eval_batch_size}.")


@contextlib.contextmanager
def _disk_errors(folder: str | Path) -> Iterator[None]:
    """A full or unwritable disk met by the training in ``folder`` as an :class:`ArtifactWriteError` that says what
    to do."""
    try:
        yield
    except OSError as err:
        if isinstance(err, ArtifactWriteError) or not is_space_or_permission(err):
            raise
        raise ArtifactWriteError(
            err.errno,
            f"training in {folder} stopped: {err}. Free disk space or choose a writable run directory, then run the "
            f"same command again: it resumes from the last checkpoint.",
        ) from err


def _fit_spawned(fabric, training: _Training, net: nn.Module, start: float) -> FitResult:
    """:func:`fit_batches` in DDP ranks spawned by this process: rank 0's result, its weights loaded into ``net``."""
    folder = Path(training.folder)
    prefit = time.perf_counter() - start
    for stale in folder.glob(_SPAWN_ERROR.format("*")):
        stale.unlink(missing_ok=True)
    try:
        with isolated_launch():
            path = Path(fabric.launch(_run_spawned, training, prefit))
    except Exception as err:  # raised in a rank: here as there, its message intact
        raise _spawned_failure(folder, err) from None
    out = torch.load(path, map_location="cpu", weights_only=False)
    path.unlink(missing_ok=True)
    result: FitResult = out["result"]
    net.load_state_dict(out["state"])
    # Spawning the ranks (interpreters, imports, the data), their rendezvous and tear-down: start-up, apart.
    wall = time.perf_counter() - start
    own = result.fit_time_s - result.previous_time_s
    result.startup_s = max(0.0, wall - own - result.warmup_s - result.hook_time_s - result.report_time_s)
    return dataclasses.replace(result, net=net)


def _fit_here(fabric, training: _Training, launcher: str, began: float) -> FitResult:
    """:func:`fit_batches` in this process: on one device, or as this task's rank of DDP across ``srun`` tasks."""
    with isolated_launch():
        fabric.launch()  # DDP across srun tasks: the ranks meet here
    # Fabric's set-up and (srun) the rendezvous of the ranks: start-up, left out of the clock.
    training.startup_s = time.perf_counter() - began
    finished = False
    try:
        with failures_stop_every_rank(fabric):
            result = training.run(fabric)
        finished = True
        return result
    finally:
        if launcher == "srun":
            _leave_process_group(fabric, wait=finished)


def _leave_process_group(fabric, wait: bool = True) -> None:
    """End this rank's part in the DDP training (an srun task's or a spawned rank's): the ranks wait for each other
    (``wait``: not after a failure, the others may never come), then the group is destroyed (a rank that goes on
    alone, rank 0 predicting, must not meet the others' collectives)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if wait:
            with contextlib.suppress(Exception):
                fabric.barrier()
        with contextlib.suppress(Exception) if not wait else contextlib.nullcontext():
            dist.destroy_process_group()


def fit_tensors(
    net: nn.Module,
    x: Mapping[str, torch.Tensor],
    y: Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    batch_size: int | None = None,
    eval_batch_size: int = EVAL_CHUNK,
    seed: int = 0,
    **kwargs: Any,
) -> FitResult:
    """:func:`fit_batches` on in-memory tensors ``x[split], y[split]`` (the coarse DNN's ``(n, N, K)`` local outputs).

    ``batch_size`` rows per step, ``None`` or 0 for the whole training split (full-batch steps); the other arguments
    are those of :func:`fit_batches`.
    """
    for split in ("train", "val"):
        if split not in x or split not in y:
            raise ValueError(
                f"fit_tensors needs x and y for the splits 'train' and 'val', got {sorted(x)}/{sorted(y)}."
            )
    for split in x:
        if len(x[split]) != len(y[split]):
            raise ValueError(f"{split}: {len(x[split])} inputs but {len(y[split])} labels.")
    if batch_size is not None and int(batch_size) < 0:
        raise ValueError(f"batch_size must be a positive number of rows, or 0/null for full batches, got {batch_size}.")
    if int(eval_batch_size) < 1:
        raise ValueError(f"eval_batch_size must be >= 1, got {eval_batch_size!r}.")
    n_train = len(y["train"])
    splits = [s for s in x if s in y]
    data = TensorDataModule(
        {s: x[s] for s in splits},
        {s: y[s].long() for s in splits},
        batch_size=max(1, int(batch_size) if batch_size else n_train),
        eval_batch_size=int(eval_batch_size),
        seed=int(seed),
    )
    return fit_batches(net, data, folder, seed=seed, **kwargs)
