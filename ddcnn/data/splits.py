"""Stratified splits of labelled samples (the sources' test splits, prepare's validation split, image folders'
carved test split), and their patient-level forms: with ``groups`` (one group per sample, e.g. a patient) every group
lands whole on one side of every split."""

from __future__ import annotations

import numpy as np

__all__ = ["GroupSplitError", "check_groups", "group_split", "stratified_split"]


class GroupSplitError(ValueError):
    """A split that the samples' groups make impossible; the message gives the numbers and the fix."""


def stratified_split(
    y: np.ndarray, fraction: float, seed: int, groups: np.ndarray | None = None, what: str = "split"
) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(keep, held_out)`` with ``fraction`` of every class held out, fixed by ``seed``.

    Every class with at least two samples keeps one in ``keep`` and puts at least one in ``held_out``. With
    ``groups`` the split is drawn over whole groups instead (:func:`group_split`); without, it is unchanged.
    """
    if groups is not None:
        return group_split(y, groups, fraction, seed, what)
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


def check_groups(groups: np.ndarray | None, n: int, what: str) -> np.ndarray | None:
    """``groups`` as an integer vector of length ``n`` (or ``None``)."""
    if groups is None:
        return None
    groups = np.asarray(groups)
    if groups.shape != (n,):
        raise ValueError(f"{what}: {groups.shape[0] if groups.ndim else 0} group(s) given for {n} samples; one each.")
    return np.unique(groups, return_inverse=True)[1].astype(np.int64)


def group_split(
    y: np.ndarray, groups: np.ndarray, fraction: float, seed: int, what: str = "split"
) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(keep, held_out)`` holding out whole groups, about ``fraction`` of every class, fixed by ``seed``.

    Groups are visited in a seeded random order and each is held out when that brings the held-out class counts
    closer to ``fraction`` of each class's total (a greedy stratified group split; with one sample per group it draws
    about the same class shares as :func:`stratified_split`). At least one group goes to each side.

    Raises:
        GroupSplitError: Fewer than two groups, so one side would be empty.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"split fraction must be strictly between 0 and 1, got {fraction}.")
    y = np.asarray(y)
    gid = check_groups(groups, len(y), what)
    n_groups = int(gid.max()) + 1 if len(gid) else 0
    if n_groups < 2:
        raise GroupSplitError(
            f"{what}: the {len(y)} samples come from {n_groups} patient group(s), so no split keeps each group on one "
            f"side; a split needs samples of at least 2 groups (add studies of other patients, or set the groups "
            f"apart in the manifest's group column)."
        )
    classes = np.unique(y)
    counts = np.zeros((n_groups, len(classes)), dtype=np.float64)
    np.add.at(counts, (gid, np.searchsorted(classes, y)), 1.0)
    target = fraction * counts.sum(axis=0)
    held_counts = np.zeros(len(classes))
    held_groups = []
    for g in np.random.default_rng(seed).permutation(n_groups):
        after = held_counts + counts[g]
        if np.abs(target - after).sum() < np.abs(target - held_counts).sum():
            held_groups.append(g)
            held_counts = after
    if not held_groups:  # every group larger than the share: hold out the smallest one
        held_groups = [int(np.argmin(counts.sum(axis=1)))]
    elif len(held_groups) == n_groups:
        held_groups = held_groups[:-1]
    held_mask = np.isin(gid, held_groups)
    return np.flatnonzero(~held_mask), np.flatnonzero(held_mask)
