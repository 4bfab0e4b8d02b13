"""The loop's callbacks: what a training does besides its steps, as small objects the loop calls by hook name (as
Lightning Fabric's ``fabric.call(hook, ...)`` does), so that a stage adds to a training by handing a callback to
:func:`ddcnn.engine.loop.fit_batches`, never by a new keyword.

Every hook is optional; a callback defines the ones it needs. In the order of an epoch:

- ``on_validation_end(epoch, row, net) -> metrics | None`` (rank 0; outside the training clock): after the epoch's
  validation, with ``net`` in eval mode holding that epoch's weights; the metrics it returns join the epoch's row
  (and ``logs/metrics.csv``). E.g. :class:`ddcnn.stages.common` curve points, the test accuracy of every epoch.
- ``on_log(epoch, row, points)`` (rank 0; outside the clock): the epoch's row and, where the callback's
  ``wants_steps`` is true and ``log_every_n_steps`` is set, ``(optimizer step, mean loss of the last n)`` points: the
  progress bar and the loggers (:class:`ddcnn.engine.loggers.EpochReporter`).
- ``on_epoch_end(epoch, row)`` (every rank; training time): once the epoch's checkpoint, if any, is written; an
  exception it raises stops the training as a kill at that moment would.
- ``on_train_end(epoch, net, restarts) -> (reason, lr_factor) | None`` (every rank; they must decide alike): after
  the last epoch, with ``net`` holding the kept weights: a reason and a factor start the training again from its
  initial weights with the learning rates times the factor (recorded in ``restarts``, as a divergence's), e.g. the
  coarse fit's :class:`ddcnn.stages.coarse.CollapseRefit`.
- ``on_fit_end(status)`` (rank 0): ``success`` or ``failed``.

Callbacks travel to spawned DDP ranks by pickling: module-level classes or functions, no lambdas or closures.

The rules every training has are callbacks of the loop's own, built from its :class:`~ddcnn.settings.LoopSettings`:
:class:`EarlyStopping`, :class:`CheckpointCadence` and :class:`DivergenceRestart`. Those with a state own it: their
``checkpoint_keys``, ``state_dict()`` and ``load_state_dict(saved)`` are their part of ``last.ckpt``
(:class:`ddcnn.engine.state.TrainState` writes and reads it whole, its keys listed once), so a resumed training
continues each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddcnn.engine.convergence import NOT_FINITE_RETRIES, divergence_reason, early_stop_due, last_drop, still_improving
from ddcnn.engine.state import Diverged
from ddcnn.settings.loop import LoopSettings, schedule_kind

__all__ = [
    "EarlyStopping",
    "CheckpointCadence",
    "DivergenceRestart",
    "AfterValidation",
    "OnEpochEnd",
    "call",
    "HOOKS",
]

HOOKS = ("on_validation_end", "on_log", "on_epoch_end", "on_train_end", "on_fit_end")


def call(callbacks, hook: str, *args: Any) -> list[Any]:
    """``hook(*args)`` of every callback that has it, in order; what each returned."""
    out = []
    for callback in callbacks:
        method = getattr(callback, hook, None)
        if method is not None:
            out.append(method(*args))
    return out


class EarlyStopping:
    """Ends a training once ``patience`` epochs have passed since the kept epoch and, under the plateau scheduler,
    since its last drop of the learning rate (the lowered rate gets ``patience`` epochs to improve), not before
    ``least_epochs`` (:func:`~ddcnn.engine.convergence.early_stop_due`) nor ``min_steps`` optimizer steps (the
    ``step`` of the last row); a stop that those held back (its patience ran out before, or on, ``min_epochs``) also
    waits while the training still improves
    (:func:`~ddcnn.engine.convergence.still_improving`: the 3-epoch mean of the monitored metric, or of the training
    loss while the validation loss does not rise, by more than 1%), up to the budget, which the convergence test
    flags. The same on every rank (the monitored metric is the all-reduced
    one). Its state, the epoch it stopped after (``stopped_epoch``), is its part of ``last.ckpt``; the drops and the
    trends are read from the training's history (its rows), which a resume restores."""

    checkpoint_keys = ("stopped_epoch",)

    def __init__(self, settings: LoopSettings) -> None:
        self.patience, self.least, self.max_epochs = settings.patience, settings.least_epochs, settings.max_epochs
        self.least_steps = settings.min_steps
        self.monitor, self.mode = settings.monitor, settings.monitor_mode
        self.plateau = schedule_kind(settings.scheduler) == "plateau"
        self.stopped_epoch: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.stopped_epoch = saved["stopped_epoch"]

    def decide(
        self, epoch: int, best_epoch: int, history: Sequence[Mapping[str, Any]], num_classes: int | None
    ) -> bool:
        """Whether the training stops after ``epoch`` (:meth:`due`), recorded as ``stopped_epoch``."""
        if self.due(epoch, best_epoch, history, num_classes):
            self.stopped_epoch = epoch
        return self.stopped_epoch is not None

    def due(
        self, epoch: int, best_epoch: int, history: Sequence[Mapping[str, Any]] = (), num_classes: int | None = None
    ) -> bool:
        drop = last_drop(history) if self.plateau else -1
        if not early_stop_due(epoch, best_epoch, self.patience, self.least, self.max_epochs, drop):
            return False
        if self.least_steps and history and int(history[-1].get("step") or 0) < self.least_steps:
            return False  # too few optimizer steps yet (engine.min_steps), however many epochs
        since = max(best_epoch, drop - 1)
        if epoch - since == self.patience and epoch + 1 > self.least:
            return True  # the patience ran out now, by itself: the monitored metric stopped improving
        # a stop that min_epochs or min_steps held back (or that falls on min_epochs) waits while the training still
        # improves: the convergence test's "still improving at min_epochs"
        return still_improving(history, self.monitor, self.mode, num_classes) is None


class CheckpointCadence:
    """Whether ``last.ckpt`` is written after an epoch: every ``checkpoint_every_s`` seconds of wall time since the
    last write, else every ``checkpoint_every`` epochs (and always after the last one: the loop's rule)."""

    def __init__(self, settings: LoopSettings) -> None:
        self.every_s, self.every = settings.checkpoint_every_s, settings.checkpoint_every
        self.last_write = time.perf_counter()

    def written(self) -> None:
        self.last_write = time.perf_counter()

    def due(self, epoch: int) -> bool:
        if self.every_s is not None:
            return time.perf_counter() - self.last_write >= self.every_s
        return (epoch + 1) % self.every == 0


class DivergenceRestart:
    """The divergence rule of an epoch and how many restarts are left, at which learning-rate factor.

    Where ``divergence_restarts`` is set, an epoch has diverged when its mean training loss is not finite or exceeds
    ``divergence_factor`` times the larger of the initial loss (the loss of the first training batch before the first
    step; under DDP the global batch's) and ``ln K`` (the loss of a uniform guess over the ``K`` classes: a network
    that starts better than chance may wander above its initial loss without diverging)
    (:func:`~ddcnn.engine.convergence.divergence_reason`), or when its validation loss is not finite (the epoch's last
    steps left weights that are not: a training loss is taken before its step, so only the validation after the epoch
    sees them; torch 2.14's oneDNN 3D convolution on the CPU returns a non-finite weight gradient now and then for
    kernels as large as the input). With ``divergence_restarts=0`` the fit raises :class:`Diverged`; with ``R > 0`` it
    starts again from the initial weights with every learning rate multiplied by ``divergence_lr_factor``, at most
    ``R`` times. Non-finite weights restart even where divergence is not checked, at most :data:`NOT_FINITE_RETRIES`
    times at the same rates. A callback's ``on_train_end`` that asks for another attempt is recorded here too
    (:meth:`restart`). Its state is its part of ``last.ckpt``, so a resumed fit continues the same attempt: the
    restarts (``{"epoch", "reason", "lr_scale"}`` each), the current attempt's learning-rate scale, its initial loss,
    the network's number of outputs (``ln K``) and the initial weights a restart starts from (kept in ``last.ckpt``
    only where divergence is checked; otherwise a resumed process restarts from the weights the stage built, those of
    the same seed)."""

    checkpoint_keys = ("restarts", "lr_scale", "initial_loss", "num_classes", "initial_state")

    def __init__(self, settings: LoopSettings) -> None:
        self.checked = settings.divergence_restarts is not None
        self.allowed = int(settings.divergence_restarts) if self.checked else NOT_FINITE_RETRIES
        self.factor, self.lr_factor = settings.divergence_factor, settings.divergence_lr_factor
        self.restarts: list[dict] = []
        self.lr_scale, self.initial_loss, self.num_classes = 1.0, None, 2
        self.initial_net: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "restarts": self.restarts,
            "lr_scale": self.lr_scale,
            "initial_loss": self.initial_loss,
            "num_classes": self.num_classes,
            "initial_state": self.initial_net if self.checked else None,
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.restarts, self.lr_scale = list(saved["restarts"]), float(saved["lr_scale"])
        self.initial_loss, self.num_classes = saved["initial_loss"], int(saved["num_classes"])
        if saved["initial_state"] is not None:
            self.initial_net = saved["initial_state"]

    def reason(self, train_loss: float) -> str | None:
        """Why an epoch of mean training loss ``train_loss`` diverged, ``None`` if it did not (or unchecked)."""
        if not self.checked:
            return None
        return divergence_reason(train_loss, self.initial_loss, self.num_classes, self.factor)

    def restart(self, epoch: int, reason: str, lr_factor: float) -> None:
        """A new attempt after ``epoch`` (it diverged, or a callback asked for one): the learning rates times
        ``lr_factor`` once more, its initial loss measured again."""
        self.lr_scale *= lr_factor
        self.restarts.append({"epoch": epoch, "reason": reason, "lr_scale": self.lr_scale})
        self.initial_loss = None

    def failure(self, where: str, restarts: int, epoch: int, reason: str) -> Diverged:
        """The error of a training that diverged with no restart left, with what to do."""
        advice = "Lower the learning rate (or scale the inputs), then run again with force=true."
        if not self.checked:  # the same attempt failed alike every time
            advice = (
                "The same training, at the same learning rates, left weights that are not finite every time: a "
                "learning rate too high (lower it) or a numerical fault of a kernel (torch 2.14's oneDNN 3D "
                "convolution on the CPU, for kernels as large as the sub-domain: larger sub-domains, more overlap "
                "or a smaller stem). Then run again with force=true."
            )
        lower = " with lower learning rates" if self.checked else ""
        return Diverged(f"{where}, after {restarts} restart(s){lower}. {advice}", epoch, reason)

    def next_scale(self, restarts_so_far: int) -> float | None:
        """The learning-rate factor of the next attempt, ``None`` when no restart is left."""
        if restarts_so_far >= self.allowed:
            return None
        return self.lr_factor if self.checked else 1.0


class AfterValidation:
    """``on_validation_end`` from a function ``(epoch, row, net) -> metrics | None`` (module-level, so it pickles)."""

    def __init__(self, function: Callable[[int, Mapping[str, float], Any], Mapping[str, float] | None]) -> None:
        self.function = function

    def on_validation_end(self, epoch: int, row: Mapping[str, float], net) -> Mapping[str, float] | None:
        return self.function(epoch, row, net)


class OnEpochEnd:
    """``on_epoch_end`` from a function ``(epoch, row) -> None`` (module-level, so it pickles)."""

    def __init__(self, function: Callable[[int, Mapping[str, float]], None]) -> None:
        self.function = function

    def on_epoch_end(self, epoch: int, row: Mapping[str, float]) -> None:
        self.function(epoch, row)
