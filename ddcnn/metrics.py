"""Figures that training and reporting share: the majority-class rate and what counts as "at chance".

A classifier is at chance when it does no better than always predicting the most frequent training class (the
majority-class rate, not ``1/K``: with uneven classes ``1/K`` is far below what a constant guess achieves).
"""

from __future__ import annotations

import math

import torch

__all__ = ["majority_rate", "chance_margin", "near_chance"]

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
