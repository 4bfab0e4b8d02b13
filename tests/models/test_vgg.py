"""Tests for the dimension-generic VGG."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ddcnn.models import VGG, vgg11, vgg13, vgg16, vgg19, vgg_small, vgg_tiny
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


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("builder", [vgg_tiny, vgg_small])
@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_forward_backward(spatial_dims, builder, norm):
    net = builder(spatial_dims, in_channels=2, num_classes=NUM_CLASSES, norm=norm)
    x = make_input(spatial_dims, 16 if spatial_dims == 2 else 8, channels=2)
    assert_backbone(net, x)


@pytest.mark.parametrize("norm", ["batch", "instance", "group", "layer"])
@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_norm_is_threaded_everywhere(spatial_dims, norm):
    net = vgg_small(spatial_dims, num_classes=NUM_CLASSES, norm=norm)
    norms, expected = norm_layers(net, spatial_dims, norm)
    assert len(norms) == 4  # one per conv
    assert all(type(m) is expected for m in norms)
    if norm == "layer":
        assert all(m.num_groups == 1 for m in norms)
    if norm == "group":
        assert all(m.num_groups == 8 for m in norms)
    assert len({id(m) for m in norms}) == len(norms)  # a fresh norm per use


def test_norm_none_has_no_norm_layers():
    net = vgg_small(3, norm="none")
    assert not [m for m in net.modules() if isinstance(m, ALL_NORM_TYPES)]


@pytest.mark.parametrize("act", ["gelu", "silu", "leaky_relu", "tanh"])
def test_act_is_threaded_everywhere(act):
    net = vgg_small(2, num_classes=NUM_CLASSES, act=act)
    assert not [m for m in net.modules() if isinstance(m, nn.ReLU)]
    assert_trains(net, make_input(2, 8))


@pytest.mark.parametrize("builder", [vgg11, vgg13, vgg16, vgg19, vgg_small, vgg_tiny])
@pytest.mark.parametrize(("spatial_dims", "size"), [(2, (5, 5)), (2, (1, 7)), (3, (9, 9, 4)), (3, (5, 3, 1))])
def test_small_and_anisotropic_inputs(builder, spatial_dims, size):
    # Width does not change how sizes shrink; 1/8 width keeps the deep 3D variants fast.
    net = builder(spatial_dims, in_channels=1, num_classes=NUM_CLASSES, width_mult=0.125)
    net.train()  # batch norm in training mode needs >1 value per channel: batch 2 at 1x1 is the edge case
    assert net(make_input(spatial_dims, size)).shape == (2, NUM_CLASSES)


@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_standard_depths(spatial_dims):
    convs = {
        builder.__name__: sum(
            isinstance(m, nn.Conv2d | nn.Conv3d) for m in builder(spatial_dims, width_mult=0.125).modules()
        )
        for builder in (vgg11, vgg13, vgg16, vgg19)
    }
    assert convs == {"vgg11": 8, "vgg13": 10, "vgg16": 13, "vgg19": 16}


def test_large_volume():
    net = vgg_tiny(3, num_classes=NUM_CLASSES).eval()
    with torch.no_grad():
        assert net(make_input(3, 64, batch=1)).shape == (1, NUM_CLASSES)


def test_anisotropic_kernel():
    net = vgg_tiny(3, num_classes=NUM_CLASSES, kernel_size=(1, 3, 3))
    convs = [m for m in net.modules() if isinstance(m, nn.Conv3d)]
    assert all(m.kernel_size == (1, 3, 3) and m.padding == (0, 1, 1) for m in convs)
    assert_trains(net, make_input(3, (4, 12, 12)))


def test_width_mult_and_hidden():
    base = vgg_small(2, num_classes=NUM_CLASSES)
    half = vgg_small(2, num_classes=NUM_CLASSES, width_mult=0.5)
    assert base.num_features == 128 and half.num_features == 64
    assert num_parameters(half) < num_parameters(base) / 3
    assert half.head[0].out_features == 64  # hidden width scales too
    linear = vgg_small(2, num_classes=NUM_CLASSES, hidden=None)
    assert [type(m) for m in linear.head] == [nn.Dropout, nn.Linear]
    assert num_parameters(linear) < num_parameters(base)


def test_head_is_small_for_standard_vgg():
    net = vgg16(2, in_channels=1, num_classes=NUM_CLASSES)
    head = sum(p.numel() for p in net.head.parameters())
    assert head == 512 * 256 + 256 + 256 * NUM_CLASSES + NUM_CLASSES


def test_features_match_torchvision_vgg16_bn():
    from torchvision.models.vgg import cfgs, make_layers

    with torch.device("meta"):  # shapes only: skip allocating and initialising 15M weights twice
        ours = vgg16(2, in_channels=3).features.state_dict()
        theirs = make_layers(cfgs["D"], batch_norm=True).state_dict()
    assert [(k, v.shape) for k, v in ours.items()] == [(k, v.shape) for k, v in theirs.items()]


def test_dropout_only_in_training():
    net = vgg_tiny(2, num_classes=NUM_CLASSES, dropout=0.5).eval()
    x = make_input(2, 8)
    assert torch.equal(net(x), net(x))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"spatial_dims": 4}, "spatial_dims must be one of"),
        ({"norm": "weight"}, "norm must be one of"),
        ({"act": "swish"}, "act must be one of"),
        ({"kernel_size": (3, 3)}, "kernel_size"),
        ({"kernel_size": 2}, "odd"),
        ({"num_classes": 0}, "num_classes"),
        ({"in_channels": 0}, "in_channels"),
        ({"width_mult": 0.0}, "width_mult"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    arguments = {"spatial_dims": 3, "in_channels": 1, "num_classes": NUM_CLASSES, **kwargs}
    with pytest.raises(ValueError, match=message):
        vgg_tiny(**arguments)


def test_bad_stages_raise():
    with pytest.raises(ValueError, match="stages"):
        VGG(2, 1, NUM_CLASSES, stages=[])
    with pytest.raises(ValueError, match="stage 1"):
        VGG(2, 1, NUM_CLASSES, stages=[(1, 8), (0, 8)])


@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_torchscript_and_trace(spatial_dims):
    net = vgg_tiny(spatial_dims, num_classes=NUM_CLASSES).eval()
    example, other = make_input(spatial_dims, 9), make_input(spatial_dims, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated but still what many deploy
        scripted = torch.jit.script(net)
        traced = torch.jit.trace(net, example)
    for x in (example, other):  # the traced graph holds for other (smaller) sizes, nothing shape-specific is baked in
        torch.testing.assert_close(scripted(x), net(x))
        torch.testing.assert_close(traced(x), net(x))
