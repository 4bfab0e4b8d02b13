"""Figures that training and reporting share: the majority-class rate and what counts as "at chance".

A classifier is at chance when it does no better than always predicting the most frequent training class (the
majority-class rate, not ``1/K``: with uneven classes ``1/K`` is far below what a constant guess achieves).

On an imbalanced test set of a few hundred samples "within noise of the majority rate" is a wide band (77% majority,
298 samples: 0.70-0.84), and a classifier in it may still separate the classes well (AdrenalMNIST3D: accuracy 0.81,
ROC AUC 0.87). A results row is therefore at chance only when *every* figure it has is within noise of what a guess
unrelated to the labels scores (:func:`at_chance`): accuracy against the majority rate, and then its ROC AUC against
0.5 or, without scores, its balanced accuracy against ``1/K``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["majority_rate", "chance_margin", "near_chance", "at_chance", "decides_constant"]

# Standard errors of the majority-class rate (and at least 1 point) within which an accuracy is "at chance".
CHANCE_SE = 3.0


def majority_rate(train_labels: torch.Tensor, labels: torch.Tensor) -> float:
    """The accuracy on ``labels`` of always predicting the most frequent class of ``train_labels``."""
    most = int(torch.bincount(train_labels.long()).argmax())
    return float((labels.long() == most).float().mean())


def chance_margin(rate: float, n: int) -> float:
    """How far above the majority-class ``rate`` an accuracy on ``n`` samples must lie to be above chance."""
    se = math.sqrt(max(rate * (1 - rate), 1e-6) / max(n, 1))
    return max(0.01, CHANCE_SE * se)


def near_chance(accuracy: float, rate: float, n: int) -> bool:
    """Whether ``accuracy`` on ``n`` samples is within noise (3 standard errors, at least 1 point) of ``rate``."""
    return accuracy <= rate + chance_margin(rate, n)


def _auc_margin(present: Sequence[int]) -> float:
    """How far above 0.5 a ROC AUC (one-vs-rest, macro-averaged beyond two classes) on test classes of sizes
    ``present`` (none empty) must lie to be above chance: 3 standard errors of the AUC of scores unrelated to the
    labels (Hanley & McNeil 1982: variance ``(n1 + n0 + 1) / (12 n1 n0)``; the classes' AUCs taken as independent), at
    least 1 point."""
    n = sum(present)
    if len(present) < 2:
        return math.inf  # no AUC can be computed with one class
    variances = [(n + 1) / (12 * c * (n - c)) for c in present]
    variance = variances[0] if len(present) == 2 else sum(variances) / len(present) ** 2
    return max(0.01, CHANCE_SE * math.sqrt(variance))


def _balanced_margin(present: Sequence[int]) -> float:
    """How far above ``1/K`` a balanced accuracy on test classes of sizes ``present`` (none empty) must lie to be
    above chance: 3 standard errors of the mean per-class recall of a guess that picks each of the ``K`` classes with
    probability ``1/K`` whatever the sample, at least 1 point."""
    k = max(len(present), 1)
    variance = sum((1 / k) * (1 - 1 / k) / c for c in present) / k**2
    return max(0.01, CHANCE_SE * math.sqrt(variance))


def at_chance(
    accuracy: float,
    rate: float,
    counts: Sequence[int],
    *,
    auc: float | None = None,
    balanced_accuracy: float | None = None,
) -> bool:
    """Whether a classifier's results on test classes of sizes ``counts`` are at chance: its ``accuracy`` within noise
    of the majority-class ``rate`` and, when it has one, its ``auc`` within noise of 0.5 (the scores do not rank the
    classes) or, without an AUC, its ``balanced_accuracy`` within noise of ``1/K``. Any figure clearly above chance
    clears the row: an imbalanced test set's accuracy alone cannot tell a weak classifier from a constant guess.
    Classes absent from the test set (count 0) do not count."""
    present = [int(c) for c in counts if int(c) > 0]
    if not near_chance(accuracy, rate, sum(present)):
        return False
    if auc is not None and math.isfinite(auc):
        return auc <= 0.5 + _auc_margin(present)
    if balanced_accuracy is not None and math.isfinite(balanced_accuracy):
        return balanced_accuracy <= 1 / max(len(present), 1) + _balanced_margin(present)
    return True


# The share of a classifier's test decisions on one class at or above which it decides like a constant guess.
CONSTANT_SHARE = 0.98


def decides_constant(
    accuracy: float, rate: float, counts: Sequence[int], *, auc: float | None, decision_share: float | None
) -> bool:
    """Whether a classifier whose scores rank the classes (``auc`` clearly above 0.5, so :func:`at_chance` clears
    it) still decides like a constant guess: at least :data:`CONSTANT_SHARE` of its test decisions are one class
    (``decision_share``) and its ``accuracy`` is within noise of the majority-class ``rate``. Its accuracy then says
    no more than always answering that class does, and a verdict on accuracy against it says nothing of the method
    compared. An imbalanced set's weak classifier that does decide (AdrenalMNIST3D: accuracy 0.81 against a rate of
    0.77, balanced accuracy 0.59) is not one. ``False`` when a figure is missing or the row is at chance outright."""
    if auc is None or decision_share is None or not math.isfinite(auc):
        return False
    present = [int(c) for c in counts if int(c) > 0]
    if len(present) < 2 or not near_chance(accuracy, rate, sum(present)):
        return False
    return auc > 0.5 + _auc_margin(present) and decision_share >= CONSTANT_SHARE
