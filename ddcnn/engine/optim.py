"""The optimizers and learning-rate schedules of the loop, from Hydra ``_partial_`` nodes or Python callables, and
the CPU threads and deterministic algorithms a training runs under."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import hydra
import torch
from torch import nn

from ddcnn.engine.gpu import amp_optimizer
from ddcnn.settings.loop import LoopSettings, plain_spec

__all__ = [
    "training_optimizer",
    "build_optimizer",
    "scheduler_factory",
    "build_scheduler",
    "torch_threads",
    "deterministic",
    "needs_closure",
    "PLATEAU_MIN_LR",
    "PLATEAU_COOLDOWN",
]


def build_optimizer(node: Any, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of a Hydra ``_partial_`` node (``{_target_: torch.optim.AdamW, _partial_: true, lr: ...}``).

    A callable ``params -> Optimizer`` is accepted as well.
    """
    factory = hydra.utils.instantiate(plain_spec(node)) if isinstance(node, Mapping) else node
    if not callable(factory):
        raise ValueError(
            f"the optimizer setting must be a Hydra node with _partial_: true (e.g. coarse.optimizer) or a callable, "
            f"got {node!r}."
        )
    return factory(params)


# The plateau scheduler's defaults where its node does not set them (issue #45: ReduceLROnPlateau(patience=0) took
# 2e-3 to 2e-9 in 9 epochs on 106 validation images, one noisy epoch at a time): the rate never falls below
# PLATEAU_MIN_LR of each parameter group's start (a step a hundredth of the first is where the convergence test calls
# a rate collapsed), and after a drop the next PLATEAU_COOLDOWN epoch(s) count no bad epochs, so one noisy epoch at the
# lowered rate cannot drop it again at once. torch's own patience (10) stays the default patience; set values are kept.
PLATEAU_MIN_LR = 0.01
PLATEAU_COOLDOWN = 1


def _plateau_with_floor(factory: Callable[..., Any], fraction: float, optimizer: torch.optim.Optimizer) -> Any:
    """``factory(optimizer, min_lr=[fraction x each group's rate])``: the floor relative to the rates it starts at."""
    return factory(optimizer, min_lr=[fraction * float(group["lr"]) for group in optimizer.param_groups])


def scheduler_factory(
    node: Any, max_epochs: int, plateau: Mapping[str, Any] | None = None
) -> Callable[[torch.optim.Optimizer], Any] | None:
    """The learning-rate schedule of a Hydra ``_partial_`` node as ``optimizer -> LRScheduler``, or ``None``.

    ``None`` or an empty node means a constant rate. ``T_max: null`` (cosine annealing) becomes ``max_epochs``: every
    training (local nets, coarse DNN, optional stages) anneals over its own epochs. ``plateau``: the arguments a
    ``ReduceLROnPlateau`` node gets (the loop's improvement rule: ``mode``, ``threshold_mode``, ``threshold``); where
    the node does not set them, it also gets ``cooldown`` = :data:`PLATEAU_COOLDOWN` and ``min_lr`` =
    :data:`PLATEAU_MIN_LR` of each parameter group's starting rate.
    """
    if not node:
        return None
    spec = plain_spec(node)
    if isinstance(spec, Mapping):
        spec = dict(spec)
        if "T_max" in spec and spec["T_max"] is None:
            spec["T_max"] = max_epochs
        floor = False
        if plateau and str(spec.get("_target_", "")).rsplit(".", 1)[-1] == "ReduceLROnPlateau":
            spec.update(plateau)
            spec.setdefault("cooldown", PLATEAU_COOLDOWN)
            floor = spec.get("min_lr") is None
            if floor:
                spec.pop("min_lr", None)
        spec = hydra.utils.instantiate(spec)
        if floor:
            spec = functools.partial(_plateau_with_floor, spec, PLATEAU_MIN_LR)
    return spec


def build_scheduler(
    node: Any, optimizer: torch.optim.Optimizer, max_epochs: int, plateau: Mapping[str, Any] | None = None
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The schedule of ``node`` (:func:`scheduler_factory`) on ``optimizer``, stepped once per epoch."""
    factory = scheduler_factory(node, max_epochs, plateau)
    return None if factory is None else factory(optimizer)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op CPU threads, then restore the previous number (``None``: unchanged).

    A small MLP gains nothing from a second thread, and on a CPU that other processes share, threads that wait for
    each other at every one of its many small operations made the coarse DNN several times slower (measured: one
    epoch of 10000 rows at batch 1024 took 0.16 s with one thread, 1.0 s with two, on two busy cores).
    """
    previous = torch.get_num_threads()
    if threads is not None:
        if int(threads) < 1:
            raise ValueError(f"the number of CPU threads must be >= 1 (or null to keep {previous}), got {threads!r}.")
        torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    """``trainer.deterministic``: torch's deterministic algorithms within the block."""
    if not enabled:
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def needs_closure(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step`` must be given a closure that re-evaluates the loss (L-BFGS)."""
    return isinstance(opt, torch.optim.LBFGS) or bool(getattr(opt, "needs_closure", False))


def training_optimizer(
    settings: LoopSettings, params: Iterable[nn.Parameter], device: torch.device, lr_scale: float = 1.0
) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer of a training (the device's variant for its precision: :func:`~ddcnn.engine.gpu.amp_optimizer`),
    its learning rates times ``lr_scale``, and its schedule, which a ``ReduceLROnPlateau`` builds with the loop's
    improvement rule.

    Raises:
        ValueError: For a plateau scheduler that counts an improvement otherwise, or whose patience leaves early
            stopping no two epochs at the lowered rate; for a closure optimizer (L-BFGS) with gradient accumulation
            or a float16 loss scaler.
    """
    s = settings
    spec = amp_optimizer(s.optimizer, device, s.precision, s.gradient_clip_val)
    opt = build_optimizer(spec, params)
    if lr_scale != 1.0:
        for group in opt.param_groups:
            group["lr"] = float(group["lr"]) * lr_scale
            if "initial_lr" in group:
                group["initial_lr"] = float(group["initial_lr"]) * lr_scale
    rule = {"mode": s.monitor_mode, "threshold_mode": "abs", "threshold": s.min_delta}
    sched = build_scheduler(s.scheduler, opt, s.max_epochs, plateau=rule)
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):  # also one a Python factory built
        built = {key: getattr(sched, key) for key in rule}
        if built != rule:
            raise ValueError(
                f"the ReduceLROnPlateau scheduler counts an improvement by {built}, the loop's rule (selection, "
                f"early stopping) by {rule}: build it with those arguments (or pass it as a Hydra node, which "
                f"gets them)."
            )
        if s.patience is not None and s.patience < sched.patience + 2:
            raise ValueError(
                f"patience={s.patience} with a ReduceLROnPlateau of patience {sched.patience}: early "
                f"stopping needs patience >= {sched.patience + 2}."
            )
    if needs_closure(opt) and s.accumulate_grad_batches > 1:
        raise ValueError(
            f"{type(opt).__name__} steps with a closure over one batch; it cannot accumulate gradients over "
            f"{s.accumulate_grad_batches} batches: set trainer.accumulate_grad_batches=1 (or null)."
        )
    if needs_closure(opt) and s.precision == "16-mixed":
        raise ValueError(
            f"{type(opt).__name__} cannot step through a float16 loss scaler: use trainer.precision=32-true or "
            f"bf16-mixed for it."
        )
    return opt, sched
