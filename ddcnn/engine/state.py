"""A training's state and its checkpoint: :class:`TrainState` (what a training carries from epoch to epoch, saved
whole to ``last.ckpt`` with the state of the rules that own one, and restored whole from it; its keys listed once,
:data:`CHECKPOINT_KEYS`), the training clock
(:class:`Clock`), ``logs/metrics.csv`` (:func:`metrics_csv`) and the resume check (:func:`load_checkpoint`)."""

from __future__ import annotations

import contextlib
import csv
import io
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddcnn.io import load_run_file
from ddcnn.settings.loop import LoopSettings

__all__ = [
    "Diverged",
    "FitResult",
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_KEYS",
    "OWN_KEYS",
    "METRIC_COLUMNS",
    "RESUME_KEYS",
    "Clock",
    "TrainState",
    "cpu_state",
    "metrics_csv",
    "load_checkpoint",
]


# Stored in every checkpoint. The plain loop before the Fabric loop wrote the same layout as ``ddcnn.tensor_fit/1``,
# which resumes here too; a last.ckpt of Lightning's Trainer (older ddcnn) is refused with what to do.
CHECKPOINT_FORMAT = "ddcnn.loop/1"
_RESUMABLE_FORMATS = (CHECKPOINT_FORMAT, "ddcnn.tensor_fit/1")


# logs/metrics.csv: one row per epoch (0-based, as Lightning's CSVLogger counts), ``step`` = optimizer steps so far,
# ``time_s`` = the training clock at the end of the epoch; metrics returned by an ``after_epoch`` hook follow.
METRIC_COLUMNS = ("epoch", "step", "lr", "train_loss", "train_acc", "val_loss", "val_acc", "time_s")


# The settings an exact resume depends on: a checkpoint written under others is refused (a key missing from both the
# checkpoint and the current settings counts as equal: some are recorded only where they are set). The loop's
# settings say which of theirs (LoopSettings.resume_record); the batch, the training split and the DDP world are the
# loop's own.
RESUME_KEYS = (*LoopSettings.resume_keys(), "batch_size", "n_train", "world_size")

# last.ckpt: its keys, in the order TrainState.state_dict writes them and TrainState.load_state_dict reads them back:
# TrainState's own (OWN_KEYS) and those of the rules that own their state (EarlyStopping: stopped_epoch;
# DivergenceRestart: the restarts, the rate scale, the initial loss, the classes and the initial weights). A resume
# reads the keys of _LATER_KEYS with these defaults: a checkpoint of an older ddcnn may lack them.
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


OWN_KEYS = CHECKPOINT_KEYS[: CHECKPOINT_KEYS.index("resumed_from") + 1]

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


class Clock:
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


@dataclass
class TrainState:
    """What one training carries from epoch to epoch: with its stateful objects (the network, the optimizer, the
    schedule, Fabric's precision plugin with the loss scaler) and the loop's rules that keep a state of their own
    (``owners``: early stopping, the restarts; :mod:`ddcnn.engine.callbacks`), everything an exact resume needs.
    Saved whole by :meth:`state_dict` and restored whole by :meth:`load_state_dict`, the one pair that writes and
    reads ``last.ckpt`` (:data:`CHECKPOINT_KEYS`): the keys of this state are :data:`OWN_KEYS`, every other key is an
    owner's (its ``checkpoint_keys``, its ``state_dict()`` and ``load_state_dict(saved)``).

    Attributes:
        clock: The training clock (the time of earlier processes is in ``last.ckpt``).
        owners: The rules whose state ``last.ckpt`` holds beside this one's.
        epoch: The next epoch to train (0-based); ``last.ckpt`` records the last finished one.
        step: Optimizer steps so far (in the current attempt).
        history: Per finished epoch, its row of ``logs/metrics.csv``.
        best_epoch: The kept epoch (the last one that improved), ``-1`` before the first.
        best_metric: Its monitored metric.
        best_net: Its weights (on the CPU).
        resumed_from: The last finished epoch of each checkpoint this training resumed from.
    """

    clock: Clock
    owners: tuple[Any, ...] = ()
    epoch: int = 0
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    best_epoch: int = -1
    best_metric: float | None = None
    best_net: dict[str, torch.Tensor] | None = None
    resumed_from: list[int] = field(default_factory=list)

    def state_dict(self, stateful: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
        """``last.ckpt``'s content: this state, the owners' and the state of the objects in ``stateful``
        (:meth:`_Training.stateful`), and the ``settings`` a resume must agree on (:func:`load_checkpoint`)."""
        scheduler = stateful["scheduler"]
        values = {
            "format": CHECKPOINT_FORMAT,
            "epoch": self.epoch - 1,
            "settings": settings,
            "net": cpu_state(stateful["net"]),
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
        }
        for owner in self.owners:
            values.update(owner.state_dict())
        return {key: values[key] for key in CHECKPOINT_KEYS}

    def load_state_dict(self, checkpoint: Mapping[str, Any], stateful: Mapping[str, Any]) -> None:
        """Restore this state, the owners' and the objects in ``stateful`` from ``checkpoint`` (a :meth:`state_dict`).

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
        for owner in self.owners:
            owner.load_state_dict({key: saved[key] for key in owner.checkpoint_keys})

    def add(self, row: dict[str, float]) -> None:
        """A finished epoch's row."""
        self.history.append(row)
        self.epoch += 1

    def start_over(self) -> None:
        """A new attempt (a restart: the owners record why and at which rates): from epoch 0, nothing kept."""
        self.history, self.best_net, self.best_metric, self.best_epoch = [], None, None, -1
        self.step, self.epoch = 0, 0


def cpu_state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}


def _csv_value(key: str, value: Any) -> Any:
    if value is None:
        return ""
    return int(value) if key in ("epoch", "step") else repr(float(value))


def metrics_csv(history: list[dict[str, float]]) -> str:
    out = io.StringIO()
    extra = list(dict.fromkeys(k for row in history for k in row if k not in METRIC_COLUMNS))
    writer = csv.DictWriter(out, fieldnames=[*METRIC_COLUMNS, *extra], extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: _csv_value(k, v) for k, v in row.items()})
    return out.getvalue()


def load_checkpoint(path: Path, settings: Mapping[str, Any]) -> dict | None:
    """The resumable state in ``path``, ``None`` when there is none.

    Raises:
        ValueError: For a checkpoint of Lightning's Trainer (older ddcnn) or one written under other settings, with
            what to do.
    """
    if not path.is_file():
        return None
    state = load_run_file(path, map_location="cpu")  # tensors and plain values only: no code a file brings runs
    if not isinstance(state, dict) or state.get("format") not in _RESUMABLE_FORMATS:
        lightning = isinstance(state, dict) and ("pytorch-lightning_version" in state or "state_dict" in state)
        who = "Lightning's Trainer (ddcnn before its one Fabric loop)" if lightning else "another program"
        raise ValueError(
            f"{path} was written by {who}; this ddcnn cannot resume it. Delete {path} and run the same command "
            f"again: this training starts over, finished stages stay finished (or finish it with the ddcnn version "
            f"that started it)."
        )
    saved = state.get("settings", {})
    differ = {k: (saved.get(k), settings.get(k)) for k in RESUME_KEYS if saved.get(k) != settings.get(k)}
    if differ:
        shown = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in differ.items())
        raise ValueError(
            f"{path} belongs to a training with other settings ({shown}); resuming it would not give the result of "
            f"either. Restore those settings to resume, or delete {path} (force=true for a stage) to start over."
        )
    return state


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
