"""Dimension-generic layer lookups shared by the backbones.

Every backbone resolves its layer types here once, from its ``spatial_dims`` argument, so that one class serves
2D images and 3D volumes (the pattern MONAI uses, instead of a copied ``ResNet3d`` beside a ``ResNet2d``). Each
lookup raises a ``ValueError`` that names the supported values.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = [
    "ACTIVATIONS",
    "NORMS",
    "POOLS",
    "SPATIAL_DIMS",
    "act",
    "adaptive_avg_pool_nd",
    "as_tuple",
    "check_act",
    "check_positive",
    "check_norm",
    "conv_like",
    "conv_nd",
    "group_count",
    "init_conv_weights",
    "norm_nd",
    "pool_nd",
    "same_padding",
    "scale_width",
]

SPATIAL_DIMS = (1, 2, 3)
NORMS = ("batch", "instance", "group", "layer", "none")
POOLS = ("max", "avg")
ACTIVATIONS = ("relu", "gelu", "silu", "leaky_relu", "tanh")

_CONV: dict[int, type[nn.Module]] = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_BATCH_NORM: dict[int, type[nn.Module]] = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_INSTANCE_NORM: dict[int, type[nn.Module]] = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
_MAX_POOL: dict[int, type[nn.Module]] = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}
_AVG_POOL: dict[int, type[nn.Module]] = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}
_ADAPTIVE_AVG_POOL: dict[int, type[nn.Module]] = {
    1: nn.AdaptiveAvgPool1d,
    2: nn.AdaptiveAvgPool2d,
    3: nn.AdaptiveAvgPool3d,
}
_ACT: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "leaky_relu": nn.LeakyReLU,
    "tanh": nn.Tanh,
}

# Largest number of groups for ``norm="group"``; 8 rather than the usual 32 because our widths are often small.
_MAX_GROUPS = 8


def _check_spatial_dims(spatial_dims: int) -> int:
    # bool is an int subclass; True must not silently mean 1D.
    if isinstance(spatial_dims, bool) or spatial_dims not in SPATIAL_DIMS:
        raise ValueError(f"spatial_dims must be one of {SPATIAL_DIMS}, got {spatial_dims!r}.")
    return int(spatial_dims)


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> str:
    """Return ``value`` in lower case if it is one of ``choices``; else raise a ``ValueError`` that lists them."""
    key = value.lower() if isinstance(value, str) else value
    if key not in choices:
        raise ValueError(f"{what} must be one of {choices}, got {value!r}.")
    return key


def conv_nd(spatial_dims: int) -> type[nn.Module]:
    """Return the convolution class for ``spatial_dims``.

    Args:
        spatial_dims: Number of spatial axes: 1, 2 or 3.

    Returns:
        ``nn.Conv1d``, ``nn.Conv2d`` or ``nn.Conv3d``.

    Raises:
        ValueError: If ``spatial_dims`` is not 1, 2 or 3.
    """
    return _CONV[_check_spatial_dims(spatial_dims)]


def conv_like(conv: nn.Module, in_channels: int, out_channels: int) -> nn.Module:
    """A new convolution of ``conv``'s class and settings with other channel counts, initialised as PyTorch does.

    Kernel size, stride, padding, dilation, groups, bias, padding mode, device and dtype are those of ``conv``.

    Args:
        conv: The convolution to copy the settings of (``nn.Conv1d``, ``nn.Conv2d`` or ``nn.Conv3d``).
        in_channels: Input channels of the new convolution.
        out_channels: Output channels of the new convolution.
    """
    return type(conv)(
        in_channels,
        out_channels,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        bias=conv.bias is not None,
        padding_mode=conv.padding_mode,
        device=conv.weight.device,
        dtype=conv.weight.dtype,
    )


def group_count(num_channels: int, max_groups: int = _MAX_GROUPS) -> int:
    """Return the largest number of groups that divides ``num_channels`` and is at most ``max_groups``.

    Args:
        num_channels: Channels to split into groups.
        max_groups: Upper bound on the number of groups.

    Returns:
        The group count used by ``norm_nd("group", ...)``.
    """
    if num_channels < 1:
        raise ValueError(f"num_channels must be positive, got {num_channels}.")
    for groups in range(min(max_groups, num_channels), 0, -1):
        if num_channels % groups == 0:
            return groups
    return 1  # unreachable: 1 divides everything


def norm_nd(norm: str, spatial_dims: int, num_features: int) -> nn.Module:
    """Create a fresh normalisation layer.

    ``"group"`` uses the largest group count that divides ``num_features`` and is at most 8; ``"layer"`` is
    ``GroupNorm(1, C)``, which normalises over channels and all spatial positions of one sample (the usual meaning
    of layer norm for feature maps). ``"instance"`` is affine, without running statistics.

    Instance norm normalises each channel of each sample over its spatial positions alone, so it needs more than
    one: PyTorch raises a ``ValueError`` for a 1x1 feature map (in training and evaluation, as there are no running
    statistics). Group norm with one channel per group (``num_features <= 8`` or prime widths) does the same
    silently, its output on a 1x1 map being its bias whatever the input. Batch norm (with a batch of 2 or more in
    training), layer norm and group norm with several channels per group work at any spatial size.

    Args:
        norm: One of ``"batch"``, ``"instance"``, ``"group"``, ``"layer"``, ``"none"`` (case-insensitive).
        spatial_dims: Number of spatial axes: 1, 2 or 3.
        num_features: Number of channels to normalise.

    Returns:
        A new module; ``nn.Identity`` for ``"none"``.

    Raises:
        ValueError: If ``norm`` or ``spatial_dims`` is not supported.
    """
    spatial_dims = _check_spatial_dims(spatial_dims)
    key = check_norm(norm)
    if key == "batch":
        return _BATCH_NORM[spatial_dims](num_features)
    if key == "instance":
        return _INSTANCE_NORM[spatial_dims](num_features, affine=True)
    if key == "group":
        return nn.GroupNorm(group_count(num_features), num_features)
    if key == "layer":
        return nn.GroupNorm(1, num_features)
    return nn.Identity()


def check_norm(norm: str) -> str:
    """Validate a norm name early (before any layer is built) and return it in lower case.

    Args:
        norm: Norm name, see :func:`norm_nd`.

    Returns:
        The lower-case name.

    Raises:
        ValueError: If ``norm`` is not supported.
    """
    return _check_choice(norm, NORMS, "norm")


def pool_nd(kind: str, spatial_dims: int) -> type[nn.Module]:
    """Return the pooling class for ``kind`` and ``spatial_dims``.

    Args:
        kind: ``"max"`` or ``"avg"``.
        spatial_dims: Number of spatial axes: 1, 2 or 3.

    Returns:
        ``nn.MaxPoolNd`` or ``nn.AvgPoolNd``.

    Raises:
        ValueError: If ``kind`` or ``spatial_dims`` is not supported.
    """
    spatial_dims = _check_spatial_dims(spatial_dims)
    if kind == "max":
        return _MAX_POOL[spatial_dims]
    if kind == "avg":
        return _AVG_POOL[spatial_dims]
    raise ValueError(f"pool kind must be one of {POOLS}, got {kind!r}.")


def adaptive_avg_pool_nd(spatial_dims: int) -> type[nn.Module]:
    """Return the adaptive average pooling class for ``spatial_dims``.

    Args:
        spatial_dims: Number of spatial axes: 1, 2 or 3.

    Returns:
        ``nn.AdaptiveAvgPool1d``, ``nn.AdaptiveAvgPool2d`` or ``nn.AdaptiveAvgPool3d``.

    Raises:
        ValueError: If ``spatial_dims`` is not 1, 2 or 3.
    """
    return _ADAPTIVE_AVG_POOL[_check_spatial_dims(spatial_dims)]


def act(name: str) -> nn.Module:
    """Create a fresh activation module.

    Args:
        name: One of ``"relu"``, ``"gelu"``, ``"silu"``, ``"leaky_relu"``, ``"tanh"`` (case-insensitive).

    Returns:
        A new, not in-place, activation module.

    Raises:
        ValueError: If ``name`` is not supported.
    """
    return _ACT[check_act(name)]()


def check_act(name: str) -> str:
    """Validate an activation name early and return it in lower case.

    Args:
        name: Activation name, see :func:`act`.

    Returns:
        The lower-case name.

    Raises:
        ValueError: If ``name`` is not supported.
    """
    return _check_choice(name, ACTIVATIONS, "act")


def as_tuple(value: int | Sequence[int], spatial_dims: int, name: str = "value") -> tuple[int, ...]:
    """Expand an int, or check a per-axis sequence, into a tuple of ``spatial_dims`` positive ints.

    Used for kernel sizes, strides and overlaps, which may be anisotropic (e.g. ``(1, 3, 3)`` for CT volumes with
    thick slices).

    Args:
        value: One int for every axis, or one int per axis.
        spatial_dims: Number of spatial axes: 1, 2 or 3.
        name: Argument name used in error messages.

    Returns:
        A tuple of length ``spatial_dims``.

    Raises:
        ValueError: If ``value`` has the wrong length, is not made of ints, or has a non-positive entry.
    """
    spatial_dims = _check_spatial_dims(spatial_dims)
    if isinstance(value, int) and not isinstance(value, bool):
        values: tuple[int, ...] = (value,) * spatial_dims
    elif isinstance(value, Sequence) and not isinstance(value, str):
        values = tuple(value)
        if len(values) != spatial_dims:
            raise ValueError(
                f"{name} must be an int or a sequence of {spatial_dims} ints (one per spatial axis), "
                f"got {value!r} of length {len(values)}."
            )
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{name} must contain ints, got {value!r}.")
    else:
        raise ValueError(f"{name} must be an int or a sequence of {spatial_dims} ints, got {value!r}.")
    if any(v < 1 for v in values):
        raise ValueError(f"{name} entries must be positive, got {value!r}.")
    return values


def same_padding(kernel_size: Sequence[int], name: str = "kernel_size") -> tuple[int, ...]:
    """Padding that keeps the spatial size of a stride-1 convolution, for odd kernel sizes.

    Args:
        kernel_size: Per-axis kernel size.
        name: Argument name used in error messages.

    Returns:
        ``k // 2`` per axis.

    Raises:
        ValueError: If a kernel size is even (no symmetric padding keeps the size).
    """
    if any(k % 2 == 0 for k in kernel_size):
        raise ValueError(f"{name} must be odd along every axis so that padding keeps the size, got {kernel_size}.")
    return tuple(k // 2 for k in kernel_size)


def scale_width(width: int, width_mult: float) -> int:
    """Scale a channel width by ``width_mult``, rounding and keeping at least one channel.

    Args:
        width: Base channel width.
        width_mult: Multiplier, must be positive.

    Returns:
        ``max(1, round(width * width_mult))``.

    Raises:
        ValueError: If ``width_mult`` is not positive.
    """
    if not width_mult > 0:
        raise ValueError(f"width_mult must be positive, got {width_mult!r}.")
    return max(1, int(round(width * width_mult)))


def check_positive(**values: int) -> None:
    """Raise a ``ValueError`` naming the first argument that is not a positive int.

    Args:
        **values: Argument names and values, e.g. ``in_channels=1, num_classes=5``.

    Raises:
        ValueError: If a value is not a positive int.
    """
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")


def init_conv_weights(model: nn.Module) -> None:
    """Kaiming-normal (fan-out) init for every conv of ``model``, zero conv biases.

    As torchvision does for VGG and ResNet (He et al., https://arxiv.org/abs/1502.01852). Norm layers already start
    as the identity map (weight 1, bias 0) and linear layers keep PyTorch's default init.

    Args:
        model: Module whose convolutions are initialised in place.
    """
    for module in model.modules():
        if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
