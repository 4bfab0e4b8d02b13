"""When a training has converged, and when it diverged: the loop's one improvement rule (selection, early stopping,
the plateau scheduler), early stopping's test, the convergence record of a finished training (docs/protocol.md,
"Convergence") with the advice for one that did not converge, and the divergence rule of an epoch. "Verdict" stays
the statistical word of :mod:`ddcnn.report.stats`.

A finished training is not converged (:func:`convergence`) for one of these causes, the first that applies:

- ``too_short``: fewer than 3 epochs;
- ``before_min_epochs``: early stopping ended it before ``min_epochs``;
- ``rate_collapsed``: under the plateau scheduler, its learning rate fell below 1% of its start while its
  training loss still fell (the mean of the 3 epochs before the collapse more than 1% below the 3 before them);
- ``still_improving``: early stopping ended it at ``min_epochs`` while its monitored metric (3-epoch means, by more
  than 1% in its direction) or its training loss (by more than 1%, while the validation loss did not rise) still
  improved (:func:`still_improving`; today's early stopping waits while it holds: this names older trainings);
  or the budget ended it with a scheduled rate (the plateau scheduler's too) above 10% of its start; or
  at a constant rate with its training loss still falling by more than 1% (and above 1% of ``ln num_classes``);
  or, with early stopping on (``patience``), the budget ended it while :func:`still_improving` held (early
  stopping waited for it, the budget did not), whatever its rate;
- ``overfitting``: one of those budget cases while its training loss fell and its validation loss rose (3-epoch
  means, by more than 1% each): more epochs are the wrong way;
- ``stopped_after_drop``: early stopping ended it fewer than ``patience`` epochs after the plateau scheduler's
  last drop (the lowered rate had no time to improve the metric);
- ``erratic_validation``: it kept one of its first two epochs (0-based <= 1) while the validation loss from the
  kept one on varies by more than 2x (largest over smallest; and by more than 1% of ``ln K``) and moves both ways (a
  rise and a fall of more than 10% between epochs): a peak of noise, not a minimum; with ``n_val`` given the reason
  names the split's binomial standard error, and ``small_validation`` is the cause when that is above 1 accuracy point;
  ``batch_norm_statistics`` instead when the network normalises with batch norm's running statistics
  (``batch_norm="running"``; ``"precise"``: recomputed before each validation, ``None``: no batch norm) and its
  training loss fell smoothly meanwhile (no rise of more than 10% between epochs): the running averages lagged
  the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "improves",
    "last_drop",
    "still_improving",
    "early_stop_due",
    "binomial_se",
    "convergence",
    "convergence_advice",
    "divergence_reason",
    "NOT_FINITE_RETRIES",
    "JUDGE_EPOCHS",
]


# Restarts of a training whose weights became non-finite where divergence is not checked (divergence_restarts null).
NOT_FINITE_RETRIES = 3


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


def last_drop(history: Sequence[Mapping[str, Any]]) -> int:
    """The last epoch (0-based) of ``history`` that trained at a lower learning rate than the epoch before it
    (``-1``: none): the first epoch at the rate of the latest drop."""
    lrs = [row.get("lr") for row in history]
    for e in range(len(lrs) - 1, 0, -1):
        if lrs[e] is not None and lrs[e - 1] is not None and float(lrs[e]) < float(lrs[e - 1]) * (1 - 1e-9):
            return e
    return -1


def early_stop_due(
    epoch: int,
    best_epoch: int,
    patience: int | None,
    min_epochs: int,
    max_epochs: int,
    drop_epoch: int = -1,
) -> bool:
    """Early stopping after ``epoch`` (0-based): ``patience`` epochs have passed since the kept epoch ``best_epoch``
    (the last one that :func:`improves` on the kept one before it; ``-1``: none yet) and since the plateau scheduler's
    last drop (``drop_epoch``, the first epoch at the lowered rate, counted as if the epoch before it had improved:
    the training sees ``patience`` epochs at the new rate before it may stop), at least ``min_epochs`` epochs have
    run, and the budget is not over anyway."""
    if patience is None or best_epoch < 0 or epoch >= max_epochs - 1:
        return False
    since = max(best_epoch, drop_epoch - 1)
    return epoch - since >= patience and epoch + 1 >= min_epochs


# The convergence test (docs/protocol.md, "Convergence"): the epochs it needs to judge, the trends it reads (the mean
# of the last 3 epochs against the mean of the 3 before them: one epoch's loss under a constant rate moves by tens of
# percent from batch noise alone), how much that mean may still improve, and how high a scheduled learning rate may
# still be when the budget ends, as a fraction of its start. Below LOSS_FLOOR x ln K (the loss of a uniform guess over
# K classes) the training data are fit almost exactly: a loss falling from 5e-4 to 3e-4 by then is no sign of a
# training that needs more epochs.
JUDGE_EPOCHS = 3
LOSS_WINDOW = 3
LOSS_STILL_FALLING = 0.01
LOSS_FLOOR = 0.01
LR_STILL_HIGH = 0.1


# A learning rate below this fraction of its start has collapsed: at 1% a step moves the weights a hundredth of what
# it did, so an early stop or a flat loss then says nothing of the minimum (issue #45: 2e-3 -> 2e-9 by epoch 9 of a
# ReduceLROnPlateau(patience=0) on 106 validation images, every training then "converged").
LR_COLLAPSED = 0.01


# The kept epoch of an erratic validation curve: one of the first two epochs (0-based <= EARLY_KEEP) kept while the
# validation loss from it on varies by more than ERRATIC_RATIO (largest over smallest): a peak of noise, not a minimum.
EARLY_KEEP = 1
ERRATIC_RATIO = 2.0


# Batch norm's running statistics (evaluation mode) are running averages of the last steps' batch statistics; when
# the weights move fast or the batches are small (3D volumes) they lag the weights, and the validation loss spikes
# between epochs while the training loss (batch statistics) falls smoothly: AdrenalMNIST3D's global CNN, 0.35 -> 1.07
# at epoch 7 with the training loss falling every epoch; its validation loss after recomputing the statistics over
# the training set was 0.42 where evaluation mode gave 0.95 (epoch 0). The fix: recompute them from this many
# training batches before each validation (engine.precise_bn), about as many forwards more per epoch (enough:
# :data:`ddcnn.settings.loop.PRECISE_BN_AUTO`).
PRECISE_BN_BATCHES = 10


# Validation noise: a binomial standard error of the validation accuracy above this (1 point) is a split too small to
# judge an accuracy on (one image of 100 is a point).
SMALL_SPLIT_SE = 0.01


def _trend(values: Sequence[Any]) -> float | None:
    """The relative change of the mean of the last ``LOSS_WINDOW`` values against the mean of the as many values
    before them (fewer in a shorter training, at least 1 each); ``None`` when unknown."""
    w = min(LOSS_WINDOW, len(values) // 2)
    if w < 1 or any(v is None or not math.isfinite(float(v)) for v in values[-2 * w :]):
        return None
    before = sum(float(v) for v in values[-2 * w : -w]) / w
    last = sum(float(v) for v in values[-w:]) / w
    return (last - before) / abs(before) if before != 0 else None


def binomial_se(accuracy: float | None, n: int | None) -> float | None:
    """The binomial standard error of an accuracy ``p`` on ``n`` images, with Agresti and Coull's adjustment (two
    right and two wrong images added: ``p~ = (n p + 2) / (n + 4)``, ``sqrt(p~ (1 - p~) / (n + 4))``), so that an
    accuracy of 1 on 10 images reads as the noisy figure it is (9.4 points), not as exact (the plain
    ``sqrt(p (1 - p) / n)`` is 0 there); from 100 images on it differs from the plain one by less than 0.2 points at
    accuracies between 0.1 and 0.9. ``p`` = 0.5 when unknown (the largest); ``None`` without ``n``."""
    if not n:
        return None
    p = 0.5 if accuracy is None or not math.isfinite(float(accuracy)) else min(max(float(accuracy), 0.0), 1.0)
    adjusted = (p * int(n) + 2) / (int(n) + 4)
    return math.sqrt(adjusted * (1 - adjusted) / (int(n) + 4))


def _series(history: Sequence[Mapping[str, Any]], key: str) -> list[Any]:
    return [row.get(key) for row in history]


@dataclass(frozen=True)
class _Trends:
    """What the end of a history shows (:func:`_trends`): the 3-epoch trends of the training loss (``change``), the
    validation loss and the monitored metric, the loss below which the training data are fit almost exactly
    (``floor``: :data:`LOSS_FLOOR` x ln K), whether the training loss still falls (and is not fit exactly) and whether
    the validation loss rises (each by more than 1%)."""

    change: float | None
    val_change: float | None
    monitor_change: float | None
    floor: float
    loss_falls: bool
    val_rises: bool


def _trends(history: Sequence[Mapping[str, Any]], monitor: str | None, num_classes: int | None) -> _Trends:
    losses = _series(history, "train_loss")
    change, val_change = _trend(losses), _trend(_series(history, "val_loss"))
    recent = [float(v) for v in losses[-LOSS_WINDOW:] if v is not None]
    floor = LOSS_FLOOR * math.log(max(int(num_classes), 2)) if num_classes else 0.0
    fit_exactly = bool(recent) and sum(recent) / len(recent) < floor
    return _Trends(
        change=change,
        val_change=val_change,
        monitor_change=_trend(_series(history, monitor)) if monitor else None,
        floor=floor,
        loss_falls=change is not None and change < -LOSS_STILL_FALLING and not fit_exactly,
        val_rises=val_change is not None and val_change > LOSS_STILL_FALLING,
    )


def still_improving(
    history: Sequence[Mapping[str, Any]], monitor: str | None, monitor_mode: str = "max", num_classes: int | None = None
) -> str | None:
    """What still improves at the end of ``history``, or ``None``: the monitored metric (the mean of its last 3 epochs
    more than 1% better than the 3 before, in its direction; fewer epochs each in a shorter history), or the training
    loss (more than 1% lower, while the validation loss did not rise by more than 1% and the training data are not
    fit almost exactly). Early stopping does not end a training while this holds after its minimums held a stop back
    (:class:`~ddcnn.engine.callbacks.EarlyStopping`), and the convergence test reads a stop at ``min_epochs``, or the
    budget with early stopping on, with it as not converged (:func:`convergence`): one rule for both."""
    if len(history) < JUDGE_EPOCHS:
        return None
    t = _trends(history, monitor, num_classes)
    improves = t.monitor_change is not None and (
        t.monitor_change > LOSS_STILL_FALLING if monitor_mode == "max" else t.monitor_change < -LOSS_STILL_FALLING
    )
    if improves:
        return f"its {monitor} still improved ({t.monitor_change:+.1%} over the last 3 epochs)"
    if t.loss_falls and not t.val_rises:
        return f"its training loss still fell ({t.change:+.1%} over the last 3 epochs)"
    return None


def convergence(
    history: list[Mapping[str, Any]],
    stopped_by: str,
    min_epochs: int = 0,
    scheduled: bool = False,
    num_classes: int | None = None,
    *,
    monitor: str | None = None,
    monitor_mode: str = "max",
    patience: int | None = None,
    best_epoch: int | None = None,
    plateau: bool = False,
    n_val: int | None = None,
    max_epochs: int | None = None,
    batch_norm: str | None = None,
) -> dict[str, Any]:
    """Whether a training converged, from its per-epoch ``history`` (rows with ``train_loss``, ``lr`` and, where it
    validated, ``val_loss`` and the ``monitor``), what ended it (``early_stopping``, ``budget``), the epochs early
    stopping had to wait for and whether its learning rate followed a schedule (``plateau``: ``ReduceLROnPlateau``);
    docs/protocol.md, "Convergence" says why this test. Not converged for the first cause of the module's list that
    applies (``cause`` names it for :func:`convergence_advice`).

    Returns:
        ``{"converged", "reasons", "cause", "epochs", "min_epochs", "stopped_by", "lr_ratio",
        "train_loss_change_last3", "val_loss_change_last3", "monitor_change_last3", "best_epoch", "patience",
        "max_epochs", "lr_start", "n_val", "val_se", "monitor", "plateau", "batch_norm"}``: ``lr_ratio`` is the last
        epoch's learning rate over the first's, the ``*_change_last3`` the relative change of the 3-epoch means (fewer
        when shorter; ``None`` when unknown), ``val_se`` the binomial standard error of the validation accuracy at the
        kept epoch.
    """
    epochs = len(history)
    losses = _series(history, "train_loss")
    watched = _series(history, monitor) if monitor else []
    t = _trends(history, monitor, num_classes)
    lrs = _series(history, "lr")
    lr0 = float(lrs[0]) if epochs and lrs[0] is not None else None
    lr_ratio = float(lrs[-1]) / lr0 if epochs and lrs[-1] is not None and lr0 else None
    best = best_epoch
    if best is None and watched and monitor:
        best = _best_epoch(watched, monitor_mode)
    kept_acc = history[best].get("val_acc") if best is not None and 0 <= best < epochs else None
    val_se = binomial_se(kept_acc, n_val)
    se_note = f" (validation split of {n_val} images: 1 binomial SE = {100 * val_se:.1f} points)" if val_se else ""
    # only a rate that adapts can collapse: a fixed schedule (cosine annealing) is meant to end near 0, and the budget
    # rule below judges it by how far it decayed
    collapse = _collapse(lrs, losses, lr0, t.floor) if plateau else None
    cause, why = None, ""
    if epochs < JUDGE_EPOCHS:
        cause, why = "too_short", f"too short to judge: {epochs} epoch(s), fewer than {JUDGE_EPOCHS}"
    elif stopped_by == "early_stopping" and epochs < min_epochs:
        cause, why = "before_min_epochs", f"stopped after {epochs} epochs, before min_epochs={min_epochs}"
    elif collapse is not None:
        epoch, ratio, falling = collapse
        cause = "rate_collapsed"
        why = (
            f"rate collapsed: the learning rate fell to {ratio:.2g} of its start (below {LR_COLLAPSED:.0%}) at epoch "
            f"{epoch} while the training loss still fell ({falling:+.1%} over the 3 epochs before)"
        )
    elif (
        stopped_by == "early_stopping"
        and epochs == min_epochs
        and (what := still_improving(history, monitor, monitor_mode, num_classes))
    ):
        cause = "still_improving"
        why = f"early stopping ended it at min_epochs={min_epochs} while {_noted(what, monitor, se_note)}"
    elif stopped_by == "budget" and (budget := _budget_cause(t, scheduled, lr_ratio, se_note)):
        cause, why = budget
    elif (
        stopped_by == "budget"
        and patience is not None
        and (what := still_improving(history, monitor, monitor_mode, num_classes))
    ):
        # early stopping waited while it improved (EarlyStopping: one rule) and the budget came first, whatever the
        # rate had come down to
        cause, why = "still_improving", f"budget ended it while {_noted(what, monitor, se_note)}"
    if cause is None:
        cause, why = _stop_causes(history, stopped_by, patience, plateau, best, (val_se, se_note, t.floor), batch_norm)
    reasons = [why] if cause is not None and why else []
    return {
        "converged": not reasons,
        "reasons": reasons,
        "cause": cause if reasons else None,
        "epochs": epochs,
        "min_epochs": int(min_epochs),
        "stopped_by": stopped_by,
        "lr_ratio": lr_ratio,
        "train_loss_change_last3": t.change,
        "val_loss_change_last3": t.val_change,
        "monitor_change_last3": t.monitor_change,
        "best_epoch": best,
        "patience": patience,
        "max_epochs": max_epochs,
        "lr_start": lr0,
        "n_val": n_val,
        "val_se": val_se,
        "monitor": monitor,
        "plateau": bool(plateau),
        "batch_norm": batch_norm,
    }


def _noted(what: str, monitor: str | None, se_note: str) -> str:
    """What still improves, with the validation split's noise where it is the monitored metric that does."""
    return f"{what}{se_note}" if what.startswith(f"its {monitor} ") else what


def _budget_cause(t: _Trends, scheduled: bool, lr_ratio: float | None, se_note: str) -> tuple[str, str] | None:
    """:func:`convergence`'s cause of a training the budget ended with a scheduled rate still above 10% of its start,
    or at a constant rate while its training loss still fell: ``overfitting`` where the validation loss rose
    meanwhile, else ``still_improving``; ``None`` when neither holds."""
    if not (
        (scheduled and lr_ratio is not None and lr_ratio > LR_STILL_HIGH * (1 + 1e-9))
        or (not scheduled and t.loss_falls)
    ):
        return None
    if t.loss_falls and t.val_rises:
        return "overfitting", (
            f"overfitting: the budget ended it while the training loss fell ({t.change:+.1%} over the last 3 "
            f"epochs) and the validation loss rose ({t.val_change:+.1%}){se_note}"
        )
    if scheduled:
        return "still_improving", f"budget ended with the learning rate still at {lr_ratio:.0%} of its start"
    return (
        "still_improving",
        f"budget ended while the training loss still fell ({t.change:+.1%} over the last 3 epochs)",
    )


def _stop_causes(
    history: list[Mapping[str, Any]],
    stopped_by: str,
    patience: int | None,
    plateau: bool,
    best: int | None,
    noise: tuple[float | None, str],
    batch_norm: str | None,
) -> tuple[str | None, str]:
    """:func:`convergence`'s causes read from where a training stopped and what it kept: ``stopped_after_drop`` and
    ``erratic_validation`` / ``small_validation`` / ``batch_norm_statistics``; ``(None, "")`` when none applies.
    ``noise``: the validation split's binomial standard error at the kept epoch, the note that says it and the loss
    below which a difference is no signal (:data:`LOSS_FLOOR` x ln K)."""
    epochs, (val_se, se_note, floor) = len(history), noise
    val_losses = _series(history, "val_loss")
    drop = last_drop(history) if plateau else -1
    if stopped_by == "early_stopping" and patience and drop > 0 and epochs - drop < patience:
        why = (
            f"early stopping ended it {epochs - drop} epoch(s) after the learning rate dropped (epoch {drop}), fewer "
            f"than patience={patience}"
        )
        return "stopped_after_drop", why
    if best is not None and best <= EARLY_KEEP and epochs > best + 1:
        after = [float(v) for v in val_losses[best:] if v is not None and math.isfinite(float(v))]
        if _erratic(after, floor):
            why = (
                f"kept epoch {best} of an erratic validation curve (its validation loss varies "
                f"{max(after) / min(after):.1f}x from there on"
            )
            train = [float(v) for v in _series(history, "train_loss")[best:] if v is not None]
            if batch_norm == "running" and all(b <= 1.1 * a for a, b in zip(train, train[1:], strict=False)):
                why += (
                    " while the training loss fell smoothly: batch norm's running statistics, which evaluation uses, "
                    f"lagged the weights){se_note}"
                )
                return "batch_norm_statistics", why
            small = val_se is not None and val_se > SMALL_SPLIT_SE
            return ("small_validation" if small else "erratic_validation"), f"{why}){se_note}"
    return None, ""


def _erratic(val_losses: Sequence[float], floor: float = 0.0) -> bool:
    """Whether validation losses (from the kept epoch on) are erratic: their largest is more than
    :data:`ERRATIC_RATIO` times their smallest, and they move both ways (a rise and a fall of more than 10% from one
    epoch to the next): noise, not the steady rise of a training that overfits after its best epoch. Losses that
    differ by less than ``floor`` (1% of ln K) are not erratic, whatever their ratio: a network that fits its
    validation split almost exactly (0.0004 then 0.001) changes no decision."""
    if len(val_losses) < 3 or min(val_losses) <= 0 or max(val_losses) / min(val_losses) <= ERRATIC_RATIO:
        return False
    if max(val_losses) - min(val_losses) < floor:
        return False
    steps = [b / a for a, b in zip(val_losses, val_losses[1:], strict=False)]
    return any(r > 1.1 for r in steps) and any(r < 1 / 1.1 for r in steps)


def _best_epoch(values: Sequence[Any], mode: str) -> int | None:
    """The kept epoch of a record that did not say it: the last one that :func:`improves` on the kept before."""
    best, best_value = None, None
    for e, v in enumerate(values):
        if v is not None and improves(float(v), best_value, mode):
            best, best_value = e, float(v)
    return best


def _collapse(lrs: Sequence[Any], losses: Sequence[Any], lr0: float | None, floor: float) -> tuple[int, float, float]:
    """``(epoch, lr ratio, loss trend)`` where the learning rate first fell below :data:`LR_COLLAPSED` of its start
    while the training loss of the epochs before still fell by more than 1% (3-epoch means), else ``None``."""
    if not lr0:
        return None
    for e, lr in enumerate(lrs):
        if lr is None or float(lr) >= LR_COLLAPSED * lr0 * (1 - 1e-9):
            continue
        before = losses[:e]
        trend = _trend(before)
        recent = [float(v) for v in before[-LOSS_WINDOW:] if v is not None]
        exact = bool(recent) and sum(recent) / len(recent) < floor
        if trend is not None and trend < -LOSS_STILL_FALLING and not exact:
            return e, float(lr) / lr0, trend
        return None
    return None


def _setting(names: Mapping[str, str], key: str, value: Any) -> str:
    """``name=value`` for the setting ``key`` names, or ``""`` where the training has none."""
    return f"{names[key]}={value}" if names.get(key) else ""


def _lower_lr(names: Mapping[str, Any], lr0: Any) -> str:
    """``lr=value`` for a third of the start rate ``lr0``: the rate itself, or with ``lr_base`` a factor on it (the
    training's rate is ``optimizer.lr`` times a setting such as ``global_lr_scale``)."""
    if not lr0:
        return names["lr"]
    value = float(lr0) / 3 / float(names.get("lr_base") or 1.0)
    return f"{names['lr']}={value:.3g}"


def _on_val_loss(names: Mapping[str, str]) -> str:
    """The settings that select on the validation loss (its direction where the training has a setting for it)."""
    mode = f" {names['monitor_mode']}=min" if names.get("monitor_mode") else ""
    return f"{names['monitor']}=val_loss{mode}"


def convergence_advice(record: Mapping[str, Any], names: Mapping[str, Any] | None = None) -> str:
    """The cause an unconverged training's record (:func:`convergence`) detected and ONE fix with the values to type,
    never one already in use. ``names`` maps ``epochs`` (the budget), ``patience``, ``min_epochs``, ``scheduler``
    (the schedule's node), ``monitor`` (with ``monitor_mode``), ``lr`` and ``precise_bn`` to the settings to name
    (default: the run's ``trainer.max_epochs``, ``engine.patience``, ``engine.min_epochs``, ``scheduler``,
    ``engine.monitor``, ``engine.monitor_mode``, ``optimizer.lr``, ``engine.precise_bn``; ``""`` where the training
    has none), ``plateau`` to ``""`` where the plateau scheduler is not an option and ``lr_base`` to ``optimizer.lr``
    where ``lr`` names a factor on it (``global_lr_scale``, ``methods.<stage>.lr_scale``).

    Causes and fixes: still improving at the cap (``epochs`` doubled); still improving when early stopping ended it
    at ``min_epochs`` (a ``patience`` 2 larger); overfitting (early stopping: ``patience`` 3, or, where early stopping
    is on, selection on ``val_loss``); rate collapsed (the plateau scheduler's ``min_lr`` at 1% of the start rate);
    stopped within ``patience`` epochs of a rate drop (``patience`` 2 larger, counted from the drop); batch norm's
    running statistics lagging the weights (``precise_bn``: recomputed from :data:`PRECISE_BN_BATCHES` training
    batches); an erratic or too small validation split (selection on ``val_loss``, or, where it is in use, a lower
    learning rate).
    """
    name = {
        "epochs": "trainer.max_epochs",
        "patience": "engine.patience",
        "min_epochs": "engine.min_epochs",
        "scheduler": "scheduler",
        "monitor": "engine.monitor",
        "monitor_mode": "engine.monitor_mode",
        "lr": "optimizer.lr",
        "precise_bn": "engine.precise_bn",
        "plateau": "yes",
        **(names or {}),
    }
    cause, stopped_by = record.get("cause"), record.get("stopped_by")
    epochs = int(record.get("epochs") or 0)
    budget = int(record.get("max_epochs") or epochs or 1)
    patience = record.get("patience")
    more_epochs = _setting(name, "epochs", max(2 * budget, budget + 10))
    longer_wait = _setting(name, "patience", (int(patience) if patience else 2) + 2) or more_epochs
    if stopped_by == "max_iter":
        return f"the solver hit its iteration cap: {_setting(name, 'epochs', 2 * max(epochs, 1))}"
    if cause in (None, "too_short", "before_min_epochs") and stopped_by == "early_stopping":
        least = max(JUDGE_EPOCHS, 2 * int(record.get("min_epochs") or 0), epochs + 2)
        fix = _setting(name, "min_epochs", least) or longer_wait
        return f"early stopping ended it too soon: {fix}"
    if cause == "rate_collapsed":
        lr0 = record.get("lr_start")
        if name.get("scheduler") and lr0:
            return (
                f"rate collapsed (the plateau scheduler lowered the rate below 1% of its start while the training loss "
                f"still fell): ++{name['scheduler']}.min_lr={LR_COLLAPSED * float(lr0):.3g}"
            )
        return f"rate collapsed: a constant learning rate ({name['scheduler'] or 'no scheduler'}) or {more_epochs}"
    if cause == "overfitting":
        if patience is None and name.get("patience"):
            return (
                "overfitting (validation loss rising while the training loss falls; more epochs are the wrong way): "
                f"early stopping at the best validation epoch, {name['patience']}=3"
                + (" (with the plateau scheduler: its patience + 2 or more)" if record.get("plateau") else "")
            )
        if record.get("monitor") != "val_loss" and name.get("monitor"):
            return (
                "overfitting (validation loss rising while the training loss falls): select on the validation loss, "
                f"{_on_val_loss(name)}"
            )
        lower = _lower_lr(name, record.get("lr_start"))
        return f"overfitting (validation loss rising while the training loss falls): a lower learning rate, {lower}"
    if cause == "still_improving" and stopped_by == "early_stopping":
        return f"still improving when early stopping ended it at min_epochs: {longer_wait}"
    if cause == "stopped_after_drop":
        return f"stopped right after a learning-rate drop: {longer_wait}"
    if cause == "batch_norm_statistics" and name.get("precise_bn"):
        return (
            "a validation loss that spikes on a smoothly falling training loss (batch norm's running statistics lag "
            f"the weights): recompute them before each validation, {name['precise_bn']}={PRECISE_BN_BATCHES}"
        )
    if cause in ("erratic_validation", "small_validation", "batch_norm_statistics"):
        se = record.get("val_se")
        what = (
            f"a validation split too small to judge (1 binomial SE = {100 * se:.1f} points on {record.get('n_val')} "
            "images)"
            if cause == "small_validation" and se
            else "an erratic validation curve"
        )
        if record.get("monitor") != "val_loss" and name.get("monitor"):
            return f"{what}: select on the validation loss, {_on_val_loss(name)}"
        lr0 = record.get("lr_start")
        if lr0 and name.get("lr"):
            return f"{what}: a lower learning rate, {_lower_lr(name, lr0)}"
        return f"{what}: more validation data (data.val_fraction)"
    # still improving at the cap (the budget ended it), or a record without a cause (an older ddcnn)
    return f"still improving at the cap: {more_epochs}"


def divergence_reason(loss: float, initial: float | None, num_classes: int, factor: float) -> str | None:
    """Why an epoch with mean training loss ``loss`` diverged (the module doc's rule), or ``None``."""
    if not math.isfinite(loss):
        return f"train_loss {loss}"
    chance = math.log(max(num_classes, 2))
    reference = max(initial, chance) if initial is not None and math.isfinite(initial) else chance
    if loss > factor * reference:
        what = f"initial {initial:.4g}" if reference != chance else f"ln K {chance:.4g}"
        return f"train_loss {loss:.4g} > {factor:g} x {what}"
    return None
