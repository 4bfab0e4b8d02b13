"""Training a small classifier on in-memory tensors with a plain PyTorch loop (the coarse DNN's trainer).

The coarse DNN is an MLP on a few thousand rows of ``N * K`` numbers: through Lightning, its thousands of
small steps cost more in framework calls than in arithmetic, and more than a local CNN. :func:`fit_tensors`
trains such a network with nothing but PyTorch, in large (or full) batches, and keeps what the stages
promise: selection on validation (``trainer.monitor`` / ``trainer.monitor_mode``), an atomic ``last.ckpt``
from which a killed run resumes to exactly the weights an uninterrupted run reaches, and a
``logs/metrics.csv`` with every epoch that :func:`ddcnn.report.plots.read_metrics_csv` reads.

Everything random depends only on ``(seed, epoch)``: the shuffling of epoch ``e`` comes from a generator
seeded from both, and so does the seed of the global generators (dropout) during that epoch, which are
restored afterwards (:func:`torch.random.fork_rng`). A resumed run therefore repeats the interrupted epochs
exactly, whatever the checkpoint interval.

What a fit may ask of the loop beyond plain mini-batch steps:

- **closure optimizers** (``torch.optim.LBFGS``): each step re-evaluates the batch through a closure; with
  ``batch_size=None`` (or 0) every step sees the whole training split (full-batch L-BFGS);
- **a per-epoch hook with the network** (``after_epoch``), e.g. the test accuracy of every epoch for accuracy-versus-
  time curves, or a snapshot of predictions. Its time is kept out of the training clock (and reported apart as
  ``hook_time_s``); the metrics it returns join the epoch's row and ``logs/metrics.csv``;
- **the training clock per epoch**: every row has ``time_s``, the training time of all processes up to the end of
  that epoch (hooks excluded), the x axis of an accuracy-versus-time curve;
- **divergence detection** (``divergence_restarts`` not ``None``): an epoch has diverged when its mean training loss
  is not finite or exceeds ``divergence_factor`` times the larger of the initial loss (the loss of the first training
  batch before the first step) and ``ln K`` (the loss of a uniform guess over the ``K`` classes: a network that
  starts better than chance may wander above its initial loss without diverging). With ``divergence_restarts=0`` the
  fit raises :class:`Diverged`; with ``R > 0`` it starts again from the initial weights with every learning rate
  multiplied by ``divergence_lr_factor``, at most ``R`` times. The restarts are recorded in the result
  (``restarts``) and in ``last.ckpt``, so a resumed fit continues the same attempt;
- **early stopping** (``patience``): the fit ends once the monitored metric has not improved for ``patience``
  epochs (the selected weights are those of the best epoch, as always); the epoch it stopped after is in the result
  (``stopped_epoch``) and in ``last.ckpt``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddcnn.io import atomic_torch_save, atomic_write_text

log = logging.getLogger(__name__)

__all__ = [
    "FitResult",
    "Diverged",
    "fit_tensors",
    "build_optimizer",
    "build_scheduler",
    "torch_threads",
    "num_batches",
    "CHECKPOINT_FORMAT",
    "METRIC_COLUMNS",
]

# Stored in every checkpoint: a last.ckpt of another trainer (an older Lightning run) is not resumed from.
CHECKPOINT_FORMAT = "ddcnn.tensor_fit/1"
# logs/metrics.csv: one row per epoch (0-based, as Lightning's CSVLogger counts), ``step`` = optimizer steps so far,
# ``time_s`` = the training clock at the end of the epoch; metrics returned by an ``after_epoch`` hook follow.
METRIC_COLUMNS = ("epoch", "step", "lr", "train_loss", "train_acc", "val_loss", "val_acc", "time_s")
# The metrics a fit can select on.
MONITORS = ("train_loss", "train_acc", "val_loss", "val_acc")
# Rows per forward pass when evaluating; bounds the memory of a hidden layer over a large split.
EVAL_CHUNK = 65_536
# The settings an exact resume depends on: a checkpoint written under others is refused (a key missing from both
# the checkpoint and the current settings counts as equal: limits are recorded only where they are set).
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
)


class Diverged(RuntimeError):
    """A training diverged (see the module doc for the rule) and no restart was allowed or left.

    Attributes:
        epoch: The epoch that diverged.
        reason: Why (``train_loss nan``, ``train_loss 9.1 > 2 x initial 3.6``).
    """

    def __init__(self, message: str, epoch: int, reason: str) -> None:
        super().__init__(message)
        self.epoch, self.reason = epoch, reason


@dataclass
class FitResult:
    """What :func:`fit_tensors` returns.

    Attributes:
        net: The trained network with the weights of the best validation epoch (on the training device).
        best_epoch: That epoch (0-based).
        best_metric: Its value of the monitored metric.
        history: Per epoch, the row written to ``logs/metrics.csv``.
        fit_time_s: Training time of every process that worked on this training, this one included (work after the
            last checkpoint of a killed process is lost and not counted).
        previous_time_s: The part of ``fit_time_s`` spent by earlier processes (0 for an uninterrupted training).
        resumed_from_epoch: The last finished epoch of the checkpoint this process resumed from, else ``None``.
        hook_time_s: Time this process spent in the ``after_epoch`` hook, outside ``fit_time_s``.
        restarts: One entry per divergence restart: ``{"epoch", "reason", "lr_scale"}`` (the scale after it).
        initial_loss: The loss of the first training batch before the first step (of the last attempt).
        stopped_epoch: The epoch after which early stopping (``patience``) ended the fit, else ``None``.
    """

    net: nn.Module
    best_epoch: int
    best_metric: float
    history: list[dict[str, float]] = field(default_factory=list)
    fit_time_s: float = 0.0
    previous_time_s: float = 0.0
    resumed_from_epoch: int | None = None
    hook_time_s: float = 0.0
    stopped_epoch: int | None = None
    restarts: list[dict] = field(default_factory=list)
    initial_loss: float | None = None


def _spec(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def build_optimizer(node: Any, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of a Hydra ``_partial_`` node (``{_target_: torch.optim.AdamW, _partial_: true, lr: ...}``).

    A callable ``params -> Optimizer`` is accepted as well.
    """
    factory = hydra.utils.instantiate(_spec(node)) if isinstance(node, Mapping | DictConfig) else node
    if not callable(factory):
        raise ValueError(
            f"the optimizer setting must be a Hydra node with _partial_: true (e.g. coarse.optimizer) or a callable, "
            f"got {node!r}."
        )
    return factory(params)


def scheduler_factory(node: Any, max_epochs: int) -> Callable[[torch.optim.Optimizer], Any] | None:
    """The learning-rate schedule of a Hydra ``_partial_`` node as ``optimizer -> LRScheduler``, or ``None``.

    ``None`` or an empty node means a constant rate. ``T_max: null`` (cosine annealing) becomes ``max_epochs``: every
    training (local nets, coarse DNN, optional stages) anneals over its own epochs.
    """
    if not node:
        return None
    spec = _spec(node)
    if isinstance(spec, Mapping):
        spec = dict(spec)
        if "T_max" in spec and spec["T_max"] is None:
            spec["T_max"] = max_epochs
        spec = hydra.utils.instantiate(spec)
    return spec


def build_scheduler(
    node: Any, optimizer: torch.optim.Optimizer, max_epochs: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The schedule of ``node`` (:func:`scheduler_factory`) on ``optimizer``, stepped once per epoch."""
    factory = scheduler_factory(node, max_epochs)
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


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    # The formula of the local nets' batch sampler (ddcnn.data.datamodule._EpochBatchSampler).
    return torch.Generator().manual_seed(int(seed) * 100_003 + int(epoch))


def _seed_global_rng(seed: int, device: torch.device) -> None:
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def _check_tensors(x: Mapping[str, torch.Tensor], y: Mapping[str, torch.Tensor]) -> None:
    for split in ("train", "val"):
        if split not in x or split not in y:
            raise ValueError(
                f"fit_tensors needs x and y for the splits 'train' and 'val', got {sorted(x)}/{sorted(y)}."
            )
    for split in x:
        if len(x[split]) != len(y[split]):
            raise ValueError(f"{split}: {len(x[split])} inputs but {len(y[split])} labels.")
        if len(x[split]) == 0:
            raise ValueError(f"{split}: no samples; the {split} split must not be empty.")


def num_batches(n_batches: int, limit: int | float | None, what: str) -> int:
    """The batches an epoch runs under a Lightning-style ``limit`` (``trainer.limit_train_batches``): a whole number
    caps them, a fraction in (0, 1] keeps that share (at least one), ``None`` keeps all."""
    if limit is None:
        return n_batches
    if isinstance(limit, bool) or not isinstance(limit, int | float) or limit <= 0:
        raise ValueError(
            f"{what} must be a positive number of batches or a fraction in (0, 1], or null for all, got {limit!r}."
        )
    if isinstance(limit, float):
        if limit > 1.0:
            raise ValueError(f"{what} as a fraction must be in (0, 1], got {limit!r}; a whole number caps batches.")
        return max(1, int(n_batches * limit))
    return min(n_batches, int(limit))


@torch.inference_mode()
def _evaluate(
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    chunk: int,
    device: torch.device,
    view: Callable[[torch.Tensor], torch.Tensor] | None = None,
    max_batches: int | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    batches: Any = None,
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``net`` (in eval mode) over ``x`` (its first ``max_batches`` chunks), or
    over the ``val`` split of ``batches`` (a :class:`ddcnn.data.datamodule.Batches`)."""
    net.eval()
    loss = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = 0
    if batches is not None:
        pairs = (batches.eval_batch("val", idx, device) for idx in torch.arange(len(y)).split(chunk))
    else:
        pairs = zip(x.split(chunk), y.split(chunk), strict=True)
    for k, (xb, yb) in enumerate(pairs):
        if max_batches is not None and k >= max_batches:
            break
        if view is not None:
            xb = view(xb)
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        with autocast():
            logits = net(xb.contiguous())
        loss += F.cross_entropy(logits.float(), yb, reduction="sum")
        correct += (logits.argmax(-1) == yb).sum()
        seen += len(yb)
    return float(loss) / seen, int(correct) / seen


def _better(value: float, best: float | None, mode: str) -> bool:
    """Strictly better than ``best`` (ties keep the earlier epoch, NaN never wins), as Lightning's ModelCheckpoint."""
    if math.isnan(value):
        return False
    if best is None or math.isnan(best):
        return True
    return value > best if mode == "max" else value < best


def _cpu_state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}


def _csv_value(key: str, value: Any) -> Any:
    if value is None:
        return ""
    return int(value) if key in ("epoch", "step") else repr(float(value))


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
    fields = [*METRIC_COLUMNS, *extra]
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: _csv_value(k, v) for k, v in row.items()})
    return out.getvalue()


def _load_checkpoint(path: Path, settings: Mapping[str, Any]) -> dict | None:
    """The resumable state in ``path``, ``None`` when there is none (or only another trainer's checkpoint)."""
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        log.warning("%s was not written by ddcnn.engine.tensor_fit; training starts from scratch", path)
        return None
    saved = state.get("settings", {})
    differ = {k: (saved.get(k), settings.get(k)) for k in _RESUME_SETTINGS if saved.get(k) != settings.get(k)}
    if differ:
        shown = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in differ.items())
        raise ValueError(
            f"{path} belongs to a training with other settings ({shown}); resuming it would not give the result of "
            f"either. Restore those settings to resume, or delete {path} (force=true for a stage) to start over."
        )
    return state


def fit_tensors(
    net: nn.Module,
    x: Mapping[str, torch.Tensor],
    y: Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    optimizer: Any,
    max_epochs: int,
    scheduler: Any = None,
    batch_size: int | None = None,
    seed: int = 0,
    monitor: str = "val_acc",
    monitor_mode: str = "max",
    checkpoint_every: int = 1,
    checkpoint_every_s: float | None = None,
    device: str | torch.device | None = None,
    eval_batch_size: int = EVAL_CHUNK,
    on_epoch_end: Callable[[int, Mapping[str, float]], None] | None = None,
    after_epoch: Callable[[int, Mapping[str, float], nn.Module], Mapping[str, float] | None] | None = None,
    transform: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    val_view: Callable[[torch.Tensor], torch.Tensor] | None = None,
    keep_on_host: bool = False,
    limit_train_batches: int | float | None = None,
    limit_val_batches: int | float | None = None,
    gradient_clip_val: float | None = None,
    autocast_dtype: torch.dtype | None = None,
    divergence_restarts: int | None = None,
    divergence_factor: float = 2.0,
    divergence_lr_factor: float = 0.1,
    patience: int | None = None,
    start: float | None = None,
    write_best: bool = True,
    batches: Any = None,
) -> FitResult:
    """Train classifier ``net`` on ``x["train"], y["train"]`` with cross-entropy, selecting on ``x["val"]``.

    Resumes from ``folder/last.ckpt`` when it exists (and was written by this function under the same settings);
    otherwise starts afresh and removes a stale ``folder/logs/metrics.csv``. At the end, ``folder/best.ckpt`` holds the
    selected weights (keys ``format``, ``epoch``, ``monitor``, ``metric``, ``net``). Only the ``train`` and ``val``
    splits are used; others in ``x`` are ignored.

    Args:
        net: Maps a batch of ``x`` rows to class logits ``(B, K)``; trained in place (and moved to ``device``).
        x, y: Inputs and integer labels per split.
        folder: Where ``last.ckpt`` and ``logs/metrics.csv`` go (created if missing).
        optimizer: A Hydra ``_partial_`` node of an optimizer, e.g. ``cfg.coarse.optimizer``, or a callable
            ``params -> Optimizer``. ``torch.optim.LBFGS`` (or an optimizer with ``needs_closure = True``) is stepped
            with a closure.
        max_epochs: Passes over the training rows.
        scheduler: A Hydra ``_partial_`` node ``optimizer -> LRScheduler`` (``T_max: null`` = ``max_epochs``) stepped
            after every epoch, a callable, or ``None``. ``ReduceLROnPlateau`` is stepped with the monitored metric.
        batch_size: Rows per optimizer step; ``None`` or 0 means the whole training split (full-batch steps).
        seed: Seeds the shuffling and dropout of every epoch, together with the epoch index.
        monitor: The metric that selects the returned weights: ``val_acc``, ``val_loss``, ``train_acc`` or
            ``train_loss``.
        monitor_mode: ``max`` or ``min``.
        checkpoint_every: Write ``last.ckpt`` and ``logs/metrics.csv`` after every this many epochs, and always after
            the last one.
        checkpoint_every_s: Instead of ``checkpoint_every``: write them after the first epoch that ends this many
            seconds after the previous write (``0``: after every epoch), and after the last one.
        device: Where to train (default CPU); the tensors are moved there once (unless ``keep_on_host``).
        eval_batch_size: Rows per forward pass when evaluating on the validation split.
        on_epoch_end: Called as ``on_epoch_end(epoch, metrics_row)`` after each epoch, once its checkpoint (if any) is
            written; an exception it raises stops the training as a kill at that moment would.
        after_epoch: Called as ``after_epoch(epoch, metrics_row, net)`` after each epoch's validation, with ``net`` in
            eval mode holding that epoch's weights; the metrics it returns join the row (and ``metrics.csv``). Its
            time is not training time: it is left out of ``fit_time_s`` and the rows' ``time_s``.
        transform: ``(x_batch, sample_indices, epoch) -> network input`` applied to every training batch (e.g. an
            augmentation of whole images, then the cut of one sub-domain).
        val_view: ``x_batch -> network input`` for the validation batches (e.g. the cut of one sub-domain).
        keep_on_host: Leave the data where it is and move each batch to ``device`` (images, volumes); otherwise the
            splits move to ``device`` once and every epoch gathers its shuffled rows in one operation (small rows).
        limit_train_batches, limit_val_batches: Batches per epoch and per validation, as Lightning's Trainer arguments
            of these names (a whole number caps them, a fraction keeps that share); ``None``: all.
        gradient_clip_val: Clip the gradients' global 2-norm to this value before every step (``None``: no clipping).
        autocast_dtype: Run forward passes under ``torch.autocast`` with this dtype (``torch.bfloat16``: Lightning's
            ``bf16-mixed``); ``None``: full precision.
        divergence_restarts: ``None``: no divergence check (a NaN epoch is simply never selected); ``0``: raise
            :class:`Diverged` when an epoch diverges; ``R > 0``: restart from the initial weights with the learning
            rates times ``divergence_lr_factor``, at most ``R`` times (see the module doc for the rule).
        divergence_factor: An epoch whose mean training loss exceeds this multiple of the initial loss diverged.
        divergence_lr_factor: What each restart multiplies the learning rates by.
        patience: Stop once the monitored metric has not improved for this many epochs (``None``: train
            ``max_epochs``).
        start: ``time.perf_counter()`` at the start of the caller's stage, which the training time counts from
            (default: the call of this function).
        write_best: Also write ``best.ckpt`` with the selected weights at the end.
        batches: A :class:`ddcnn.data.datamodule.Batches` to read the batches from instead of ``x``/``y`` (which are
            then ignored): it reads, moves, normalises, augments and crops each batch itself.

    Returns:
        The network with its best weights and the training's history and times (:class:`FitResult`).

    Raises:
        ValueError: For a bad setting (naming it), or a ``last.ckpt`` written under other settings.
        Diverged: With ``divergence_restarts`` set, when the last allowed attempt diverges too.
    """
    start = time.perf_counter() if start is None else float(start)
    if int(max_epochs) < 1:
        raise ValueError(f"max_epochs must be >= 1, got {max_epochs!r}.")
    if int(checkpoint_every) < 1:
        raise ValueError(f"checkpoint_every must be >= 1 (epochs between checkpoints), got {checkpoint_every!r}.")
    if monitor_mode not in ("max", "min"):
        raise ValueError(f"monitor_mode must be 'max' or 'min', got {monitor_mode!r}.")
    if monitor not in MONITORS:
        raise ValueError(f"monitor must be one of {list(MONITORS)}, got {monitor!r}.")
    if batch_size is not None and int(batch_size) < 0:
        raise ValueError(f"batch_size must be a positive number of rows, or 0/null for full batches, got {batch_size}.")
    if int(eval_batch_size) < 1:
        raise ValueError(f"eval_batch_size must be >= 1, got {eval_batch_size!r}.")
    if checkpoint_every_s is not None and float(checkpoint_every_s) < 0:
        raise ValueError(f"checkpoint_every_s must be >= 0 (0: after every epoch), got {checkpoint_every_s!r}.")
    if gradient_clip_val is not None and float(gradient_clip_val) <= 0:
        raise ValueError(f"gradient_clip_val must be > 0 (or null: no clipping), got {gradient_clip_val!r}.")
    if divergence_restarts is not None and int(divergence_restarts) < 0:
        raise ValueError(f"divergence_restarts must be >= 0 or null (no check), got {divergence_restarts!r}.")
    if patience is not None and (isinstance(patience, bool) or int(patience) < 1):
        raise ValueError(f"patience must be a positive number of epochs or null (no early stopping), got {patience!r}.")
    if float(divergence_factor) <= 1.0:
        raise ValueError(f"divergence_factor must be > 1, got {divergence_factor!r}.")
    if not 0.0 < float(divergence_lr_factor) < 1.0:
        raise ValueError(f"divergence_lr_factor must lie strictly between 0 and 1, got {divergence_lr_factor!r}.")
    if batches is None:
        _check_tensors(x, y)
    max_epochs, checkpoint_every = int(max_epochs), int(checkpoint_every)
    device = torch.device(device) if device is not None else torch.device("cpu")
    folder = Path(folder)
    last, best, metrics_path = folder / "last.ckpt", folder / "best.ckpt", folder / "logs" / "metrics.csv"

    stream = keep_on_host or transform is not None or batches is not None  # batches cut (and moved) one at a time
    if batches is not None:
        x_train = x_val = None
        y_train, y_val = batches.labels("train").long(), batches.labels("val").long()
    else:
        data_device = x["train"].device if stream else device
        x_train, y_train = x["train"].to(data_device), y["train"].to(data_device).long()
        x_val, y_val = x["val"].to(data_device), y["val"].to(data_device).long()
    n_train = len(y_train)
    batch = n_train if not batch_size else min(int(batch_size), n_train)
    train_batches = num_batches(-(-n_train // batch), limit_train_batches, "limit_train_batches")
    val_batches = num_batches(-(-len(y_val) // int(eval_batch_size)), limit_val_batches, "limit_val_batches")
    settings = {
        "seed": int(seed),
        "batch_size": batch,
        "max_epochs": max_epochs,
        "monitor": monitor,
        "monitor_mode": monitor_mode,
        "n_train": n_train,
    }
    for key, value in (
        ("limit_train_batches", limit_train_batches),
        ("limit_val_batches", limit_val_batches),
        ("divergence_restarts", divergence_restarts),
        ("patience", patience),
    ):
        if value is not None:
            settings[key] = value
    if autocast_dtype is not None:

        def autocast() -> contextlib.AbstractContextManager:
            return torch.autocast(device.type, dtype=autocast_dtype)
    else:
        autocast = contextlib.nullcontext

    net = net.to(device)
    check_divergence = divergence_restarts is not None
    initial_state = _cpu_state(net) if check_divergence else None  # what a restart starts from

    def build(lr_scale: float) -> tuple[torch.optim.Optimizer, Any]:
        opt = build_optimizer(optimizer, net.parameters())
        if lr_scale != 1.0:
            for group in opt.param_groups:
                group["lr"] = float(group["lr"]) * lr_scale
                if "initial_lr" in group:
                    group["initial_lr"] = float(group["initial_lr"]) * lr_scale
        return opt, build_scheduler(scheduler, opt, max_epochs)

    history: list[dict[str, float]] = []
    best_state, best_metric, best_epoch = None, None, -1
    first_epoch, previous_time, resumed_from, step = 0, 0.0, [], 0
    stopped_epoch: int | None = None
    restarts: list[dict] = []
    lr_scale, initial_loss, num_classes = 1.0, None, 2
    state = _load_checkpoint(last, settings)
    if state is not None:
        restarts = list(state.get("restarts", []))
        lr_scale, initial_loss = float(state.get("lr_scale", 1.0)), state.get("initial_loss")
        num_classes = int(state.get("num_classes", num_classes))
        if state.get("initial_state") is not None:
            initial_state = state["initial_state"]
        opt, sched = build(lr_scale)
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["optimizer"])
        if sched is not None and state.get("scheduler") is not None:
            sched.load_state_dict(state["scheduler"])
        history = list(state["history"])
        best_state, best_metric, best_epoch = state["best"]["net"], state["best"]["metric"], state["best"]["epoch"]
        first_epoch, previous_time = int(state["epoch"]) + 1, float(state["fit_time_s"])
        stopped_epoch = state.get("stopped_epoch")
        resumed_from = [*state.get("resumed_from", []), int(state["epoch"])]
        step = int(history[-1]["step"]) if history else 0
        log.info("%s: resuming from %s (after epoch %d)", folder, last, state["epoch"])
    else:  # outputs of an earlier training of this folder (force=true) must not pass for this one's
        opt, sched = build(lr_scale)
        metrics_path.unlink(missing_ok=True)
        best.unlink(missing_ok=True)
    closure_steps = _needs_closure(opt)
    hook_time = [0.0]  # this process's time in after_epoch, kept out of the training clock

    def clock() -> float:
        return previous_time + time.perf_counter() - start - hook_time[0]

    def save(epoch: int) -> None:
        checkpoint = {
            "format": CHECKPOINT_FORMAT,
            "epoch": epoch,
            "settings": settings,
            "net": _cpu_state(net),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict() if sched is not None else None,
            "best": {"epoch": best_epoch, "metric": best_metric, "monitor": monitor, "net": best_state},
            "history": history,
            "fit_time_s": clock(),
            "resumed_from": resumed_from,
            "restarts": restarts,
            "lr_scale": lr_scale,
            "initial_loss": initial_loss,
            "num_classes": num_classes,
            "initial_state": initial_state,
            "stopped_epoch": stopped_epoch,
        }
        atomic_torch_save(checkpoint, last)
        atomic_write_text(metrics_path, _metrics_csv(history))
        last_write[0] = time.perf_counter()

    last_write = [time.perf_counter()]

    def train_step(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on a batch; its loss and logits before the step."""
        seen_first: list[tuple[torch.Tensor, torch.Tensor]] = []

        def closure() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with autocast():
                logits = net(xb)
            loss = F.cross_entropy(logits.float(), yb)
            loss.backward()
            if gradient_clip_val is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), float(gradient_clip_val))
            if not seen_first:
                seen_first.append((loss.detach(), logits.detach()))
            return loss

        if closure_steps:
            opt.step(closure)
        else:
            closure()
            opt.step()
        return seen_first[0]

    devices = [device] if device.type == "cuda" else []
    x_epoch = y_epoch = None
    epoch = first_epoch
    with torch.random.fork_rng(devices=devices):  # seeded per epoch below; the caller's generators stay as they were
        while epoch < max_epochs and stopped_epoch is None:
            gen = _epoch_generator(seed, epoch)
            order = torch.randperm(n_train, generator=gen) if batch < n_train else None
            if stream:
                # Batches of indices; each is cut from the stored split (and transformed) when its step comes.
                index_batches = (order if order is not None else torch.arange(n_train)).split(batch)
                if batches is not None:
                    steps = ((*batches.train_batch(idx, epoch, device), None) for idx in index_batches[:train_batches])
                else:
                    steps = ((x_train[idx], y_train[idx], idx) for idx in index_batches[:train_batches])
            else:
                if order is not None:
                    # One gather of the whole split per epoch into buffers allocated once (a fresh allocation of
                    # tens of MB faults its pages in every epoch, which cost as much as the gather); batches are
                    # then views.
                    order = order.to(device)
                    if x_epoch is None:
                        x_epoch, y_epoch = torch.empty_like(x_train), torch.empty_like(y_train)
                    torch.index_select(x_train, 0, order, out=x_epoch)
                    torch.index_select(y_train, 0, order, out=y_epoch)
                else:
                    x_epoch, y_epoch = x_train, y_train
                pairs = zip(x_epoch.split(batch), y_epoch.split(batch), strict=True)
                steps = ((xb, yb, None) for k, (xb, yb) in enumerate(pairs) if k < train_batches)
            _seed_global_rng(int(torch.randint(2**62, (1,), generator=gen)), device)
            lr = float(opt.param_groups[0]["lr"])
            net.train()
            loss_sum = torch.zeros((), device=device)
            correct = torch.zeros((), device=device, dtype=torch.long)
            seen = 0
            for xb, yb, idx in steps:
                if transform is not None:
                    xb = transform(xb, idx, epoch)
                if stream:
                    xb = xb.contiguous().to(device, non_blocking=True)
                    yb = yb.to(device, non_blocking=True)
                loss, logits = train_step(xb, yb)
                if initial_loss is None:
                    initial_loss, num_classes = float(loss), int(logits.shape[-1])
                loss_sum += loss * len(yb)
                correct += (logits.argmax(-1) == yb).sum()
                seen += len(yb)
                step += 1
            train_loss = float(loss_sum) / seen
            reason = (
                _divergence(train_loss, initial_loss, num_classes, float(divergence_factor))
                if check_divergence
                else None
            )
            if reason is not None:
                where = f"the training in {folder} diverged in epoch {epoch} ({reason})"
                if len(restarts) >= int(divergence_restarts):
                    raise Diverged(
                        f"{where}, after {len(restarts)} restart(s) with lower learning rates. Lower the learning "
                        f"rate (or scale the inputs), then run again with force=true.",
                        epoch,
                        reason,
                    )
                lr_scale *= float(divergence_lr_factor)
                restarts.append({"epoch": epoch, "reason": reason, "lr_scale": lr_scale})
                log.warning("%s: restarting from the initial weights with the learning rate x %g", where, lr_scale)
                net.load_state_dict(initial_state)
                opt, sched = build(lr_scale)
                history, best_state, best_metric, best_epoch = [], None, None, -1
                step, initial_loss, epoch = 0, None, 0
                continue
            val_loss, val_acc = _evaluate(
                net, x_val, y_val, int(eval_batch_size), device, val_view, val_batches, autocast, batches
            )
            row = {
                "epoch": epoch,
                "step": step,
                "lr": lr,
                "train_loss": train_loss,
                "train_acc": int(correct) / seen,
                "val_loss": val_loss,
                "val_acc": val_acc,
                "time_s": clock(),
            }
            if after_epoch is not None:
                hook_start = time.perf_counter()
                net.eval()
                extra = after_epoch(epoch, dict(row), net)
                row.update({k: v for k, v in (extra or {}).items() if k not in row})
                hook_time[0] += time.perf_counter() - hook_start
            history.append(row)
            if _better(row[monitor], best_metric, monitor_mode):
                best_state, best_metric, best_epoch = _cpu_state(net), row[monitor], epoch
            if sched is not None:
                if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    sched.step(row[monitor])
                else:
                    sched.step()
            if checkpoint_every_s is not None:
                due = time.perf_counter() - last_write[0] >= float(checkpoint_every_s)
            else:
                due = (epoch + 1) % checkpoint_every == 0
            if patience is not None and epoch - best_epoch >= int(patience) and epoch < max_epochs - 1:
                stopped_epoch = epoch
                log.debug(
                    "%s: no improvement of %s for %d epochs, stopping after epoch %d", folder, monitor, patience, epoch
                )
            if due or epoch == max_epochs - 1 or stopped_epoch is not None:
                save(epoch)
            if on_epoch_end is not None:
                on_epoch_end(epoch, row)
            epoch += 1

    if best_state is None:
        raise ValueError(
            f"{monitor} was NaN in every epoch of the training in {folder}: it diverged. Lower the learning rate, "
            f"then run again with force=true."
        )
    if write_best and (first_epoch < max_epochs or not best.is_file()):
        atomic_torch_save(
            {
                "format": CHECKPOINT_FORMAT,
                "epoch": best_epoch,
                "monitor": monitor,
                "metric": best_metric,
                "net": best_state,
            },
            best,
        )
    net.load_state_dict(best_state)
    return FitResult(
        net=net,
        best_epoch=int(best_epoch),
        best_metric=float(best_metric),
        history=history,
        fit_time_s=clock(),
        previous_time_s=previous_time,
        resumed_from_epoch=resumed_from[-1] if resumed_from else None,
        hook_time_s=hook_time[0],
        stopped_epoch=stopped_epoch,
        restarts=restarts,
        initial_loss=initial_loss,
    )
