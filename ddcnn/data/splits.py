"""Stratified splits of labelled samples (the sources' test splits, prepare's validation split, image folders'
carved test split)."""

from __future__ import annotations

import numpy as np

__all__ = ["stratified_split"]


def stratified_split(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(keep, held_out)`` with ``fraction`` of every class held out, fixed by ``seed``.

    Every class with at least two samples keeps one in ``keep`` and puts at least one in ``held_out``.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"split fraction must be strictly between 0 and 1, got {fraction}.")
    rng = np.random.default_rng(seed)
    keep, held = [], []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        n_held = int(round(fraction * len(idx)))
        if len(idx) >= 2:
            n_held = min(max(n_held, 1), len(idx) - 1)
        held.append(idx[:n_held])
        keep.append(idx[n_held:])
    return np.sort(np.concatenate(keep)), np.sort(np.concatenate(held))
