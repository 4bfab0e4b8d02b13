"""Activation checkpointing of a built network: its stages keep only their inputs for backward and recompute the rest.

Chen, Xu, Zhang & Guestrin, "Training Deep Nets with Sublinear Memory Cost", 2016, https://arxiv.org/abs/1604.06174.

:func:`checkpoint_segments` says which runs of modules are recomputed: ddcnn's :class:`~ddcnn.models.vgg.VGG` per stage
(the convs, norms and activations up to each max pool of ``features``), its :class:`~ddcnn.models.resnet.ResNet` per
stage (``layer1`` .. ``layer4``), any other network in each of its top-level ``nn.Sequential`` children, split as
:func:`torch.utils.checkpoint.checkpoint_sequential` splits one (``segments`` runs of equal length, the last one not
recomputed). A network with no such child is refused with the reason: its ``forward`` is code that ddcnn cannot cut.
:func:`apply_checkpointing` makes the network run so, in place.

``checkpoint_sequential`` itself takes no ``context_fn``, so the runs go through
:func:`torch.utils.checkpoint.checkpoint`
(``use_reentrant=False``) with one: the recompute restores the batch-norm buffers it changed (running mean and variance,
``num_batches_tracked``), so a step updates them once, as without checkpointing (plain checkpointing updates them twice:
``num_batches_tracked`` 2 after one step). Dropout draws the same masks in the recompute (the generator state is kept,
torch's default). Gradients, running statistics and weights are then bit-identical to a training without it (tested in
float64 on the CPU). The state-dict keys stay as they were: the forward of the cut module is replaced on the instance,
no wrapper module is added.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

__all__ = [
    "Segments",
    "CheckpointRefused",
    "checkpoint_segments",
    "apply_checkpointing",
    "checkpoint_runs",
    "remove_checkpointing",
    "is_checkpointed",
]


class CheckpointRefused(ValueError):
    """A network whose forward ddcnn cannot cut into recomputed runs; the message says why and what would work."""


@dataclass(frozen=True)
class Segments:
    """The recomputed runs of one ``nn.Sequential`` child of a network.

    Attributes:
        name: The child's name in the network (``features``, ``layer2``).
        bounds: ``(start, stop)`` module indices of each run; the runs cover the child in order.
        recomputed: Per run, whether it is recomputed in backward (``False``: it runs as it is).
    """

    name: str
    bounds: tuple[tuple[int, int], ...]
    recomputed: tuple[bool, ...]


def _vgg_segments(net: nn.Module) -> list[Segments]:
    features = net.features
    bounds, start = [], 0
    for index, module in enumerate(features):
        if isinstance(module, nn.MaxPool1d | nn.MaxPool2d | nn.MaxPool3d):
            bounds.append((start, index + 1))
            start = index + 1
    if start < len(features):
        bounds.append((start, len(features)))
    return [Segments("features", tuple(bounds), (True,) * len(bounds))]


def _sequential_segments(name: str, child: nn.Sequential, segments: int | None = None) -> Segments:
    """``child`` split as ``checkpoint_sequential(child, segments, x)`` splits it (default: ``ceil(sqrt(len))`` runs,
    the usual choice for O(sqrt(n)) memory)."""
    n = len(child)
    segments = segments or max(1, math.ceil(math.sqrt(n)))
    size = n // segments
    bounds = [(start, start + size) for start in range(0, size * (segments - 1), size)]
    last = bounds[-1][1] if bounds else 0
    bounds.append((last, n))
    return Segments(name, tuple(bounds), (True,) * (len(bounds) - 1) + (False,))


def checkpoint_segments(net: nn.Module) -> list[Segments]:
    """The runs of ``net`` that activation checkpointing recomputes (module doc).

    Raises:
        CheckpointRefused: ``net`` has no ``nn.Sequential`` child of two or more modules, naming its children.
    """
    from ddcnn.models.resnet import ResNet
    from ddcnn.models.vgg import VGG

    if isinstance(net, VGG):
        return _vgg_segments(net)
    if isinstance(net, ResNet):
        return [
            Segments(f"layer{i}", ((0, len(stage)),), (True,))
            for i in range(1, 5)
            if isinstance(stage := getattr(net, f"layer{i}", None), nn.Sequential) and len(stage) > 0
        ]
    if isinstance(net, nn.Sequential):
        return [_sequential_segments("", net)] if len(net) >= 2 else []
    found = [
        _sequential_segments(name, child)
        for name, child in net.named_children()
        if isinstance(child, nn.Sequential) and len(child) >= 2
    ]
    if not found:
        children = ", ".join(f"{name} ({type(child).__name__})" for name, child in net.named_children()) or "none"
        raise CheckpointRefused(
            f"{type(net).__name__} cannot be checkpointed: activation checkpointing recomputes runs of an "
            f"nn.Sequential, and none of its top-level children is one of two or more modules (its children: "
            f"{children}); its forward is code ddcnn cannot cut. Set engine.activation_checkpointing=none, or use one "
            f"of ddcnn's own networks (model=vgg_small, resnet18) or a library network built of sequential stages."
        )
    return found


class _RestoreNormBuffers:
    """The recompute's context: the batch-norm buffers of ``modules`` as they were before it, afterwards."""

    def __init__(self, norms: Sequence[_NormBase]) -> None:
        self.norms = norms
        self.saved: list[list[torch.Tensor]] = []

    def __enter__(self) -> None:
        self.saved = [[b.clone() for b in norm.buffers(recurse=False)] for norm in self.norms]

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for norm, values in zip(self.norms, self.saved, strict=True):
                for buffer, value in zip(norm.buffers(recurse=False), values, strict=True):
                    buffer.copy_(value)
        self.saved = []


def _contexts(norms: tuple[_NormBase, ...]) -> tuple[contextlib.AbstractContextManager, _RestoreNormBuffers]:
    return contextlib.nullcontext(), _RestoreNormBuffers(norms)


def _run(modules: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for module in modules:
        x = module(x)
    return x


def _norms(modules: Sequence[nn.Module]) -> tuple[_NormBase, ...]:
    return tuple(
        m for module in modules for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats
    )


def _checkpointed_forward(seq: nn.Sequential, segments: Segments, x: torch.Tensor) -> torch.Tensor:
    """``seq``'s forward with ``segments``' runs recomputed in backward (only while gradients are recorded)."""
    modules = list(seq)
    record = torch.is_grad_enabled() and seq.training
    for (start, stop), recomputed in zip(segments.bounds, segments.recomputed, strict=True):
        run = modules[start:stop]
        if recomputed and record:
            context_fn = functools.partial(_contexts, _norms(run))
            x = checkpoint(functools.partial(_run, run), x, use_reentrant=False, context_fn=context_fn)
        else:
            x = _run(run, x)
    return x


def _children(net: nn.Module, segments: Sequence[Segments]) -> Iterator[tuple[nn.Sequential, Segments]]:
    for seg in segments:
        yield (net if seg.name == "" else net.get_submodule(seg.name)), seg


def apply_checkpointing(net: nn.Module) -> nn.Module:
    """Make ``net`` recompute its :func:`checkpoint_segments` in backward, in place; returns it (same parameters,
    buffers and state-dict keys). Evaluation and ``torch.no_grad`` forwards run as before.

    Raises:
        CheckpointRefused: For a network that cannot be cut (:func:`checkpoint_segments`).
    """
    for seq, seg in _children(net, checkpoint_segments(net)):
        seq.forward = functools.partial(_checkpointed_forward, seq, seg)  # instance attribute: keys unchanged
    return net


def checkpoint_runs(net: nn.Module) -> list[list[nn.Module]]:
    """The modules of each run that :func:`apply_checkpointing` recomputes, in order (what the memory plan counts:
    :func:`ddcnn.models.memory.plan_network`).

    Raises:
        CheckpointRefused: For a network that cannot be cut (:func:`checkpoint_segments`).
    """
    out = []
    for seq, seg in _children(net, checkpoint_segments(net)):
        modules = list(seq)
        out += [modules[a:b] for (a, b), again in zip(seg.bounds, seg.recomputed, strict=True) if again and b > a]
    return out


def remove_checkpointing(net: nn.Module) -> nn.Module:
    """Undo :func:`apply_checkpointing` on ``net`` in place (the class's forward again); returns it."""
    for module in net.modules():
        if isinstance(module.__dict__.get("forward"), functools.partial):
            del module.forward
    return net


def is_checkpointed(net: nn.Module) -> bool:
    """Whether :func:`apply_checkpointing` was applied to ``net`` (to any of its modules)."""
    return any(isinstance(m.__dict__.get("forward"), functools.partial) for m in net.modules())
