"""The plain training loop every baseline shares, and the single-process reference it is measured against.

The baselines are compared on the same data, network and number of epochs as the global CNN. To make their times
comparable with each other, they all train through this loop (no Lightning: its per-step overhead would dwarf the
small networks of the tests and hide the cost of communication). :func:`train_single` is the ``P = 1`` reference:
the global CNN trained in one process, whose accuracy and per-step time the parallel strategies are checked against.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "TrainSpec",
    "batch_order",
    "epoch_order",
    "set_lr",
    "evaluate",
    "make_optimizer",
    "train_epochs",
    "train_single",
    "timing_summary",
]

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class TrainSpec:
    """How a network is trained: the same for the reference and for every parallel strategy.

    Defaults follow ``conf/optimizer/adamw.yaml`` and ``conf/data/digits.yaml``.

    Attributes:
        epochs: Passes over the training split.
        batch_size: Mini-batch size (per step of the whole model; BPT-CNN workers use it for their local steps).
        optimizer: ``"adamw"`` or ``"sgd"`` (SGD with Nesterov momentum 0.9).
        lr: (Peak) learning rate.
        schedule: ``"constant"``, or ``"cosine"`` decay from ``lr`` to 0 over the whole run (by the fraction of the
            training data seen), which makes the final weights, and so the comparison, less noisy.
        weight_decay: Decoupled (AdamW) or L2 (SGD) weight decay.
        seed: Seed of the initial weights' copies, of the batch order and of dropout.
        eval_batch_size: Batch size for evaluation.
    """

    epochs: int = 5
    batch_size: int = 32
    optimizer: str = "adamw"
    lr: float = 2e-3
    schedule: str = "constant"
    weight_decay: float = 1e-4
    seed: int = 0
    eval_batch_size: int = 512

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.eval_batch_size < 1:
            raise ValueError(f"epochs and batch sizes must be positive, got {self}.")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}.")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}.")

    def lr_at(self, progress: float) -> float:
        """The learning rate after ``progress`` (0 to 1) of the training run."""
        if self.schedule == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
        return self.lr

    def as_dict(self) -> dict:
        return asdict(self)


def make_optimizer(params: Iterable[nn.Parameter], spec: TrainSpec) -> torch.optim.Optimizer:
    """The optimizer of ``spec`` over ``params``.

    Both optimizers update every weight element by element, so an optimizer over a slice of a layer's filters takes
    exactly the step the whole-layer optimizer would take on that slice (what filter parallelism relies on).
    """
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.SGD(params, lr=spec.lr, momentum=0.9, nesterov=True, weight_decay=spec.weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled sample indices of one epoch, the same in every process for the same ``seed`` and ``epoch``."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(int(seed) * 100_003 + int(epoch)))


def batch_order(num_samples: int, batch_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """Mini-batches of :func:`epoch_order`; a last batch of one sample is dropped (batch norm cannot train on it)."""
    batches = list(epoch_order(num_samples, seed, epoch).split(batch_size))
    if len(batches) > 1 and len(batches[-1]) < 2:
        batches.pop()
    return batches


@torch.no_grad()
def evaluate(net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> float:
    """Accuracy of ``net`` (in evaluation mode) on ``(x, y)``; the mode is restored afterwards."""
    was_training = net.training
    net.eval()
    device = next(net.parameters()).device
    correct = 0
    for start in range(0, len(x), batch_size):
        logits = net(x[start : start + batch_size].to(device))
        correct += int((logits.argmax(-1).cpu() == y[start : start + batch_size]).sum())
    net.train(was_training)
    return correct / max(len(x), 1)


def train_epochs(
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    spec: TrainSpec,
    device: torch.device | str = "cpu",
    after_backward: Callable[[], None] | None = None,
    cpu_times: list[float] | None = None,
) -> list[float]:
    """Train ``net`` for ``spec.epochs`` epochs; return the wall time of every step (forward, backward, update).

    Args:
        net: The network (trained in place).
        optimizer: Its optimizer.
        x, y: Training inputs and labels.
        spec: Epochs, batch size and the seed of the batch order.
        device: Where the batches go.
        after_backward: Called between backward and the update (e.g. to synchronise gradients).
        cpu_times: If given, the CPU seconds of this process (all its threads) in every step are appended to it.
            Unlike the wall time, they hardly grow when other processes share the cores.
    """
    net.train()
    step_times: list[float] = []
    epochs = [batch_order(len(x), spec.batch_size, spec.seed, epoch) for epoch in range(spec.epochs)]
    total = sum(len(batches) for batches in epochs)
    for batches in epochs:
        for idx in batches:
            set_lr(optimizer, spec.lr_at(len(step_times) / total))
            start, cpu_start = time.perf_counter(), time.process_time()
            xb, yb = x[idx].to(device), y[idx].to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(xb), yb)
            loss.backward()
            if after_backward is not None:
                after_backward()
            optimizer.step()
            step_times.append(time.perf_counter() - start)
            if cpu_times is not None:
                cpu_times.append(time.process_time() - cpu_start)
    return step_times


def timing_summary(step_times: list[float], skip: int = 5) -> dict[str, float]:
    """Median and mean step time, leaving out the first ``skip`` steps (allocator and thread-pool warm-up)."""
    steady = step_times[skip:] if len(step_times) > 2 * skip else step_times
    if not steady:
        return {"step_time_s": float("nan"), "step_time_mean_s": float("nan")}
    return {"step_time_s": statistics.median(steady), "step_time_mean_s": statistics.fmean(steady)}


def train_single(
    net: nn.Module,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    spec: TrainSpec,
    threads: int | None = None,
) -> dict:
    """Train a copy of ``net`` in this process: the single-process global CNN every baseline is compared with.

    Args:
        net: The initial network (not modified).
        x_train, y_train: Training split.
        x_test, y_test: Test split for the reported accuracy.
        spec: Training settings.
        threads: CPU threads for the run (restored afterwards); ``None`` keeps the current setting.

    Returns:
        ``method``, ``processes`` (1), ``accuracy`` (test), ``wall_time_s`` (training only), ``step_time_s``
        (median), ``step_time_mean_s``, ``cpu_time_per_step_s`` (mean CPU seconds of a step; the means leave the
        warm-up steps out), ``steps`` and the trained ``state_dict``.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(spec.seed)
        model = copy.deepcopy(net)
        optimizer = make_optimizer(model.parameters(), spec)
        start = time.perf_counter()
        cpu_times: list[float] = []
        step_times = train_epochs(model, optimizer, x_train, y_train, spec, cpu_times=cpu_times)
        wall = time.perf_counter() - start
        accuracy = evaluate(model, x_test, y_test, spec.eval_batch_size)
    finally:
        torch.set_num_threads(previous)
    return {
        "method": "global CNN (1 process)",
        "processes": 1,
        "accuracy": accuracy,
        "wall_time_s": wall,
        "steps": len(step_times),
        "threads": torch.get_num_threads() if threads is None else threads,
        **timing_summary(step_times),
        "cpu_time_per_step_s": timing_summary(cpu_times)["step_time_mean_s"],
        "state_dict": model.state_dict(),
    }
