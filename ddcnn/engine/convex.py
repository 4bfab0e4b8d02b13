"""Convex fits solved to convergence: multinomial logistic regression by full-batch L-BFGS along an L2 path.

The convex stacker of the CNN-DNN family (:mod:`ddcnn.stages.stacker`) is a linear map from the (scaled) local
outputs to the class logits. Unlike a network trained for a fixed number of steps, its optimum is unique for each L2
strength; :func:`fit_logistic` computes it for every strength of a fixed grid, from the strongest to the weakest (each
solve starts from the previous solution), and keeps the one with the best validation score: accuracy (ties: the
lower cross-entropy) or cross-entropy alone (``select``); ties keep the stronger penalty. The objective is the mean
cross-entropy plus
``l2 / 2 * ||W||^2`` (the bias is not penalised), so a strength means the same whatever the number of rows.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ddcnn.rundir import L2_GRID

log = logging.getLogger(__name__)

__all__ = ["LogisticFit", "fit_logistic"]


@dataclass
class LogisticFit:
    """What :func:`fit_logistic` returns.

    Attributes:
        weight: ``(K, D)`` weights of the selected strength (as ``nn.Linear.weight``).
        bias: ``(K,)`` bias.
        l2: The selected L2 strength.
        val_acc, val_loss: Its validation accuracy and mean cross-entropy.
        path: One entry per strength of the grid: ``l2``, ``val_acc``, ``val_loss``, ``train_loss`` (the penalised
            objective at the solution), ``iterations`` (function evaluations) and ``converged``.
        time_s: Seconds of the whole path.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    l2: float
    val_acc: float
    val_loss: float
    path: list[dict] = field(default_factory=list)
    time_s: float = 0.0


def _solve(
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    l2: float,
    max_iter: int,
    tolerance: float,
) -> tuple[float, int, bool, bool]:
    """Minimise the penalised cross-entropy in place from ``weight, bias``;
    (objective, evaluations, converged, finite). Not ``finite``: the solver left float range and the parameters are
    back where it started."""
    params = [weight, bias]
    opt = torch.optim.LBFGS(
        params,
        lr=1.0,
        max_iter=max_iter,
        history_size=10,
        tolerance_grad=tolerance,
        tolerance_change=tolerance * 1e-3,
        line_search_fn="strong_wolfe",
    )
    evaluations = [0]

    def closure() -> torch.Tensor:
        evaluations[0] += 1
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(torch.addmm(bias, x, weight.t()), y) + 0.5 * l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in params]
    try:
        opt.step(closure)
        finite = all(bool(torch.isfinite(p).all()) for p in params)
    except RuntimeError as err:  # the strong-Wolfe line search can extrapolate past float range (seen: step 1.8e39)
        log.warning("L-BFGS at L2 strength %g left float range (%s); keeping the solution it started from", l2, err)
        finite = False
    if not finite:  # keep the last finite solution (the previous strength's): its objective is finite, not converged
        with torch.no_grad():
            for p, value in zip(params, before, strict=True):
                p.copy_(value)
                p.grad = None
    with torch.no_grad():
        grads = [p.grad.flatten() for p in params if p.grad is not None]
        converged = finite and bool(grads) and float(torch.cat(grads).abs().max()) <= tolerance * 10
        logits = torch.addmm(bias, x, weight.t())
        objective = float(F.cross_entropy(logits, y) + 0.5 * l2 * weight.pow(2).sum())
    return objective, evaluations[0], converged, finite


@torch.no_grad()
def fit_logistic(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    num_classes: int,
    *,
    l2_grid: Sequence[float] = L2_GRID,
    max_iter: int = 200,
    tolerance: float = 1e-5,
    select: str = "val_acc",
) -> LogisticFit:
    """Multinomial logistic regression ``x -> x W^T + b`` for every L2 strength of ``l2_grid``.

    Args:
        x_train, y_train: ``(n, D)`` features (already scaled) and labels of the fit.
        x_val, y_val: Those of the selection.
        num_classes: ``K``.
        l2_grid: The strengths tried (sorted strongest first internally).
        max_iter: L-BFGS function evaluations per strength.
        tolerance: Stop when the largest gradient entry is below it.
        select: ``val_acc`` (validation accuracy, ties by cross-entropy) or ``val_loss`` (validation cross-entropy).

    Returns:
        The selected solution with the whole path (:class:`LogisticFit`).
    """
    if select not in ("val_acc", "val_loss"):
        raise ValueError(f"select must be val_acc or val_loss, got {select!r}.")
    grid = sorted({float(v) for v in l2_grid}, reverse=True)
    if not grid or min(grid) < 0:
        raise ValueError(f"the L2 grid must hold non-negative strengths, got {list(l2_grid)!r}.")
    if x_train.dim() != 2 or len(x_train) != len(y_train) or len(x_train) == 0:
        raise ValueError(f"expected (n, D) features with n labels, got {tuple(x_train.shape)} and {len(y_train)}.")
    start = time.perf_counter()
    for name, x in (("training", x_train), ("validation", x_val)):
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"logistic regression: the {name} features are not finite; are the local outputs finite?")
    x_train, x_val = x_train.float(), x_val.float()
    y_train, y_val = y_train.long(), y_val.long()
    weight = torch.zeros(num_classes, x_train.shape[1], requires_grad=True)
    bias = torch.zeros(num_classes, requires_grad=True)
    # start from the class frequencies: the optimum of the strongest penalty is near it
    counts = torch.bincount(y_train, minlength=num_classes).float() + 1.0
    with torch.no_grad():
        bias.copy_((counts / counts.sum()).log())
    path, best = [], None
    for l2 in grid:
        objective, evaluations, converged, finite = _solve(x_train, y_train, weight, bias, l2, max_iter, tolerance)
        if not math.isfinite(objective):
            raise ValueError(f"logistic regression diverged at L2 strength {l2:g}: are the features finite and scaled?")
        logits = torch.addmm(bias, x_val, weight.t())
        val_acc, val_loss = float((logits.argmax(-1) == y_val).float().mean()), float(F.cross_entropy(logits, y_val))
        path.append(
            {
                "l2": l2,
                "val_acc": val_acc,
                "val_loss": val_loss,
                "train_loss": objective,
                "iterations": evaluations,
                "converged": converged,
            }
        )
        key = (val_acc, -val_loss) if select == "val_acc" else (-val_loss,)
        if best is None or key > best[0]:
            best = (key, l2, weight.detach().clone(), bias.detach().clone(), val_acc, val_loss)
    _, l2, w, b, val_acc, val_loss = best
    return LogisticFit(w, b, l2, val_acc, val_loss, path, time.perf_counter() - start)
