"""Tests for the dimension-generic ResNet."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ddcnn.models import (
    BasicBlock,
    Bottleneck,
    ResNet,
    resnet10,
    resnet18,
    resnet34,
    resnet50,
    resnet101,
    resnet_tiny,
)
from tests.models.conftest import (
    ALL_NORM_TYPES,
    NORMS,
    NUM_CLASSES,
    assert_backbone,
    assert_trains,
    make_input,
    norm_layers,
    num_parameters,
)


def _tiny_bottleneck(spatial_dims: int, **kwargs) -> ResNet:
    return ResNet(spatial_dims, layers=(1, 2), widths=(4, 8), block="bottleneck", **kwargs)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize(
    ("builder", "stem"), [(resnet_tiny, "small"), (resnet_tiny, "imagenet"), (_tiny_bottleneck, "small")]
)
@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_forward_backward(spatial_dims, builder, stem, norm):
    net = builder(spatial_dims, in_channels=2, num_classes=NUM_CLASSES, stem=stem, norm=norm)
    # Instance norm needs >1 spatial position in the last stage: the imagenet stem divides by 4 before it.
    size = 16 if spatial_dims == 2 or stem == "imagenet" else 8
    x = make_input(spatial_dims, size, channels=2)
    assert_backbone(net, x)


@pytest.mark.parametrize("norm", ["batch", "instance", "group", "layer"])
@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_norm_is_threaded_everywhere(spatial_dims, norm):
    # Two stages, so the norm of the projection shortcut (downsample.1) is checked too.
    net = resnet_tiny(spatial_dims, num_classes=NUM_CLASSES, norm=norm)
    norms, expected = norm_layers(net, spatial_dims, norm)
    assert len(norms) == 1 + 2 * 2 + 1  # stem, two per block, one shortcut
    assert all(type(m) is expected for m in norms)
    if norm == "layer":
        assert all(m.num_groups == 1 for m in norms)
    if norm == "group":
        assert all(m.num_groups == 8 for m in norms)
    assert len({id(m) for m in norms}) == len(norms)


def test_norm_none_has_no_norm_layers():
    net = _tiny_bottleneck(3, in_channels=1, num_classes=NUM_CLASSES, norm="none")
    assert not [m for m in net.modules() if isinstance(m, ALL_NORM_TYPES)]


@pytest.mark.parametrize("act", ["gelu", "silu", "leaky_relu", "tanh"])
def test_act_is_threaded_everywhere(act):
    net = _tiny_bottleneck(2, in_channels=1, num_classes=NUM_CLASSES, act=act)
    assert not [m for m in net.modules() if isinstance(m, nn.ReLU)]
    assert_trains(net, make_input(2, 8))


@pytest.mark.parametrize("stem", ["small", "imagenet"])
@pytest.mark.parametrize("builder", [resnet10, resnet18, resnet34, resnet50, resnet101, resnet_tiny])
@pytest.mark.parametrize(("spatial_dims", "size"), [(2, (5, 5)), (2, (1, 7)), (3, (9, 9, 4)), (3, (5, 3, 1))])
def test_small_and_anisotropic_inputs(builder, spatial_dims, size, stem):
    # Width does not change how sizes shrink; 1/8 width keeps the deep 3D variants fast.
    net = builder(spatial_dims, in_channels=1, num_classes=NUM_CLASSES, stem=stem, width_mult=0.125)
    net.train()  # batch norm in training mode needs >1 value per channel: batch 2 at 1x1 is the edge case
    assert net(make_input(spatial_dims, size)).shape == (2, NUM_CLASSES)


def test_standard_depths():
    blocks = {
        builder.__name__: [
            (type(b), len(getattr(net, f"layer{i}"))) for i in range(1, 5) for b in getattr(net, f"layer{i}")[:1]
        ]
        for builder in (resnet10, resnet34, resnet101)
        for net in [builder(3, width_mult=0.125)]
    }
    assert blocks == {
        "resnet10": [(BasicBlock, 1)] * 4,
        "resnet34": [(BasicBlock, 3), (BasicBlock, 4), (BasicBlock, 6), (BasicBlock, 3)],
        "resnet101": [(Bottleneck, 3), (Bottleneck, 4), (Bottleneck, 23), (Bottleneck, 3)],
    }


@pytest.mark.parametrize("stem", ["small", "imagenet"])
def test_large_volume(stem):
    net = resnet_tiny(3, num_classes=NUM_CLASSES, stem=stem).eval()
    with torch.no_grad():
        assert net(make_input(3, 64, batch=1)).shape == (1, NUM_CLASSES)


def test_anisotropic_kernel():
    net = resnet_tiny(3, num_classes=NUM_CLASSES, kernel_size=(1, 3, 3), stem="imagenet")
    assert net.conv1.kernel_size == (1, 7, 7) and net.conv1.padding == (0, 3, 3)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv3d) and m is not net.conv1]
    assert {m.kernel_size for m in convs} == {(1, 3, 3), (1, 1, 1)}  # block convs and the 1x1 shortcut
    assert_trains(net, make_input(3, (4, 12, 12)))


def test_width_mult():
    base = resnet_tiny(2, num_classes=NUM_CLASSES)
    double = resnet_tiny(2, num_classes=NUM_CLASSES, width_mult=2.0)
    assert (base.num_features, double.num_features) == (16, 32)
    assert num_parameters(double) > 3 * num_parameters(base)
    assert _tiny_bottleneck(2, in_channels=1, num_classes=NUM_CLASSES).num_features == 8 * 4


def _torchvision_keys_and_shapes(net: nn.Module) -> list[tuple[str, torch.Size]]:
    return [(k, v.shape) for k, v in net.state_dict().items()]


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_same_structure_as_torchvision(name):
    import torchvision

    with torch.device("meta"):  # shapes only: skip allocating and initialising the weights
        theirs = _torchvision_keys_and_shapes(getattr(torchvision.models, name)())
        builder = {"resnet18": resnet18, "resnet50": resnet50}[name]
        ours = _torchvision_keys_and_shapes(builder(2, in_channels=3, num_classes=1000, stem="imagenet"))
        small = _torchvision_keys_and_shapes(builder(2, in_channels=3, num_classes=1000, stem="small"))
    assert ours == theirs  # names, order and shapes, buffers included
    differences = [(a, b) for a, b in zip(small, theirs, strict=True) if a != b]
    assert differences == [(("conv1.weight", torch.Size([64, 3, 3, 3])), ("conv1.weight", torch.Size([64, 3, 7, 7])))]


def test_loads_torchvision_resnet18_weights():
    import torchvision

    torch.manual_seed(0)
    theirs = torchvision.models.resnet18().eval()
    ours = resnet18(2, in_channels=3, num_classes=1000, stem="imagenet").eval()
    ours.load_state_dict(theirs.state_dict())  # strict
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("builder", [resnet_tiny, _tiny_bottleneck])
def test_zero_init_residual(builder):
    net = builder(2, in_channels=1, num_classes=NUM_CLASSES)
    blocks = [m for m in net.modules() if isinstance(m, BasicBlock | Bottleneck)]
    last_norms = [b.bn2 if isinstance(b, BasicBlock) else b.bn3 for b in blocks]
    assert blocks and all(torch.all(n.weight == 0) for n in last_norms)
    assert torch.all(net.bn1.weight == 1)
    plain = builder(2, in_channels=1, num_classes=NUM_CLASSES, zero_init_residual=False)
    assert all(torch.all(b.bn2.weight == 1) for b in plain.modules() if isinstance(b, BasicBlock | Bottleneck))
    builder(2, in_channels=1, num_classes=NUM_CLASSES, norm="none")  # nothing to zero, must not fail


def test_residual_block_starts_as_identity_map():
    block = BasicBlock(3, 8, 8, norm="batch")
    block.zero_init_last()
    x = torch.randn(2, 8, 4, 4, 4).relu()
    torch.testing.assert_close(block.eval()(x), x)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"spatial_dims": 4}, "spatial_dims must be one of"),
        ({"norm": "weight"}, "norm must be one of"),
        ({"act": "swish"}, "act must be one of"),
        ({"kernel_size": (3, 3)}, "kernel_size"),
        ({"kernel_size": 4}, "odd"),
        ({"num_classes": 0}, "num_classes"),
        ({"in_channels": 0}, "in_channels"),
        ({"width_mult": -1.0}, "width_mult"),
        ({"stem": "cifar"}, "stem must be one of"),
        ({"block": "wide"}, "block must be one of"),
        ({"widths": (8,)}, "same length"),
        ({"layers": (1, 1, 1, 1, 1), "widths": (8,) * 5}, "1 to 4 stages"),
        ({"dropout": -0.1}, "dropout"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    arguments = {"spatial_dims": 3, "in_channels": 1, "num_classes": NUM_CLASSES, "layers": (1, 1), **kwargs}
    arguments.setdefault("widths", (8, 16))
    with pytest.raises(ValueError, match=message):
        ResNet(**arguments)


@pytest.mark.parametrize(("spatial_dims", "stem"), [(2, "small"), (3, "imagenet")])
def test_torchscript_and_trace(spatial_dims, stem):
    net = resnet_tiny(spatial_dims, num_classes=NUM_CLASSES, stem=stem).eval()
    example, other = make_input(spatial_dims, 9), make_input(spatial_dims, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated but still what many deploy
        scripted = torch.jit.script(net)
        traced = torch.jit.trace(net, example)
    for x in (example, other):  # the traced graph holds for other (smaller) sizes, nothing shape-specific is baked in
        torch.testing.assert_close(scripted(x), net(x))
        torch.testing.assert_close(traced(x), net(x))
