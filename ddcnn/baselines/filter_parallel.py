"""Filter-parallel training of the global CNN over devices of unequal speed.

After Marques, Falcao & Alexandre, "Distributed Learning of CNNs on Heterogeneous CPU/GPU Architectures", 2017,
https://arxiv.org/abs/1712.02546: only the convolutions are distributed (they take most of the training time); each
of ``P`` processes computes a share of every convolution's output channels (filters), the shares proportional to the
devices' measured speeds, and the outputs are gathered along the channel axis, after which every process goes on
with the whole feature map as one model would.

How the backward pass stays exact. Every process holds the whole network except the filters of other ranks, and
computes everything that is not split (the head, the loss, layers that mix channels) redundantly on the same batch.
So the gradient reaching a gathered output is the same full tensor ``G`` on every rank, and two collectives around
each convolution give the exact single-process gradients:

* the channel gather (:class:`GatherChannels`): forward, every rank's slice sent to all the others (one broadcast
  per rank, so unequal slices need no padding); backward, this rank's slice of ``G``, *not* reduced: ``G`` is
  already complete and equal on every rank, and summing the slices over ranks would multiply it by ``P``. The
  slice is exactly the gradient of this rank's filters' outputs, so the local weight and bias gradients are exact;
* the input copy (:class:`ReduceInputGrad`): forward, the identity; backward, an all-reduce (sum) of the gradient
  with respect to the convolution's *input*. Each rank's filters see the whole input, so each rank's backward only
  yields its own filters' part ``W_r^T G_r`` of that gradient; the sum over ranks is the full ``W^T G``.

(The same pair as Megatron-LM's column-parallel layer, Shoeybi et al., https://arxiv.org/abs/1909.08053, with a
gather of unequal channel slices instead of equal column blocks.) Everything upstream, norm and head parameters
included, then receives the same exact gradient on every rank.

Two refinements cut the traffic without changing a single gradient (:func:`to_filter_parallel` applies them inside
every ``nn.Sequential``, which is where VGG-style networks keep their features):

* channel-wise layers right after a convolution (activations, pooling, batch and instance norms, whose statistics
  are per channel) are *absorbed*: each rank applies them to its own slice before the gather (norms hold the
  slice of their affine parameters and running statistics). The gather then moves the pooled map, a quarter of
  the convolution's output after a 2x2 pool, and no rank repeats the others' activations and pooling;
* two split convolutions in a row are *chained*: the second one's input gradient is not all-reduced but sent
  straight to the ranks that need each slice, a reduce-scatter (the first one's gather needs only this rank's
  slice of it): half the bytes of an all-reduce, the same sums.

The replicated parameters are still averaged over ranks after each backward pass (a small all-reduce) so that
threads summing in another order on another rank cannot make the copies drift apart, and
:func:`replicated_divergence` checks that they did not.

The shares come from a calibration run (:func:`calibrate_shares`: every rank times the whole model on its device at
the same time, speed being the inverse step time) unless they are given. Every rank seeds its random generator the
same, so that dropout masks, computed redundantly like the rest, agree (dropout is never absorbed: its mask on a
slice would differ from one model's).

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
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddcnn.baselines.launch import RankInfo, backend_for, device_for, launch, process_group, threads_per_rank
from ddcnn.baselines.loop import TrainSpec, evaluate, make_optimizer, timing_summary, train_epochs
from ddcnn.models.layers import conv_like

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
# Layers whose output channel c depends on input channel c alone, with nothing to split: absorbed as they are.
_CHANNELWISE = (
    nn.Identity,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardswish,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
)
_MAX_POOLS = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
)
# Per-channel norms: absorbed with the slice of their affine parameters and running statistics. Exact classes only
# (SyncBatchNorm, a subclass, would reduce its statistics over the ranks).
_PER_CHANNEL_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)

# Seconds this process spent inside the collectives of a training step (waiting for the slowest rank included); the
# training entry reads it to split a step into computation and communication.
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


# --- collectives on slices -------------------------------------------------------------------------
def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _timed(collective: Callable[[], torch.Tensor]) -> torch.Tensor:
    began = time.perf_counter()
    result = collective()
    _COMM_SECONDS[0] += time.perf_counter() - began
    return result


def _gather_slices(local: torch.Tensor, counts: Sequence[int], rank: int, group, dim: int) -> torch.Tensor:
    """Every rank's slice of a tensor split along ``dim`` by ``counts``, concatenated in rank order.

    One broadcast per rank rather than an all-gather: the slices may differ in size (no padding), and gloo's
    broadcasts between two processes are about ten times faster than its all-gather (6 ms against 70 ms for two
    slices of 6 MB, measured on a busy 2-core machine).
    """
    local = local.contiguous()
    parts = []
    for src, count in enumerate(counts):
        if src == rank:
            part = local
        else:
            shape = list(local.shape)
            shape[dim] = count
            part = local.new_empty(shape)
        dist.broadcast(part, _global_rank(group, src), group=group)
        parts.append(part)
    return torch.cat(parts, dim=dim)


def _reduce_scatter_slices(partial: torch.Tensor, counts: Sequence[int], rank: int, group, dim: int) -> torch.Tensor:
    """This rank's slice (along ``dim``, split by ``counts``) of the sum over ranks of ``partial``.

    Point-to-point: each rank sends every other rank that rank's slice and adds what it receives, in rank order (so
    two ranks add the same two numbers an all-reduce would). Half the bytes of an all-reduce, and gloo's own
    reduce-scatter is slower than its all-reduce (40 against 15 ms for 12 MB, on the same machine).
    """
    slices = partial.split(list(counts), dim=dim)
    mine = slices[rank].contiguous()
    received: dict[int, torch.Tensor] = {}
    ops = []
    for peer in range(len(counts)):
        if peer == rank:
            continue
        received[peer] = torch.empty_like(mine)
        ops.append(dist.P2POp(dist.isend, slices[peer].contiguous(), _global_rank(group, peer), group))
        ops.append(dist.P2POp(dist.irecv, received[peer], _global_rank(group, peer), group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    total = None
    for peer in range(len(counts)):
        part = mine if peer == rank else received[peer]
        total = part.clone() if total is None else total.add_(part)
    return total


# --- autograd-aware collectives -------------------------------------------------------------------
class GatherChannels(torch.autograd.Function):
    """Gather unequal channel slices along axis 1; the backward pass returns this rank's slice of the gradient.

    The gradient is sliced, not reduced: the layers after the gather run identically on every rank, so the incoming
    gradient is already the full gradient on each of them (see the module docstring). With ``partial_grad`` the
    gather feeds a chained :class:`FilterParallelConv` whose input gradient is each rank's partial sum: the slice is
    then reduce-scattered.
    """

    @staticmethod
    def forward(
        ctx, local: torch.Tensor, counts: tuple[int, ...], rank: int, group, partial_grad: bool = False
    ) -> torch.Tensor:
        if local.shape[1] != counts[rank]:
            raise ValueError(f"rank {rank} holds {local.shape[1]} channels, its share is {counts[rank]}.")
        ctx.counts, ctx.rank, ctx.group, ctx.partial_grad = counts, rank, group, partial_grad
        return _timed(lambda: _gather_slices(local, counts, rank, group, dim=1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.partial_grad:
            local = _timed(lambda: _reduce_scatter_slices(grad, ctx.counts, ctx.rank, ctx.group, dim=1))
        else:
            start = sum(ctx.counts[: ctx.rank])
            local = grad[:, start : start + ctx.counts[ctx.rank]].contiguous()
        return local, None, None, None, None


class ReduceInputGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ranks (each rank's filters contribute only their part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        _timed(lambda: dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group))
        return grad, None


# --- the layer -------------------------------------------------------------------------------------
def _absorbable(module: nn.Module) -> bool:
    """Whether ``module`` works channel by channel, so that it can run on a slice of the channels before the gather."""
    if type(module) in _PER_CHANNEL_NORMS:
        return True
    if isinstance(module, _MAX_POOLS):
        return not module.return_indices
    return isinstance(module, _CHANNELWISE)


def _slice_module(module: nn.Module, start: int, stop: int) -> nn.Module:
    """A copy of a channel-wise ``module`` holding channels ``start:stop`` of its per-channel tensors."""
    piece = copy.deepcopy(module)
    if type(module) in _PER_CHANNEL_NORMS:
        piece.num_features = stop - start
        with torch.no_grad():
            for name, tensor in _per_channel_tensors(module):
                sliced = tensor[start:stop].clone()
                if isinstance(tensor, nn.Parameter):
                    setattr(piece, name, nn.Parameter(sliced, requires_grad=tensor.requires_grad))
                else:
                    setattr(piece, name, sliced)
    return piece


def _per_channel_tensors(norm: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The affine parameters and running statistics of a per-channel norm (not ``num_batches_tracked``)."""
    tensors = [*norm.named_parameters(recurse=False), *norm.named_buffers(recurse=False)]
    return [(n, t) for n, t in tensors if t is not None and t.dim() == 1 and n != "num_batches_tracked"]


class FilterParallelConv(nn.Module):
    """This rank's slice of the filters of ``conv``; its output is the whole layer's output, gathered from all ranks.

    Every rank must wrap the same layer with the same ``shares`` and call it in the same order (it runs
    collectives). The slice is a copy: ``conv`` is left as it was.

    Args:
        conv: A ``Conv1d``, ``Conv2d`` or ``Conv3d`` with ``groups=1``.
        rank: Rank of this process in ``group``.
        shares: One share per rank of ``group`` (any scale), e.g. ``(0.7, 0.3)``.
        group: Process group of the ranks sharing the layer; ``None`` is the default group.
        absorbed: Channel-wise layers that follow ``conv`` (activations, pooling, per-channel norms), applied to
            this rank's slice before the gather; copied, norms sliced.

    Attributes:
        counts: Filters per rank.
        start, stop: This rank's filters, ``conv.weight[start:stop]``.
        local: The convolution of this rank's filters.
        post: The absorbed layers, as an ``nn.Sequential`` over this rank's channels.
        reduce_input_grad: Whether the input gradient is all-reduced (``False`` for the second of two chained
            layers: the first layer's gather reduce-scatters it).
        partial_output_grad: Whether the gradient of the output arrives as every rank's partial sum (the first of
            two chained layers), so that the gather's backward reduce-scatters it.
    """

    def __init__(
        self, conv: nn.Module, rank: int, shares: Sequence[float], group=None, absorbed: Sequence[nn.Module] = ()
    ) -> None:
        super().__init__()
        if not isinstance(conv, _CONV_TYPES):
            raise TypeError(f"FilterParallelConv wraps Conv1d/2d/3d, got {type(conv).__name__}.")
        if conv.groups != 1:
            raise ValueError(f"only groups=1 convolutions can be split by filters, got groups={conv.groups}.")
        if not 0 <= rank < len(shares):
            raise ValueError(f"rank {rank} is outside the {len(shares)} ranks of shares {list(shares)}.")
        refused = [type(m).__name__ for m in absorbed if not _absorbable(m)]
        if refused:
            raise ValueError(f"only channel-wise layers can be absorbed into a split convolution, got {refused}.")
        self.counts = tuple(split_channels(conv.out_channels, shares))
        self.rank = rank
        self.group = group
        self.start = sum(self.counts[:rank])
        self.stop = self.start + self.counts[rank]
        self.out_channels = conv.out_channels
        self.reduce_input_grad = True
        self.partial_output_grad = False
        self.local = conv_like(conv, conv.in_channels, self.counts[rank])
        with torch.no_grad():
            self.local.weight.copy_(conv.weight[self.start : self.stop])
            if conv.bias is not None:
                self.local.bias.copy_(conv.bias[self.start : self.stop])
        self.post = nn.Sequential(*(_slice_module(m, self.start, self.stop) for m in absorbed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole output ``(B, out_channels, *spatial)`` of the conv and absorbed layers: every rank's filters."""
        if self.reduce_input_grad:
            x = ReduceInputGrad.apply(x, self.group)
        local = self.post(self.local(x))
        return GatherChannels.apply(local, self.counts, self.rank, self.group, self.partial_output_grad)

    @torch.no_grad()
    def full_conv(self) -> nn.Module:
        """A plain convolution with every rank's filters (a collective: every rank must call it).

        Gradients come along: where the slices have one, the whole layer's parameters get the gathered gradient.
        """
        local = self.local
        conv = conv_like(local, local.in_channels, self.out_channels)
        conv.weight = self._gather_parameter(local.weight)
        if local.bias is not None:
            conv.bias = self._gather_parameter(local.bias)
        return conv

    @torch.no_grad()
    def full_absorbed(self) -> list[nn.Module]:
        """The absorbed layers whole again, norms with every rank's channels and gradients (a collective)."""
        layers = []
        for piece in self.post:
            whole = copy.deepcopy(piece)
            if type(piece) in _PER_CHANNEL_NORMS:
                whole.num_features = self.out_channels
                for name, tensor in _per_channel_tensors(piece):
                    if isinstance(tensor, nn.Parameter):
                        setattr(whole, name, self._gather_parameter(tensor))
                    else:
                        setattr(whole, name, _gather_slices(tensor.detach(), self.counts, self.rank, self.group, 0))
            layers.append(whole)
        return layers

    def _gather_parameter(self, local: nn.Parameter) -> nn.Parameter:
        whole = nn.Parameter(
            _gather_slices(local.detach(), self.counts, self.rank, self.group, 0), requires_grad=local.requires_grad
        )
        # Every rank has a gradient or none (same code on the same batch), so they all take part or none.
        if local.grad is not None:
            whole.grad = _gather_slices(local.grad, self.counts, self.rank, self.group, 0)
        return whole

    def extra_repr(self) -> str:
        chained = f", chained: input {not self.reduce_input_grad}, output {self.partial_output_grad}"
        return f"filters {self.start}:{self.stop} of {self.out_channels}, counts={list(self.counts)}{chained}"


def _convert(module: nn.Module, make: Callable[[nn.Module, Sequence[nn.Module]], FilterParallelConv]) -> None:
    """Replace every conv below ``module`` by ``make(conv, absorbed)``, absorbing and chaining inside Sequentials."""
    children = list(module.named_children())
    if not isinstance(module, nn.Sequential):
        for name, child in children:
            if isinstance(child, _CONV_TYPES):
                setattr(module, name, make(child, ()))
            else:
                _convert(child, make)
        return
    previous, index = None, 0
    while index < len(children):
        name, child = children[index]
        if not isinstance(child, _CONV_TYPES):
            _convert(child, make)
            previous, index = None, index + 1
            continue
        end = index + 1
        while end < len(children) and _absorbable(children[end][1]):
            end += 1
        layer = make(child, [m for _, m in children[index + 1 : end]])
        setattr(module, name, layer)
        # The absorbed layers' places hold identities, so the other children keep their names and positions;
        # to_single_model puts the layers back.
        for absorbed_name, _ in children[index + 1 : end]:
            setattr(module, absorbed_name, nn.Identity())
        if previous is not None:
            # The gathered output of ``previous`` goes to this layer alone (a Sequential), whose own filters see
            # all of it: the input gradient can be reduce-scattered instead of all-reduced and then sliced.
            previous.partial_output_grad = True
            layer.reduce_input_grad = False
        previous, index = layer, end


def to_filter_parallel(model: nn.Module, rank: int, shares: Sequence[float], group=None) -> nn.Module:
    """A copy of ``model`` (a ``VGG``, ``ResNet`` or any network) with every convolution split by filters.

    Every ``Conv1d``/``Conv2d``/``Conv3d`` becomes a :class:`FilterParallelConv` holding this rank's share; inside
    an ``nn.Sequential`` it absorbs the channel-wise layers that follow it and is chained with a split convolution
    right after it (see the module docstring). All other layers are copied whole (replicated). Every rank must
    convert an identical model (same weights) with the same ``shares``.

    Args:
        model: The single-process network (not modified).
        rank: Rank of this process in ``group``.
        shares: One share per rank, e.g. from :func:`calibrate_shares`.
        group: Process group; ``None`` is the default group.
    """
    parallel = copy.deepcopy(model)
    _convert(parallel, lambda conv, absorbed: FilterParallelConv(conv, rank, shares, group, absorbed))
    return parallel


def _restore(module: nn.Module) -> None:
    children = list(module.named_children())
    for index, (name, child) in enumerate(children):
        if not isinstance(child, FilterParallelConv):
            _restore(child)
            continue
        setattr(module, name, child.full_conv())
        for (absorbed_name, _), whole in zip(children[index + 1 :], child.full_absorbed(), strict=False):
            setattr(module, absorbed_name, whole)


def to_single_model(model: nn.Module) -> nn.Module:
    """A plain copy of a filter-parallel ``model`` with every layer whole again (a collective).

    The copy has the names and layout of the single-process model it came from; where the parallel model holds
    gradients, the copy's parameters hold the same gradients (the split ones gathered), so a check against one
    model's backward pass can compare parameter by parameter.
    """
    # Process groups cannot be copied; the copy shares them.
    groups = {id(m.group): m.group for m in model.modules() if isinstance(m, FilterParallelConv)}
    single = copy.deepcopy(model, memo=groups)
    for original, copied in zip(model.parameters(), single.parameters(), strict=True):
        if original.grad is not None:
            copied.grad = original.grad.detach().clone()
    _restore(single)
    return single


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters every rank holds whole: all but the filter slices of :class:`FilterParallelConv` layers."""
    sliced = {id(p) for m in model.modules() if isinstance(m, FilterParallelConv) for p in m.parameters()}
    return [p for p in model.parameters() if id(p) not in sliced]


def sync_replicated_grads(model: nn.Module, group=None) -> None:
    """Average the gradients of the replicated parameters over ranks, in one all-reduce.

    They are equal already up to the summation order of threads; the average keeps the copies bit-identical. Its
    time counts as communication.
    """
    params = [p for p in replicated_parameters(model) if p.grad is not None]
    if not params:
        return
    world = dist.get_world_size(group)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    _timed(lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group))
    flat /= world
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


@torch.no_grad()
def replicated_divergence(model: nn.Module, group=None) -> float:
    """Largest difference between ranks over the replicated parameters and float buffers (0.0 when in sync)."""
    prefixes = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, FilterParallelConv))
    tensors = [t for key, t in model.state_dict().items() if not key.startswith(prefixes) and t.is_floating_point()]
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
    calibration_samples: int,
) -> None:
    torch.set_num_threads(threads)
    dev = device_for(device, info.rank)
    with process_group(info, backend_for(device)):
        torch.manual_seed(spec.seed)  # dropout masks must be equal on every rank
        net = net.to(dev)
        calibration_s = 0.0
        if shares is None:
            start = time.perf_counter()
            probe = x_train[:calibration_samples].to(dev), y_train[:calibration_samples].to(dev)
            shares = calibrate_shares(net, *probe, steps=calibration_steps)
            calibration_s = time.perf_counter() - start
        shares = normalize_shares(shares)
        model = to_filter_parallel(net, info.rank, shares)
        optimizer = make_optimizer(model.parameters(), spec)
        # Cumulative communication seconds after each step's last collective (the optimizer step runs none).
        comm_marks = [_COMM_SECONDS[0]]

        def after_backward() -> None:
            sync_replicated_grads(model)
            comm_marks.append(_COMM_SECONDS[0])

        dist.barrier()
        start = time.perf_counter()
        cpu_times: list[float] = []
        step_times = train_epochs(
            model, optimizer, x_train, y_train, spec, dev, after_backward=after_backward, cpu_times=cpu_times
        )
        wall = time.perf_counter() - start
        # The same steps as the step-time summary (warm-up left out), so that the two can be subtracted.
        comm_steps = [b - a for a, b in zip(comm_marks, comm_marks[1:], strict=False)]
        comm = timing_summary(comm_steps)["step_time_mean_s"]
        cpu = timing_summary(cpu_times)["step_time_mean_s"]
        largest = torch.tensor([comm, cpu], dtype=torch.float64, device=dev)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        divergence = replicated_divergence(model)
        single = to_single_model(model).cpu()
        if info.rank == 0:
            timing = timing_summary(step_times)
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
                    "comm_time_per_step_s": comm,
                    "comm_time_per_step_max_s": float(largest[0]),
                    "cpu_time_per_step_s": cpu,
                    "cpu_time_per_step_max_s": float(largest[1]),
                    "compute_time_per_step_s": timing["step_time_mean_s"] - comm,
                    **timing,
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
    calibration_samples: int | None = None,
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
        threads: CPU threads per rank; ``None`` is :func:`ddcnn.baselines.launch.threads_per_rank` (one).
        calibration_steps: Timed steps of the calibration run.
        calibration_samples: Training samples the calibration run times the model on; ``None`` is one batch. Fewer
            make the calibration of a large network cheaper (the time per sample is about the same).
        timeout_s: Deadline of the whole run and of every collective.

    Returns:
        ``method``, ``processes``, ``accuracy`` (test), ``wall_time_s`` (training, after calibration),
        ``step_time_s`` (median) and ``step_time_mean_s`` (of rank 0), ``steps``, ``shares``, ``filters_per_rank``,
        ``calibration_s``, ``replicated_divergence`` (0.0: the replicated layers stayed in sync),
        ``comm_time_per_step_s`` (rank 0's mean time per step inside collectives: the layers' gathers,
        all-reduces and reduce-scatters and the replicated-gradient all-reduce, waiting for the other ranks
        included), ``comm_time_per_step_max_s`` (the same, the largest over ranks), ``compute_time_per_step_s``
        (rank 0's mean step time less its communication; the means leave the same warm-up steps out),
        ``cpu_time_per_step_s`` (rank 0's mean CPU seconds of a step, all its threads) and
        ``cpu_time_per_step_max_s`` (the largest over ranks), and the gathered ``state_dict`` of the trained
        single-process network.
    """
    if shares is not None and len(shares) != world_size:
        raise ValueError(f"got {len(shares)} shares for {world_size} processes.")
    threads = threads or threads_per_rank(world_size)
    samples = calibration_samples or spec.batch_size
    args = (net, x_train, y_train, x_test, y_test, spec, shares, device, threads, calibration_steps, samples)
    return launch(_rank_main, world_size, args, timeout_s)[0]
