"""What the backbone tests (VGG, ResNet) share: class count, norms, inputs and the training-step check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

NUM_CLASSES = 5  # odd, so a hard-coded 10 classes cannot pass
NORMS = ["batch", "instance", "group", "layer", "none"]
NORM_TYPES = {
    2: {"batch": nn.BatchNorm2d, "instance": nn.InstanceNorm2d},
    3: {"batch": nn.BatchNorm3d, "instance": nn.InstanceNorm3d},
}
ALL_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.GroupNorm, nn.LayerNorm)


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    # These tensors are tiny: with 2 threads, OpenMP hand-offs (and any other busy process) cost 100x the work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_input(spatial_dims: int, size: tuple[int, ...] | int, batch: int = 2, channels: int = 1) -> torch.Tensor:
    shape = (size,) * spatial_dims if isinstance(size, int) else size
    return torch.randn(batch, channels, *shape)


def assert_trains(net: nn.Module, x: torch.Tensor) -> None:
    """One training step's backward: logits have the right shape, every parameter gets a finite gradient."""
    net.train()
    logits = net(x)
    assert logits.shape == (x.shape[0], NUM_CLASSES)
    loss = nn.functional.cross_entropy(logits, torch.arange(x.shape[0]) % NUM_CLASSES)
    loss.backward()
    for name, parameter in net.named_parameters():
        assert parameter.grad is not None, f"{name} has no gradient"
        assert torch.isfinite(parameter.grad).all(), f"{name} has a non-finite gradient"


def num_parameters(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def assert_backbone(net: nn.Module, x: torch.Tensor) -> None:
    """``forward_features`` gives ``num_features`` per sample, its ``forward_head`` is ``forward``; it trains."""
    features = net.forward_features(x)
    assert features.shape == (x.shape[0], net.num_features)
    assert torch.equal(net.forward_head(features), net(x))
    assert_trains(net, x)


def norm_layers(net: nn.Module, spatial_dims: int, norm: str) -> tuple[list[nn.Module], type]:
    """Every normalisation layer of ``net`` and the type ``norm`` must have given each of them."""
    return [m for m in net.modules() if isinstance(m, ALL_NORM_TYPES)], NORM_TYPES[spatial_dims].get(norm, nn.GroupNorm)
