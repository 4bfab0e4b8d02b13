"""When a training has converged, and when it diverged: the loop's one improvement rule (selection, early stopping,
the plateau scheduler), early stopping's test, the convergence record of a finished training (docs/protocol.md,
"Convergence") with the advice for one that did not converge, and the divergence rule of an epoch. "Verdict" stays
the statistical word of :mod:`ddcnn.report.stats`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "improves",
    "early_stop_due",
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
