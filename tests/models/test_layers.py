"""Tests for the dimension-generic layer lookups."""

from __future__ import annotations

import pytest
from torch import nn

from ddcnn.models import layers


@pytest.mark.parametrize(
    ("spatial_dims", "conv", "max_pool", "avg_pool", "adaptive"),
    [
        (1, nn.Conv1d, nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d),
        (2, nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d),
        (3, nn.Conv3d, nn.MaxPool3d, nn.AvgPool3d, nn.AdaptiveAvgPool3d),
    ],
)
def test_lookups_return_the_class_for_each_dimension(spatial_dims, conv, max_pool, avg_pool, adaptive):
    assert layers.conv_nd(spatial_dims) is conv
    assert layers.pool_nd("max", spatial_dims) is max_pool
    assert layers.pool_nd("avg", spatial_dims) is avg_pool
    assert layers.adaptive_avg_pool_nd(spatial_dims) is adaptive


@pytest.mark.parametrize("spatial_dims", [0, 4, True, "2"])
@pytest.mark.parametrize(
    "lookup",
    [
        layers.conv_nd,
        layers.adaptive_avg_pool_nd,
        lambda d: layers.pool_nd("max", d),
        lambda d: layers.norm_nd("batch", d, 8),
        lambda d: layers.as_tuple(3, d),
    ],
)
def test_unsupported_spatial_dims_raise(lookup, spatial_dims):
    with pytest.raises(ValueError, match=r"spatial_dims must be one of \(1, 2, 3\)"):
        lookup(spatial_dims)


def test_unknown_pool_kind_raises():
    with pytest.raises(ValueError, match="'max', 'avg'"):
        layers.pool_nd("min", 2)


@pytest.mark.parametrize(
    ("norm", "spatial_dims", "expected"),
    [
        ("batch", 2, nn.BatchNorm2d),
        ("batch", 3, nn.BatchNorm3d),
        ("instance", 2, nn.InstanceNorm2d),
        ("instance", 3, nn.InstanceNorm3d),
        ("group", 3, nn.GroupNorm),
        ("layer", 2, nn.GroupNorm),
        ("none", 3, nn.Identity),
        ("BATCH", 2, nn.BatchNorm2d),
    ],
)
def test_norm_nd_types(norm, spatial_dims, expected):
    module = layers.norm_nd(norm, spatial_dims, 16)
    assert type(module) is expected


def test_norm_nd_returns_fresh_learnable_modules():
    first, second = layers.norm_nd("batch", 2, 4), layers.norm_nd("batch", 2, 4)
    assert first is not second
    assert layers.norm_nd("instance", 3, 4).affine


@pytest.mark.parametrize(("channels", "groups"), [(64, 8), (16, 8), (12, 6), (10, 5), (6, 6), (7, 7), (9, 3), (1, 1)])
def test_group_norm_uses_largest_divisor_up_to_eight(channels, groups):
    module = layers.norm_nd("group", 2, channels)
    assert module.num_groups == groups
    assert channels % module.num_groups == 0


def test_layer_norm_is_one_group():
    assert layers.norm_nd("layer", 3, 12).num_groups == 1


def test_unknown_norm_lists_supported():
    with pytest.raises(ValueError, match="norm must be one of .*'batch'.*got 'weight'"):
        layers.norm_nd("weight", 2, 4)
    with pytest.raises(ValueError, match="norm must be one of"):
        layers.check_norm("weight")


@pytest.mark.parametrize(
    ("name", "expected"),
    [("relu", nn.ReLU), ("gelu", nn.GELU), ("silu", nn.SiLU), ("leaky_relu", nn.LeakyReLU), ("tanh", nn.Tanh)],
)
def test_act_types(name, expected):
    module = layers.act(name)
    assert type(module) is expected
    assert not getattr(module, "inplace", False)
    assert layers.act(name) is not module


def test_unknown_act_lists_supported():
    with pytest.raises(ValueError, match="act must be one of .*'relu'.*got 'swish'"):
        layers.act("swish")


def test_as_tuple_expands_and_checks():
    assert layers.as_tuple(3, 2) == (3, 3)
    assert layers.as_tuple(3, 3) == (3, 3, 3)
    assert layers.as_tuple((1, 3, 3), 3) == (1, 3, 3)
    assert layers.as_tuple([2, 5], 2) == (2, 5)


@pytest.mark.parametrize("value", [(3, 3), (1, 3, 3, 3), 0, (1, 0, 3), (1.0, 3, 3), "333", True, None])
def test_as_tuple_rejects_bad_values_naming_the_argument(value):
    with pytest.raises(ValueError, match="kernel_size"):
        layers.as_tuple(value, 3, "kernel_size")


def test_same_padding_needs_odd_kernels():
    assert layers.same_padding((1, 3, 5)) == (0, 1, 2)
    with pytest.raises(ValueError, match="odd"):
        layers.same_padding((1, 2, 3))


def test_scale_width():
    assert layers.scale_width(64, 0.5) == 32
    assert layers.scale_width(8, 0.01) == 1
    with pytest.raises(ValueError, match="width_mult"):
        layers.scale_width(8, 0)


def test_check_positive_names_the_argument():
    layers.check_positive(in_channels=1, num_classes=5)
    with pytest.raises(ValueError, match="num_classes"):
        layers.check_positive(in_channels=1, num_classes=0)
