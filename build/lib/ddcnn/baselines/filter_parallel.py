"""Filter-parallel training of the global CNN over devices of unequal speed.

After Marques, Falcao & Alexandre, "Distributed Learning of CNNs on Heterogeneous CPU/GPU Architectures", 2017,
https://arxiv.org/abs/1712.02546: only the convolutions are distributed (they take most of the training time); each
of ``P`` processes computes a share of every convolution's output channels (filters), the shares proportional to the
devices' measured speeds, and the outputs are gathered along the channel axis, after which every process goes on
with the whole feature map as one model would.

How the backward pass stays exact. Every process holds the whole network except the filters of other ranks, and
computes everything that is not a convolution (norms, activations, pooling, the head, the loss) redundantly on the
same batch. So the gradient reaching a gathered convolution output is the same full tensor ``G`` on every rank, and
two collectives around each convolution give the exact single-process gradients:

* the channel gather (:class:`GatherChannels`): forward, an all-gather of the unequal channel slices (padded to the
  largest share, since gloo gathers equal sizes only); backward, this rank's slice of ``G``, *not* reduced: ``G`` is
  already complete and equal on every rank, and summing the slices over ranks would multiply it by ``P``. The
  slice is exactly the gradient of this rank's filters' outputs, so the local weight and bias gradients are exact;
* the input copy (:class:`ReduceInputGrad`): forward, the identity; backward, an all-reduce (sum) of the gradient
  with respect to the convolution's *input*. Each rank's filters see the whole input, so each rank's backward only
  yields its own filters' part ``W_r^T G_r`` of that gradient; the sum over ranks is the full ``W^T G``.

(The same pair as Megatron-LM's column-parallel layer, Shoeybi et al., https://arxiv.org/abs/1909.08053, with an
all-gather of unequal channel slices instead of equal column blocks.) Everything upstream, norm and head parameters
included, then receives the same exact gradient on every rank. Those replicated parameters are still averaged over
ranks after each backward pass (a small all-reduce) so that threads summing in another order on another rank cannot
make the copies drift apart, and :func:`replicated_divergence` checks that they did not.

The shares come from a calibration run (:func:`calibrate_shares`: every rank times the whole model on its device at
the same time, speed being the inverse step time) unless they are given. Every rank seeds its random generator the
same, so that dropout masks, computed redundantly like the rest, agree.

Limits: only ``groups=1`` convolutions are split (depthwise ones would need their input split too); gradient
clipping by the global norm is not supported (it would need the norm over all ranks' slices); the optimizer must be
element-wise (SGD, AdamW: what :func:`ddcnn.baselines.loop.make_optimizer` builds), so that a slice's update equals
the slice of the whole layer's update.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddcnn.baselines.launch import RankInfo, backend_for, device_for, launch, process_group, threads_per_rank
from ddcnn.baselines.loop import TrainSpec, evaluate, make_optimizer, timing_summary, train_epochs

__all__ = [
    "FilterParallelConv",
    "GatherChannels",
    "ReduceInputGrad",
    "calibrate_shares",
    "measure_step_time",
    "normalize_shares",
    "replicated_divergence",
    "replicated_parameters",
    "split_channels",
    "sync_replicated_grads",
    "to_filter_parallel",
    "to_single_model",
    "train_filter_parallel",
]

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

# Seconds this process spent inside the layers' collectives (waiting for the slowest rank included); the training
# entry reads it to split a step into computation and communication.
_COMM_SECONDS = [0.0]


# --- shares -------------------------------------------------------------------------------------
def normalize_shares(shares: Sequence[float]) -> list[float]:
    """Shares scaled to sum to 1.

    Raises:
        ValueError: If a share is negative or not finite, or all are zero.
    """
    values = [float(s) for s in shares]
    if not values or any(not math.isfinite(s) or s < 0 for s in values) or sum(values) <= 0:
        raise ValueError(f"shares must be finite, non-negative and not all zero, got {list(shares)!r}.")
    total = sum(values)
    return [s / total for s in values]


def split_channels(num_channels: int, shares: Sequence[float]) -> list[int]:
    """Split ``num_channels`` filters into one count per rank, proportional to ``shares``.

    Largest-remainder rounding (ties to the lower rank), then every rank gets at least one filter, taken from the
    rank with the most; so the counts always sum to ``num_channels`` and differ from the exact proportions by less
    than one filter unless that minimum forces more.

    Args:
        num_channels: Output channels of the layer.
        shares: One non-negative share per rank (any scale).

    Returns:
        Filter counts per rank.

    Raises:
        ValueError: If there are fewer channels than ranks, or the shares are invalid.
    """
    fractions = normalize_shares(shares)
    if num_channels < len(fractions):
        raise ValueError(f"cannot split {num_channels} filters over {len(fractions)} ranks: every rank needs one.")
    exact = [f * num_channels for f in fractions]
    counts = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: num_channels - sum(counts)]:
        counts[i] += 1
    for i in range(len(counts)):
        if counts[i] == 0:
            donor = max(range(len(counts)), key=lambda j: (counts[j], -j))
            counts[donor] -= 1
            counts[i] = 1
    return counts


# --- autograd-aware collectives -------------------------------------------------------------------
class GatherChannels(torch.autograd.Function):
    """All-gather unequal channel slices along axis 1; the backward pass returns this rank's slice of the gradient.

    The gradient is sliced, not reduced: the layers after the gather run identically on every rank, so the incoming
    gradient is already the full gradient on each of them (see the module docstring).
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: tuple[int, ...], rank: int, group) -> torch.Tensor:
        ctx.start = sum(counts[:rank])
        ctx.stop = ctx.start + counts[rank]
        widest = max(counts)
        if local.shape[1] != counts[rank]:
            raise ValueError(f"rank {rank} holds {local.shape[1]} channels, its share is {counts[rank]}.")
        if local.shape[1] < widest:
            # gloo's all_gather needs equal sizes: pad to the widest slice and cut the padding off again.
            pad = local.new_zeros((local.shape[0], widest - local.shape[1], *local.shape[2:]))
            local = torch.cat([local, pad], dim=1)
        parts = [torch.empty_like(local) for _ in counts]
        began = time.perf_counter()
        dist.all_gather(parts, local.contiguous(), group=group)
        _COMM_SECONDS[0] += time.perf_counter() - began
        return torch.cat([part[:, :count] for part, count in zip(parts, counts, strict=True)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[:, ctx.start : ctx.stop].contiguous(), None, None, None


class ReduceInputGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ranks (each rank's filters contribute only their part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        began = time.perf_counter()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        _COMM_SECONDS[0] += time.perf_counter() - began
        return grad, None


# --- the layer -------------------------------------------------------------------------------------
class FilterParallelConv(nn.Module):
    """This rank's slice of the filters of ``conv``; its output is the whole layer's output, gathered from all ranks.

    Every rank must wrap the same layer with the same ``shares`` and call it in the same order (it runs two
    collectives). The slice is a copy: ``conv`` is left as it was.

    Args:
        conv: A ``Conv1d``, ``Conv2d`` or ``Conv3d`` with ``groups=1``.
        rank: Rank of this process in ``group``.
        shares: One share per rank of ``group`` (any scale), e.g. ``(0.7, 0.3)``.
        group: Process group of the ranks sharing the layer; ``None`` is the default group.

    Attributes:
        counts: Filters per rank.
        start, stop: This rank's filters, ``conv.weight[start:stop]``.
        local: The convolution of this rank's filters.
    """

    def __init__(self, conv: nn.Module, rank: int, shares: Sequence[float], group=None) -> None:
        super().__init__()
        if not isinstance(conv, _CONV_TYPES):
            raise TypeError(f"FilterParallelConv wraps Conv1d/2d/3d, got {type(conv).__name__}.")
        if conv.groups != 1:
            raise ValueError(f"only groups=1 convolutions can be split by filters, got groups={conv.groups}.")
        if not 0 <= rank < len(shares):
            raise ValueError(f"rank {rank} is outside the {len(shares)} ranks of shares {list(shares)}.")
        self.counts = tuple(split_channels(conv.out_channels, shares))
        self.rank = rank
        self.group = group
        self.start = sum(self.counts[:rank])
        self.stop = self.start + self.counts[rank]
        self.out_channels = conv.out_channels
        self.local = type(conv)(
            conv.in_channels,
            self.counts[rank],
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=1,
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
            device=conv.weight.device,
            dtype=conv.weight.dtype,
        )
        with torch.no_grad():
            self.local.weight.copy_(conv.weight[self.start : self.stop])
            if conv.bias is not None:
                self.local.bias.copy_(conv.bias[self.start : self.stop])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer's output ``(B, out_channels, *spatial)``: this rank's filters plus everybody else's."""
        x = ReduceInputGrad.apply(x, self.group)
        return GatherChannels.apply(self.local(x), self.counts, self.rank, self.group)

    @torch.no_grad()
    def full_conv(self) -> nn.Module:
        """A plain convolution with every rank's filters (a collective: every rank must call it)."""
        local = self.local
        conv = type(local)(
            local.in_channels,
            self.out_channels,
            local.kernel_size,
            stride=local.stride,
            padding=local.padding,
            dilation=local.dilation,
            bias=local.bias is not None,
            padding_mode=local.padding_mode,
            device=local.weight.device,
            dtype=local.weight.dtype,
        )
        conv.weight.copy_(_gather_rows(local.weight.detach(), self.counts, self.rank, self.group))
        if local.bias is not None:
            conv.bias.copy_(_gather_rows(local.bias.detach(), self.counts, self.rank, self.group))
        return conv

    def extra_repr(self) -> str:
        return f"filters {self.start}:{self.stop} of {self.out_channels}, counts={list(self.counts)}"


def _gather_rows(local: torch.Tensor, counts: Sequence[int], rank: int, group) -> torch.Tensor:
    """All-gather the first-axis slices of a tensor split by ``counts``."""
    widest = max(counts)
    padded = local.new_zeros((widest, *local.shape[1:]))
    padded[: counts[rank]] = local
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])


def _replace_convs(module: nn.Module, make) -> None:
    for name, child in module.named_children():
        replacement = make(child)
        if replacement is not None:
            setattr(module, name, replacement)
        else:
            _replace_convs(child, make)


def to_filter_parallel(model: nn.Module, rank: int, shares: Sequence[float], group=None) -> nn.Module:
    """A copy of ``model`` (a ``VGG``, ``ResNet`` or any network) with every convolution split by filters.

    Every ``Conv1d``/``Conv2d``/``Conv3d`` becomes a :class:`FilterParallelConv` holding this rank's share; all other
    layers are copied whole (replicated). Every rank must convert an identical model (same weights) with the same
    ``shares``.

    Args:
        model: The single-process network (not modified).
        rank: Rank of this process in ``group``.
        shares: One share per rank, e.g. from :func:`calibrate_shares`.
        group: Process group; ``None`` is the default group.
    """
    parallel = copy.deepcopy(model)
    _replace_convs(
        parallel, lambda m: FilterParallelConv(m, rank, shares, group) if isinstance(m, _CONV_TYPES) else None
    )
    return parallel


def to_single_model(model: nn.Module) -> nn.Module:
    """A plain copy of a filter-parallel ``model`` with every layer whole again (a collective)."""
    # Process groups cannot be copied; the copy shares them.
    groups = {id(m.group): m.group for m in model.modules() if isinstance(m, FilterParallelConv)}
    single = copy.deepcopy(model, memo=groups)
    _replace_convs(single, lambda m: m.full_conv() if isinstance(m, FilterParallelConv) else None)
    return single


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters every rank holds whole: all but the filter slices of :class:`FilterParallelConv` layers."""
    sliced = {id(p) for m in model.modules() if isinstance(m, FilterParallelConv) for p in m.parameters()}
    return [p for p in model.parameters() if id(p) not in sliced]


def _replicated_tensors(model: nn.Module) -> list[torch.Tensor]:
    prefixes = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, FilterParallelConv))
    return [t for key, t in model.state_dict().items() if not key.startswith(prefixes) and t.is_floating_point()]


def sync_replicated_grads(model: nn.Module, group=None) -> None:
    """Average the gradients of the replicated parameters over ranks, in one all-reduce.

    They are equal already up to the summation order of threads; the average keeps the copies bit-identical.
    """
    params = [p for p in replicated_parameters(model) if p.grad is not None]
    if not params:
        return
    world = dist.get_world_size(group)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= world
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


@torch.no_grad()
def replicated_divergence(model: nn.Module, group=None) -> float:
    """Largest difference between ranks over the replicated parameters and float buffers (0.0 when in sync)."""
    tensors = _replicated_tensors(model)
    if not tensors:
        return 0.0
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    return float((high - low).max())


# --- calibration ---------------------------------------------------------------------------------
def measure_step_time(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 5, warmup: int = 2) -> float:
    """Median seconds of one forward and backward pass of a copy of ``model`` on ``(x, y)`` (no update)."""
    probe = copy.deepcopy(model).train()
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        probe.zero_grad(set_to_none=True)
        F.cross_entropy(probe(x), y).backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate_shares(model: nn.Module, x: torch.Tensor, y: torch.Tensor, group=None, steps: int = 5) -> list[float]:
    """Filter shares proportional to each rank's measured speed (a collective: every rank times its device).

    Each rank times the whole single-process ``model`` on its device, all at once (so each measures its speed under
    the load the training will put on the machine); speed is the inverse step time.

    Returns:
        Shares summing to 1, one per rank, the same on every rank.
    """
    seconds = torch.tensor([measure_step_time(model, x, y, steps)], dtype=torch.float64)
    if x.device.type == "cuda":
        seconds = seconds.to(x.device)
    times = [torch.zeros_like(seconds) for _ in range(dist.get_world_size(group))]
    dist.all_gather(times, seconds, group=group)
    return normalize_shares([1.0 / float(t) for t in times])


# --- training ------------------------------------------------------------------------------------
def _rank_main(
    info: RankInfo,
    net: nn.Module,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    spec: TrainSpec,
    shares: Sequence[float] | None,
    device: str,
    threads: int,
    calibration_steps: int,
) -> None:
    torch.set_num_threads(threads)
    dev = device_for(device, info.rank)
    with process_group(info, backend_for(device)):
        torch.manual_seed(spec.seed)  # dropout masks must be equal on every rank
        net = net.to(dev)
        calibration_s = 0.0
        if shares is None:
            start = time.perf_counter()
            probe = x_train[: spec.batch_size].to(dev), y_train[: spec.batch_size].to(dev)
            shares = calibrate_shares(net, *probe, steps=calibration_steps)
            calibration_s = time.perf_counter() - start
        shares = normalize_shares(shares)
        model = to_filter_parallel(net, info.rank, shares)
        optimizer = make_optimizer(model.parameters(), spec)
        dist.barrier()
        comm_before = _COMM_SECONDS[0]
        start = time.perf_counter()
        step_times = train_epochs(
            model, optimizer, x_train, y_train, spec, dev, after_backward=lambda: sync_replicated_grads(model)
        )
        wall = time.perf_counter() - start
        comm = torch.tensor([_COMM_SECONDS[0] - comm_before], dtype=torch.float64, device=dev)
        dist.all_reduce(comm, op=dist.ReduceOp.MAX)
        divergence = replicated_divergence(model)
        single = to_single_model(model).cpu()
        if info.rank == 0:
            info.save_result(
                {
                    "method": f"filter-parallel ({info.world_size} processes)",
                    "processes": info.world_size,
                    "accuracy": evaluate(single, x_test, y_test, spec.eval_batch_size),
                    "wall_time_s": wall,
                    "steps": len(step_times),
                    "threads": threads,
                    "shares": list(shares),
                    "filters_per_rank": {
                        name: list(m.counts) for name, m in model.named_modules() if isinstance(m, FilterParallelConv)
                    },
                    "calibration_s": calibration_s,
                    "replicated_divergence": divergence,
                    "comm_time_per_step_s": float(comm) / max(len(step_times), 1),
                    **timing_summary(step_times),
                    "state_dict": single.state_dict(),
                }
            )


def train_filter_parallel(
    net: nn.Module,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    spec: TrainSpec,
    world_size: int = 2,
    shares: Sequence[float] | None = None,
    device: str = "cpu",
    threads: int | None = None,
    calibration_steps: int = 5,
    timeout_s: float = 600.0,
) -> dict:
    """Train ``net`` filter-parallel in ``world_size`` processes (gloo on CPU, nccl on CUDA).

    All ranks see the same batches in the same order as :func:`ddcnn.baselines.loop.train_single` with the same
    ``spec``, so the two train the same model up to floating-point summation order.

    Args:
        net: The initial single-process network (``VGG``, ``ResNet``, ...); not modified.
        x_train, y_train: Training split.
        x_test, y_test: Test split for the reported accuracy.
        spec: Training settings.
        world_size: Number of processes ``P``.
        shares: Filter share per rank; ``None`` measures them with a calibration run (:func:`calibrate_shares`).
        device: ``"cpu"``, or ``"cuda"`` for one GPU per rank (nccl; needs ``world_size`` GPUs).
        threads: CPU threads per rank; ``None`` divides the cores evenly.
        calibration_steps: Timed steps of the calibration run.
        timeout_s: Deadline of the whole run and of every collective.

    Returns:
        ``method``, ``processes``, ``accuracy`` (test), ``wall_time_s`` (training, after calibration),
        ``step_time_s`` (median) and ``step_time_mean_s``, ``steps``, ``shares``, ``filters_per_rank``,
        ``calibration_s``, ``replicated_divergence`` (0.0: the replicated layers stayed in sync),
        ``comm_time_per_step_s`` (time inside the layers' all-gathers and all-reduces, the larger over ranks; the
        replicated-gradient all-reduce is not counted) and the gathered ``state_dict`` of the trained
        single-process network.
    """
    if shares is not None and len(shares) != world_size:
        raise ValueError(f"got {len(shares)} shares for {world_size} processes.")
    threads = threads or threads_per_rank(world_size)
    args = (net, x_train, y_train, x_test, y_test, spec, shares, device, threads, calibration_steps)
    return launch(_rank_main, world_size, args, timeout_s)[0]
