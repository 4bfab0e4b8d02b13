"""Speed-aware placement of the local trainings: calibration, cost model, LPT placement, scaling prediction.

The N local nets need no communication, so the only scheduling question is which device trains which
sub-domain. As in the heterogeneous-device systems this package compares against, each device is measured
first (:func:`calibrate`: images/s of the local net on a few batches), the cost of each sub-domain is
estimated from its size (:func:`local_costs`), and sub-domains are placed longest first onto the device
that would finish them earliest (:func:`lpt`, Graham's LPT rule generalised to uniform machines; its
makespan is within 4/3 of the optimum for identical devices). :func:`scaling_rows` applies the same rule
to measured per-sub-domain times to predict wall time and speedup on any set of devices.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ddcnn.settings.loop import num_batches

__all__ = [
    "EVAL_WEIGHT",
    "Placement",
    "ScalingRow",
    "calibrate",
    "local_costs",
    "lpt",
    "default_device_counts",
    "parse_device_counts",
    "parse_mixed",
    "scaling_rows",
    "train_samples_per_epoch",
]

# A forward pass costs about a third of a forward + backward + optimizer step (the backward pass is about
# twice the forward); evaluation and the final predictions are counted at this weight.
EVAL_WEIGHT = 1.0 / 3.0


def train_samples_per_epoch(n_train: int, batch_size: int, limit_train_batches: int | float | None) -> int:
    """Samples one training epoch visits under ``trainer.limit_train_batches`` (count or fraction), its batches
    counted as the loop counts them (:func:`ddcnn.settings.loop.num_batches`)."""
    batches = num_batches(math.ceil(n_train / batch_size), limit_train_batches, "trainer.limit_train_batches")
    return min(n_train, batches * batch_size)


def local_costs(
    pixels: Mapping[int, int],
    n_train: int,
    n_eval: int,
    epochs: int,
    n_predict: int | None = None,
) -> dict[int, float]:
    """Estimated cost of each sub-domain, in trained pixel-samples (what one images/s figure converts to seconds).

    cost_i = pixels_i x (epochs x (n_train + EVAL_WEIGHT x n_eval) + EVAL_WEIGHT x n_predict): proportional to
    the sub-domain's number of pixels (voxels), the training samples and the epochs. Equal for the equal-shape
    decompositions of :mod:`ddcnn.decomposition`, but the placement does not rely on that.

    Args:
        pixels: Pixels (or voxels) of each sub-domain, channels included or not (only ratios matter).
        n_train: Training samples per epoch.
        n_eval: Validation samples per epoch.
        epochs: Training epochs.
        n_predict: Samples predicted once at the end (train + val + test); default none.
    """
    per_pixel = epochs * (n_train + EVAL_WEIGHT * n_eval) + EVAL_WEIGHT * (n_predict or 0)
    return {int(i): float(p) * per_pixel for i, p in pixels.items()}


@dataclass
class Placement:
    """Which sub-domains each device trains, in order, and when each device is predicted to finish."""

    assignment: list[list[int]]
    predicted_s: list[float]
    speeds: list[float] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(self.predicted_s, default=0.0)


def lpt(
    costs: Mapping[int, float],
    speeds: Sequence[float],
    overhead_s: float = 0.0,
    ready_s: Sequence[float] | None = None,
) -> Placement:
    """Longest processing time first onto the device that would finish it earliest.

    Args:
        costs: Cost of each task (any unit: pixel-samples, or seconds measured on a reference device).
        speeds: Speed of each device in cost units per second (1.0 each when costs are reference seconds).
        overhead_s: Fixed seconds per task on any device (Trainer set-up, checkpoints).
        ready_s: When each device becomes free (e.g. after its start-up); default all at 0.

    Returns:
        The placement; ties go to the lower device index and tasks of equal cost keep index order, so the
        result is deterministic.
    """
    if not speeds:
        raise ValueError("lpt needs at least one device.")
    if any(s <= 0 or not math.isfinite(s) for s in speeds):
        raise ValueError(f"device speeds must be positive and finite, got {list(speeds)}.")
    finish = [float(r) for r in ready_s] if ready_s is not None else [0.0] * len(speeds)
    if len(finish) != len(speeds):
        raise ValueError(f"ready_s has {len(finish)} entries for {len(speeds)} devices.")
    assignment: list[list[int]] = [[] for _ in speeds]
    for task in sorted(costs, key=lambda i: (-costs[i], i)):
        ends = [finish[d] + costs[task] / speeds[d] + overhead_s for d in range(len(speeds))]
        best = min(range(len(speeds)), key=lambda d: (ends[d], d))
        finish[best] = ends[best]
        assignment[best].append(task)
    return Placement(assignment, finish, [float(s) for s in speeds])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate(
    net: nn.Module,
    input_shape: Sequence[int],
    num_classes: int,
    batch_size: int,
    device: str | torch.device = "cpu",
    steps: int = 5,
    warmup: int = 2,
    min_time_s: float = 0.25,
) -> float:
    """Training images/s of ``net`` on ``device``: a few timed optimizer steps on random inputs.

    The network is a throw-away copy (its weights change); inputs have ``input_shape`` = ``(C, *sub_shape)``.
    At least ``steps`` steps and at least ``min_time_s`` seconds are timed, so that a tiny net is not
    measured on a few milliseconds of noise.
    """
    device = torch.device(device)
    net = net.to(device).train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, *input_shape, generator=gen).to(device)
    y = torch.randint(0, num_classes, (batch_size,), generator=gen).to(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    done = 0
    while done < steps or time.perf_counter() - start < min_time_s:
        step()
        done += 1
        if done % steps == 0:
            _sync(device)
    _sync(device)
    return done * batch_size / max(time.perf_counter() - start, 1e-9)


# --- scaling prediction ---------------------------------------------------------------------------
def default_device_counts(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n`` itself (one device per sub-domain)."""
    counts, p = [], 1
    while p < n:
        counts.append(p)
        p *= 2
    return [*counts, max(n, 1)]


def parse_device_counts(text: str) -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]``."""
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--devices takes comma-separated device counts such as 1,2,4,8, got {text!r}.") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--devices takes positive device counts such as 1,2,4,8, got {text!r}.")
    return counts


def parse_mixed(text: str) -> list[float]:
    """``"2x1.0,6x0.25"`` -> two devices of relative speed 1.0 and six of 0.25."""
    speeds: list[float] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        count, sep, speed = part.partition("x")
        try:
            n, s = int(count), float(speed)
        except ValueError:
            n, s = 0, 0.0
        if not sep or n < 1 or not s > 0 or not math.isfinite(s):
            raise ValueError(
                f"--mixed takes COUNTxSPEED groups such as 2x1.0,6x0.25 (speeds relative to the device the run "
                f"was measured on), got {part!r}."
            )
        speeds += [s] * n
    if not speeds:
        raise ValueError("--mixed needs at least one COUNTxSPEED group, e.g. 2x1.0,6x0.25.")
    return speeds


@dataclass
class ScalingRow:
    """Predicted wall time of the CNN-DNN on one set of devices."""

    label: str
    speeds: list[float]
    local_s: float
    total_s: float
    speedup: float | None
    efficiency: float

    @property
    def devices(self) -> int:
        return len(self.speeds)


def scaling_rows(
    local_s: Mapping[int, float],
    coarse_s: float | None,
    global_s: float | None,
    device_counts: Sequence[int],
    mixed: Sequence[float] | None = None,
    startup_s: float = 0.0,
) -> list[ScalingRow]:
    """Predicted wall time and speedup for P equal devices (each P of ``device_counts``) and a mixed set.

    Args:
        local_s: Measured training time of each local net on the reference device (speed 1.0).
        coarse_s: Time of the coarse stage (runs after the last local net, on one device); ``None`` counts 0.
        global_s: Time of the global net on one reference device, the baseline of the speedup.
        device_counts: The P to predict for.
        mixed: Relative speeds of a mixed device set, e.g. ``parse_mixed("2x1.0,6x0.25")``.
        startup_s: Fixed start-up added to every prediction (process start, data loading).

    The local wall time is the LPT makespan of the measured times; efficiency is the total local work
    divided by (summed device speed x local wall time).
    """
    work = float(sum(local_s.values()))
    sets = [(f"{p} x 1.0", [1.0] * p) for p in device_counts]
    if mixed:
        groups: dict[float, int] = {}
        for s in mixed:
            groups[s] = groups.get(s, 0) + 1
        sets.append((" + ".join(f"{n} x {s:g}" for s, n in groups.items()), list(mixed)))
    rows = []
    for label, speeds in sets:
        wall = lpt(local_s, speeds).makespan
        total = startup_s + wall + (coarse_s or 0.0)
        speedup = global_s / total if global_s and total > 0 else None
        efficiency = work / (sum(speeds) * wall) if wall > 0 else 1.0
        rows.append(ScalingRow(label, speeds, wall, total, speedup, efficiency))
    return rows
