"""The memory plan of a training step (ddcnn/models/memory.py) against a real step's measurement."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ddcnn.models.checkpointing import apply_checkpointing, checkpoint_runs
from ddcnn.models.memory import measure_step, optimizer_state_factor, plan_network
from ddcnn.models.resnet import resnet_tiny
from ddcnn.models.vgg import vgg_small, vgg_tiny

K = 5
BUILDERS = {"vgg_tiny": vgg_tiny, "resnet_tiny": resnet_tiny, "vgg_small": vgg_small}


def _real(net: nn.Module, shape: tuple[int, ...], batch: int, dtype=torch.float32) -> dict[str, int]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=gen, dtype=dtype)
    return measure_step(copy.deepcopy(net).to(dtype), x, torch.randint(K, (batch,), generator=gen))


@pytest.mark.parametrize(
    ("name", "spatial_dims", "side"),
    [("vgg_tiny", 2, 32), ("resnet_tiny", 2, 24), ("vgg_tiny", 3, 12), ("resnet_tiny", 3, 16), ("vgg_small", 3, 20)],
)
def test_plan_matches_a_real_step(name: str, spatial_dims: int, side: int) -> None:
    net = BUILDERS[name](spatial_dims=spatial_dims, in_channels=2, num_classes=K, norm="batch")
    shape = (2, *(side,) * spatial_dims)
    plan = plan_network(net, shape, 3, num_classes=K)
    real = _real(net, shape, 3)
    assert plan.method == "meta"
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert plan.as_dict()[key] == real[key], key
    # the labels and the loss's scalars are all that differ: bytes, not kilobytes
    assert abs(plan.activation_bytes - real["activation_bytes"]) <= max(4096, 0.01 * real["activation_bytes"])
    assert plan.flops_per_step == real["flops_per_step"]
    assert plan.batch_bytes == 3 * 2 * side**spatial_dims * 4 + 3 * 8
    assert plan.peak_bytes == real["total_bytes"] - real["activation_bytes"] + plan.activation_bytes + plan.batch_bytes


def test_float64_and_sgd() -> None:
    net = vgg_tiny(spatial_dims=2, in_channels=1, num_classes=K)
    sgd = {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}
    plan = plan_network(net, (1, 16, 16), 2, precision="64-true", optimizer=sgd, num_classes=K)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 1, 16, 16, generator=gen, dtype=torch.float64), torch.randint(K, (2,), generator=gen)
    real = measure_step(copy.deepcopy(net).double(), x, y, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert plan.params_bytes == real["params_bytes"] and plan.optimizer_bytes == real["optimizer_bytes"]
    assert plan.optimizer_bytes == plan.grads_bytes  # one momentum buffer per parameter
    assert abs(plan.activation_bytes - real["activation_bytes"]) <= 4096
    assert optimizer_state_factor({"_target_": "torch.optim.SGD"}) == 0
    assert optimizer_state_factor({"_target_": "torch.optim.AdamW"}) == 2


@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_checkpointed_plan_bounds_a_checkpointed_step(spatial_dims: int) -> None:
    """What a checkpointed step keeps (its stages' inputs, one stage recomputed at a time) is what the plan counts:
    below the plan without checkpointing, at least what the real checkpointed forward holds outside its stages."""
    net = vgg_tiny(spatial_dims=spatial_dims, in_channels=1, num_classes=K, norm="batch")
    shape = (1, *(16,) * spatial_dims)
    plain = plan_network(net, shape, 4, num_classes=K)
    cut = plan_network(net, shape, 4, num_classes=K, runs=checkpoint_runs(net))
    held = _real(apply_checkpointing(copy.deepcopy(net)), shape, 4)["activation_bytes"]
    assert cut.checkpointing and held <= cut.activation_bytes < plain.activation_bytes


class _ReadsAValue(nn.Module):
    """A network whose forward reads a value (``bool`` of a tensor): no meta tensor has one."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).relu()
        if h.mean() > -1:
            h = h * 1.0
        return self.fc(h.mean((2, 3)))


def test_a_net_that_cannot_be_traced_is_planned_scaled_down() -> None:
    net = _ReadsAValue()
    plan = plan_network(net, (1, 256, 256), 2, num_classes=K)
    assert plan.method == "scaled"
    real = _real(net, (1, 256, 256), 2)
    # extrapolated in voxels from 64x64: the convolution's saves scale exactly, the head's are overstated
    assert real["activation_bytes"] <= plan.activation_bytes <= 1.25 * real["activation_bytes"]


def test_mixed_precision_halves_the_activations_and_keeps_float32_weights() -> None:
    net = vgg_tiny(spatial_dims=3, in_channels=1, num_classes=K, norm="batch")
    full = plan_network(net, (1, 16, 16, 16), 2, num_classes=K)
    half = plan_network(net, (1, 16, 16, 16), 2, precision="bf16-mixed", num_classes=K)
    assert half.params_bytes == full.params_bytes and half.optimizer_bytes == full.optimizer_bytes
    # half the saved activations, plus autocast's bf16 copy of the weights; the max pool's int64 indices stay
    assert 0.5 * full.activation_bytes <= half.activation_bytes < 0.75 * full.activation_bytes
