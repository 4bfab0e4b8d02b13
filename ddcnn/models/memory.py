"""The memory and arithmetic of one training step of a network, planned without running it at full size.

:func:`plan_network` traces one step (forward, cross-entropy, backward) on meta tensors: every operation computes only
its output's shape, so a 256³ volume costs what a 2³ one does (no data, no arithmetic). What autograd saves for backward
is read in the trace with :func:`torch.autograd.graph.saved_tensors_hooks`, each saved storage counted once (a view and
its base, a tensor saved by two operations), the parameters and the input batch left out (counted on their own); the
FLOPs by :class:`torch.utils.flop_counter.FlopCounterMode`. A network that cannot be traced so (an operation without a
meta kernel, Python that reads a value) steps for real at a scaled-down input, and its activations and FLOPs are
extrapolated in voxels (``method: "scaled"``; the head's share is then overstated).

The plan of a step is ``params + grads + optimizer state + saved activations + the batch``: what a training holds at
the end of its forward, measured on the CPU by the same hooks on a real step (``bench/memory_plan.py``; within 1% on
ddcnn's nets). Not in it: the allocator's rounding and caches, cuDNN workspaces and the transient outputs of single
operations, which a GPU adds on top (``torch.cuda.max_memory_allocated`` measures them).

Precision: ``32-true`` and ``64-true`` trace in float32 and float64. Under ``bf16-mixed`` / ``16-mixed`` the weights,
gradients and optimizer state stay float32, the activations are traced in the half dtype and a half copy of the
weights (autocast's cast cache) is added: an approximation of autocast, whose float32 operations (softmax, norms'
statistics) are few in a convnet.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

__all__ = [
    "NetPlan",
    "plan_network",
    "meta_state",
    "trace_step",
    "StepTrace",
    "optimizer_state_factor",
    "compute_dtype",
    "measure_step",
    "MIB",
]

MIB = 2**20
# The voxels of the scaled-down step of a network that cannot be traced on meta tensors, per spatial dimension.
SCALED_VOXELS = {1: 4096, 2: 64 * 64, 3: 24**3}
# Optimizer state per parameter element, in parameter-sized tensors (torch's implementations).
_STATE_FACTORS = {
    "adam": 2,
    "adamw": 2,
    "nadam": 2,
    "radam": 2,
    "adamax": 2,
    "adadelta": 2,
    "adagrad": 1,
    "asgd": 1,
    "rprop": 2,
}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype a step's activations have under a loop precision (``32-true``, ``64-true``, ``bf16-mixed``,
    ``16-mixed``)."""
    return {"64-true": torch.float64, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(
        precision, torch.float32
    )


def optimizer_state_factor(spec: Any) -> int:
    """Optimizer state per parameter, in parameter-sized tensors, of an optimizer setting (a ``_target_`` node or a
    callable): Adam and its kin 2, SGD 1 with momentum else 0, RMSprop 1 (+1 momentum, +1 centered), L-BFGS
    ``2 * history_size + 2``; an optimizer not known here counts as Adam (2)."""
    target = spec.get("_target_", "") if isinstance(spec, Mapping) else getattr(spec, "__name__", "")
    name = str(target).rsplit(".", 1)[-1].lower()
    kwargs = spec if isinstance(spec, Mapping) else {}
    if name == "sgd":
        return 1 if float(kwargs.get("momentum") or 0.0) > 0 else 0
    if name == "rmsprop":
        return 1 + (float(kwargs.get("momentum") or 0.0) > 0) + bool(kwargs.get("centered"))
    if name == "lbfgs":
        return 2 * int(kwargs.get("history_size") or 100) + 2
    if name in ("adam", "adamw") and kwargs.get("amsgrad"):
        return 3
    return _STATE_FACTORS.get(name, 2)


@dataclass(frozen=True)
class NetPlan:
    """The planned memory (bytes) and FLOPs of one training step of a network at a batch, precision and device.

    Attributes:
        params_bytes: The trainable and frozen parameters and the buffers.
        grads_bytes: A gradient per trainable parameter.
        optimizer_bytes: The optimizer's state (:func:`optimizer_state_factor`).
        activation_bytes: What autograd saves for backward (with activation checkpointing: what it keeps).
        batch_bytes: The batch on the device (inputs and labels).
        flops_per_step: Forward and backward FLOPs of one step (a recompute of checkpointing not included).
        method: ``meta`` (traced on meta tensors) or ``scaled`` (a real step at fewer voxels, extrapolated).
        checkpointing: Whether the plan counts activation checkpointing.
    """

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    batch_bytes: int
    flops_per_step: int
    method: str
    checkpointing: bool = False

    @property
    def peak_bytes(self) -> int:
        """What the step holds at the end of its forward: everything above together."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes + self.batch_bytes

    def as_dict(self) -> dict[str, Any]:
        """The plan as ``memory_plan.json`` records it (``peak_bytes`` included)."""
        return asdict(self) | {"peak_bytes": self.peak_bytes}


@dataclass
class StepTrace:
    """What one traced step saved for backward and computed.

    Attributes:
        saved_bytes: Every saved storage once, the parameters and the input left out.
        flops: Forward and backward FLOPs.
        runs: Per recomputable run (``runs`` of :func:`trace_step`): ``(saved bytes inside it, its input's bytes)``.
        outside_bytes: Saved bytes outside every run.
    """

    saved_bytes: int
    flops: int
    runs: list[tuple[int, int]]
    outside_bytes: int

    def checkpointed_bytes(self) -> int:
        """What a checkpointed step keeps: the saves outside the runs, every run's input, and one run's saves (the
        one recomputed at a time in backward, the largest)."""
        if not self.runs:
            return self.saved_bytes
        return self.outside_bytes + sum(inp for _, inp in self.runs) + max(saved for saved, _ in self.runs)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def meta_state(net: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``net``'s parameters and buffers as meta tensors (floating ones in ``dtype`` when given), parameters requiring
    gradients as they do: a stand-in for :func:`torch.func.functional_call` that holds no memory."""
    out = {}
    for name, t in [*net.named_parameters(remove_duplicate=False), *net.named_buffers(remove_duplicate=False)]:
        kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
        meta = torch.empty_like(t, device="meta", dtype=kind)
        out[name] = meta.requires_grad_(t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return out


def _real_state(net: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in [*net.named_parameters(remove_duplicate=False), *net.named_buffers(remove_duplicate=False)]:
        kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
        copy = t.detach().to(dtype=kind, copy=True)
        out[name] = copy.requires_grad_(t.requires_grad) if isinstance(t, nn.Parameter) else copy
    return out


@contextlib.contextmanager
def _run_hooks(
    runs: Sequence[Sequence[nn.Module]], current: list[int | None], inputs: dict[int, int]
) -> Iterator[None]:
    """Forward hooks that say which run (a list of modules executed in order) is executing, and its input's bytes."""
    handles = []
    for index, modules in enumerate(runs):

        def enter(module, args, index=index) -> None:
            current[0] = index
            if args and isinstance(args[0], torch.Tensor):
                inputs[index] = args[0].untyped_storage().nbytes()

        def leave(module, args, output) -> None:
            current[0] = None

        handles.append(modules[0].register_forward_pre_hook(enter))
        handles.append(modules[-1].register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def trace_step(
    net: nn.Module,
    state: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    runs: Sequence[Sequence[nn.Module]] = (),
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> StepTrace:
    """One training step of ``net`` with ``state`` (meta or real tensors, :func:`torch.func.functional_call`) on batch
    ``x, y``: what autograd saved for backward and the FLOPs of forward and backward.

    ``runs``: runs of modules that activation checkpointing would recompute; the saves inside each are counted apart
    (:meth:`StepTrace.checkpointed_bytes`). ``net`` itself is left as it was (its parameters and buffers are not used).
    """
    skip = {_storage_key(t) for t in state.values()} | {_storage_key(x)}
    saved: dict[int, tuple[int, int | None]] = {}
    current: list[int | None] = [None]
    inputs: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in skip and key not in saved:
            saved[key] = (t.untyped_storage().nbytes(), current[0])
        return t

    was_training = net.training
    net.train()
    try:
        with FlopCounterMode(display=False) as flops, _run_hooks(runs, current, inputs):
            with (
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                autocast() if autocast else (contextlib.nullcontext()),
            ):
                logits = functional_call(net, dict(state), (x,))
                loss = F.cross_entropy(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, y)
            loss.backward()
    finally:
        net.train(was_training)
    per_run = [0] * len(runs)
    outside = 0
    for nbytes, run in saved.values():
        if run is None:
            outside += nbytes
        else:
            per_run[run] += nbytes
    return StepTrace(
        saved_bytes=sum(nbytes for nbytes, _ in saved.values()),
        flops=int(flops.get_total_flops()),
        runs=[(per_run[i], inputs.get(i, 0)) for i in range(len(runs))],
        outside_bytes=outside,
    )


def _scaled_shape(spatial: Sequence[int]) -> tuple[int, ...]:
    cap = SCALED_VOXELS.get(len(spatial), 4096)
    voxels = math.prod(spatial)
    if voxels <= cap:
        return tuple(spatial)
    f = (cap / voxels) ** (1 / len(spatial))
    return tuple(max(min(n, 8), math.ceil(n * f)) for n in spatial)


def plan_network(
    net: nn.Module,
    sample_shape: Sequence[int],
    batch: int,
    *,
    precision: str = "32-true",
    optimizer: Any = None,
    runs: Sequence[Sequence[nn.Module]] | None = None,
    num_classes: int | None = None,
) -> NetPlan:
    """The plan of one training step of ``net`` on batches of ``batch`` samples of ``sample_shape`` (``(C, *spatial)``;
    the coarse DNN's ``(N, K)``) under ``precision``, with ``optimizer`` (its setting; ``None``: Adam's state) and,
    when ``runs`` is given, activation checkpointing of those runs (:func:`ddcnn.models.checkpointing.checkpoint_runs`).

    Traced on meta tensors (module doc); a network that cannot be traced so steps for real on the CPU at a scaled-down
    input (``method="scaled"``), which needs ``net``'s real parameters.
    """
    params = list(net.parameters())
    trainable = [p for p in params if p.requires_grad]
    pdtype = torch.float64 if precision == "64-true" else torch.float32
    cdtype = compute_dtype(precision)
    esize = torch.empty((), dtype=pdtype).element_size()
    n_params = sum(p.numel() for p in params) + sum(b.numel() for b in net.buffers() if b.is_floating_point())
    n_trainable = sum(p.numel() for p in trainable)
    factor = optimizer_state_factor(optimizer if optimizer is not None else {"_target_": "torch.optim.Adam"})
    input_dtype = torch.float64 if precision == "64-true" else torch.float32
    batch_bytes = batch * math.prod(sample_shape) * torch.empty((), dtype=input_dtype).element_size() + batch * 8
    out_classes = num_classes or 2
    runs = list(runs or [])
    try:
        state = meta_state(net, cdtype)
        x = torch.zeros(batch, *sample_shape, device="meta", dtype=cdtype)
        y = torch.zeros(batch, dtype=torch.long, device="meta")
        trace, method, scale = trace_step(net, state, x, y, runs), "meta", 1.0
    except Exception:  # an operation without a meta kernel, or Python reading a value: a real step, smaller
        spatial = tuple(sample_shape[1:])
        small = _scaled_shape(spatial)
        scale = math.prod(spatial) / math.prod(small) if spatial else 1.0
        state = _real_state(net, cdtype)
        x = torch.zeros(batch, sample_shape[0], *small, dtype=cdtype)
        y = torch.zeros(batch, dtype=torch.long).clamp_(max=out_classes - 1)
        trace, method = trace_step(net, state, x, y, runs), "scaled"
    activations = trace.checkpointed_bytes() if runs else trace.saved_bytes
    if cdtype != pdtype and method == "meta":  # autocast's half copies of the weights, saved by their operations
        activations += n_trainable * torch.empty((), dtype=cdtype).element_size()
    return NetPlan(
        params_bytes=n_params * esize,
        grads_bytes=n_trainable * esize,
        optimizer_bytes=factor * n_trainable * esize,
        activation_bytes=int(activations * scale),
        batch_bytes=int(batch_bytes),
        flops_per_step=int(trace.flops * scale),
        method=method,
        checkpointing=bool(runs),
    )


def measure_step(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer: Callable[..., torch.optim.Optimizer] | None = None
) -> dict[str, int]:
    """What one real training step of ``net`` on ``x, y`` holds, measured on its device (allocator-independent): the
    bytes autograd saved for backward (each storage once, parameters and input left out, as :func:`plan_network`
    counts them), the parameters and buffers, the gradients and the optimizer's state after its first step
    (``optimizer``: ``params -> Optimizer``, default Adam). ``net`` is trained one step in place.

    Returns:
        ``params_bytes``, ``grads_bytes``, ``optimizer_bytes``, ``activation_bytes``, ``total_bytes`` (their sum) and
        ``flops_per_step``.
    """
    params = list(net.parameters())
    skip = {p.untyped_storage().data_ptr() for p in params} | {x.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    net.train()
    opt = (optimizer or torch.optim.Adam)(params)
    with FlopCounterMode(display=False) as flops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(net(x), y)
        activation = sum(saved.values())
        loss.backward()
    opt.step()
    state = sum(t.nbytes for v in opt.state.values() for t in v.values() if isinstance(t, torch.Tensor) and t.dim())
    out = {
        "params_bytes": sum(p.nbytes for p in params) + sum(b.nbytes for b in net.buffers() if b.is_floating_point()),
        "grads_bytes": sum(p.grad.nbytes for p in params if p.grad is not None),
        "optimizer_bytes": int(state),
        "activation_bytes": int(activation),
    }
    return out | {"total_bytes": sum(out.values()), "flops_per_step": int(flops.get_total_flops())}
