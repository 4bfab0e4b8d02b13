"""Cheap ways to combine the local decisions without training: mean probability and majority vote.

Both take the saved local class probabilities of shape ``(n, N, K)`` (``n`` samples, ``N`` sub-domains,
``K`` classes) and return predicted classes ``(n,)``.
"""

from __future__ import annotations

import torch

__all__ = ["mean_probability", "majority_vote"]


def _check(probs: torch.Tensor) -> None:
    if probs.dim() != 3:
        raise ValueError(
            f"expected local probabilities of shape (samples, subdomains, classes), got {tuple(probs.shape)}."
        )


def mean_probability(probs: torch.Tensor) -> torch.Tensor:
    """Class with the largest mean probability over the sub-domains (ties: the smallest class index)."""
    _check(probs)
    return probs.mean(dim=1).argmax(dim=-1)


def majority_vote(probs: torch.Tensor) -> torch.Tensor:
    """Class predicted by most local nets.

    Ties are broken deterministically: among the classes with the most votes, the one with the largest
    summed probability wins; if that ties too, the smallest class index.
    """
    _check(probs)
    n, _, k = probs.shape
    votes = torch.zeros(n, k, dtype=torch.float64, device=probs.device)
    votes.scatter_add_(1, probs.argmax(dim=-1), torch.ones(probs.shape[:2], dtype=torch.float64, device=probs.device))
    top = votes == votes.max(dim=1, keepdim=True).values
    # Votes are whole numbers; summed probabilities lie in [0, N], so scaling them below 1 breaks only ties.
    tie_break = probs.double().sum(dim=1) / (probs.shape[1] + 1)
    score = torch.where(top, votes + tie_break, torch.full_like(votes, -1.0))
    return score.argmax(dim=-1)
