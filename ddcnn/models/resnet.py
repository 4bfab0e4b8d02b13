"""Residual networks for 2D images and 3D volumes.

He, Zhang, Ren & Sun, "Deep Residual Learning for Image Recognition", 2015, https://arxiv.org/abs/1512.03385.

Module and parameter names follow torchvision (``conv1``, ``bn1``, ``layer1.0.conv1``, ``downsample.0``, ``fc``),
and the bottleneck puts its stride on the 3x3 conv as torchvision does ("ResNet v1.5"). So a 2D
``resnet18(in_channels=3, num_classes=1000, stem="imagenet")`` (and the other standard depths) loads a torchvision
state dict as it is. The norm layers keep the ``bn`` names whatever ``norm`` is, for the same reason.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ddcnn.models import layers as _layers

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "resnet10",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet_tiny",
]

STEMS = ("small", "imagenet")
# Up to four stages as in the paper; forward_features names them explicitly so the model stays scriptable with
# torchvision's ``layer1``..``layer4`` names (TorchScript cannot look attributes up by a computed name).
MAX_STAGES = 4


def _downsample(spatial_dims: int, in_channels: int, out_channels: int, stride: int, norm: str) -> nn.Module:
    """Projection shortcut (1x1 conv + norm) when the stride or the channels change the shape, else the identity."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    conv = _layers.conv_nd(spatial_dims)
    return nn.Sequential(
        conv(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
        _layers.norm_nd(norm, spatial_dims, out_channels),
    )


class BasicBlock(nn.Module):
    """Two kxk convs with a residual connection (ResNet-18/34).

    Args:
        spatial_dims: Number of spatial axes.
        in_channels: Input channels.
        channels: Channels of the convs; the block outputs ``channels * expansion``.
        stride: Stride of the first conv (2 to halve every axis; an axis of size 1 stays 1).
        norm: Normalisation name, see :func:`ddcnn.models.layers.norm_nd`.
        act: Activation name, see :func:`ddcnn.models.layers.act`.
        kernel_size: Odd kernel size, an int or one per axis.
    """

    expansion = 1

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        channels: int,
        stride: int = 1,
        norm: str = "batch",
        act: str = "relu",
        kernel_size: int | Sequence[int] = 3,
    ) -> None:
        super().__init__()
        conv = _layers.conv_nd(spatial_dims)
        kernel = _layers.as_tuple(kernel_size, spatial_dims, "kernel_size")
        padding = _layers.same_padding(kernel)
        out_channels = channels * self.expansion
        self.conv1 = conv(in_channels, channels, kernel, stride=stride, padding=padding, bias=False)
        self.bn1 = _layers.norm_nd(norm, spatial_dims, channels)
        self.act1 = _layers.act(act)
        self.conv2 = conv(channels, out_channels, kernel, padding=padding, bias=False)
        self.bn2 = _layers.norm_nd(norm, spatial_dims, out_channels)
        self.act2 = _layers.act(act)
        self.downsample = _downsample(spatial_dims, in_channels, out_channels, stride, norm)

    def zero_init_last(self) -> None:
        """Zero the last norm's scale so the block starts as the identity (Goyal et al., arXiv 1706.02677)."""
        if getattr(self.bn2, "weight", None) is not None:
            nn.init.zeros_(self.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``(B, in_channels, *spatial)``."""
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act2(out + self.downsample(x))


class Bottleneck(nn.Module):
    """1x1 reduce, kxk, 1x1 expand (x4) convs with a residual connection (ResNet-50/101).

    Args:
        spatial_dims: Number of spatial axes.
        in_channels: Input channels.
        channels: Channels of the inner convs; the block outputs ``channels * expansion``.
        stride: Stride of the kxk conv (where torchvision puts it).
        norm: Normalisation name, see :func:`ddcnn.models.layers.norm_nd`.
        act: Activation name, see :func:`ddcnn.models.layers.act`.
        kernel_size: Odd kernel size of the middle conv, an int or one per axis.
    """

    expansion = 4

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        channels: int,
        stride: int = 1,
        norm: str = "batch",
        act: str = "relu",
        kernel_size: int | Sequence[int] = 3,
    ) -> None:
        super().__init__()
        conv = _layers.conv_nd(spatial_dims)
        kernel = _layers.as_tuple(kernel_size, spatial_dims, "kernel_size")
        padding = _layers.same_padding(kernel)
        out_channels = channels * self.expansion
        self.conv1 = conv(in_channels, channels, kernel_size=1, bias=False)
        self.bn1 = _layers.norm_nd(norm, spatial_dims, channels)
        self.act1 = _layers.act(act)
        self.conv2 = conv(channels, channels, kernel, stride=stride, padding=padding, bias=False)
        self.bn2 = _layers.norm_nd(norm, spatial_dims, channels)
        self.act2 = _layers.act(act)
        self.conv3 = conv(channels, out_channels, kernel_size=1, bias=False)
        self.bn3 = _layers.norm_nd(norm, spatial_dims, out_channels)
        self.act3 = _layers.act(act)
        self.downsample = _downsample(spatial_dims, in_channels, out_channels, stride, norm)

    def zero_init_last(self) -> None:
        """Zero the last norm's scale so the block starts as the identity (Goyal et al., arXiv 1706.02677)."""
        if getattr(self.bn3, "weight", None) is not None:
            nn.init.zeros_(self.bn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``(B, in_channels, *spatial)``."""
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.act2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.act3(out + self.downsample(x))


BLOCKS: dict[str, type[BasicBlock] | type[Bottleneck]] = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(nn.Module):
    """ResNet backbone for any ``spatial_dims``, input size and class count.

    Stages after the first halve every axis with a stride-2 conv (padding ``k // 2``), which maps a size-1 axis to
    size 1, so any input size passes, however small or anisotropic (a 5x5 image, a 9x9x4 volume). No per-shape
    Python logic is involved, so ``torch.jit.script`` and ``torch.jit.trace`` both work.

    Args:
        spatial_dims: Number of spatial axes, 2 for images, 3 for volumes.
        in_channels: Input channels.
        num_classes: Output logits.
        block: ``"basic"`` (two kxk convs) or ``"bottleneck"`` (1x1, kxk, 1x1 with 4x expansion).
        layers: Blocks per stage, one to four stages.
        widths: Block width per stage (before expansion and ``width_mult``); the stem has the first width.
        stem: ``"small"``: one kxk conv with stride 1 and no max pool, for small inputs (the CIFAR variant of the
            paper). ``"imagenet"``: a 7x7 stride-2 conv and a 3x3 stride-2 max pool (the conv is 1 wide along axes
            where ``kernel_size`` is 1).
        norm: ``"batch"``, ``"instance"``, ``"group"``, ``"layer"`` or ``"none"``. Instance norm needs more than one
            spatial position at every stage, see :func:`ddcnn.models.layers.norm_nd`.
        act: ``"relu"``, ``"gelu"``, ``"silu"``, ``"leaky_relu"`` or ``"tanh"``.
        width_mult: Multiplier for every width.
        kernel_size: Odd kernel size of the block convs and small stem, an int or one per axis (e.g. ``(1, 3, 3)``).
        zero_init_residual: Start every residual branch at zero (each block's ``zero_init_last``), which helps
            training (Goyal et al., arXiv 1706.02677); has no effect with ``norm="none"``.
        dropout: Dropout probability before the final linear layer.

    Attributes:
        num_features: Channels of the pooled features returned by :meth:`forward_features`.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        num_classes: int,
        block: str = "basic",
        layers: Sequence[int] = (2, 2, 2, 2),
        widths: Sequence[int] = (64, 128, 256, 512),
        stem: str = "small",
        norm: str = "batch",
        act: str = "relu",
        width_mult: float = 1.0,
        kernel_size: int | Sequence[int] = 3,
        zero_init_residual: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if block not in BLOCKS:
            raise ValueError(f"block must be one of {tuple(BLOCKS)}, got {block!r}.")
        if stem not in STEMS:
            raise ValueError(f"stem must be one of {STEMS}, got {stem!r}.")
        if not 1 <= len(layers) <= MAX_STAGES or len(layers) != len(widths):
            raise ValueError(
                f"layers and widths must have the same length, 1 to {MAX_STAGES} stages; "
                f"got layers={tuple(layers)}, widths={tuple(widths)}."
            )
        if any(n < 1 for n in layers) or any(w < 1 for w in widths):
            raise ValueError(f"layers and widths must be positive, got layers={layers}, widths={widths}.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}.")
        _layers.check_positive(in_channels=in_channels, num_classes=num_classes)
        norm = _layers.check_norm(norm)
        act = _layers.check_act(act)
        kernel = _layers.as_tuple(kernel_size, spatial_dims, "kernel_size")
        block_cls = BLOCKS[block]
        stage_widths = [_layers.scale_width(w, width_mult) for w in widths]

        conv = _layers.conv_nd(spatial_dims)
        stem_channels = stage_widths[0]
        if stem == "imagenet":
            stem_kernel = tuple(7 if k > 1 else 1 for k in kernel)
            self.conv1 = conv(
                in_channels, stem_channels, stem_kernel, stride=2, padding=_layers.same_padding(stem_kernel), bias=False
            )
            self.maxpool: nn.Module = _layers.pool_nd("max", spatial_dims)(kernel_size=3, stride=2, padding=1)
        else:
            self.conv1 = conv(in_channels, stem_channels, kernel, padding=_layers.same_padding(kernel), bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = _layers.norm_nd(norm, spatial_dims, stem_channels)
        self.act = _layers.act(act)

        channels = stem_channels
        for index in range(MAX_STAGES):
            if index < len(layers):
                blocks: list[nn.Module] = []
                for block_index in range(layers[index]):
                    stride = 2 if index > 0 and block_index == 0 else 1
                    blocks.append(
                        block_cls(spatial_dims, channels, stage_widths[index], stride, norm, act, kernel_size=kernel)
                    )
                    channels = stage_widths[index] * block_cls.expansion
                stage: nn.Module = nn.Sequential(*blocks)
            else:
                stage = nn.Identity()
            self.add_module(f"layer{index + 1}", stage)

        self.avgpool = _layers.adaptive_avg_pool_nd(spatial_dims)(1)
        self.num_features = channels
        self.head_drop = nn.Dropout(dropout)
        self.fc = nn.Linear(channels, num_classes)

        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.num_classes = num_classes
        _layers.init_conv_weights(self)
        if zero_init_residual:
            for module in self.modules():
                if hasattr(module, "zero_init_last"):
                    module.zero_init_last()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Return globally pooled features of shape ``(B, num_features)`` for input ``(B, C, *spatial)``."""
        x = self.maxpool(self.act(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        return torch.flatten(self.avgpool(x), 1)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Map pooled features ``(B, num_features)`` to logits ``(B, num_classes)``."""
        return self.fc(self.head_drop(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits ``(B, num_classes)`` for input ``(B, in_channels, *spatial)``."""
        return self.forward_head(self.forward_features(x))


def _build(
    spatial_dims: int, in_channels: int, num_classes: int, block: str, layers: Sequence[int], **kwargs
) -> ResNet:
    return ResNet(spatial_dims, in_channels, num_classes, block=block, layers=layers, **kwargs)


def resnet10(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> ResNet:
    """ResNet-10: basic blocks (1, 1, 1, 1). ``kwargs`` go to :class:`ResNet`."""
    return _build(spatial_dims, in_channels, num_classes, "basic", (1, 1, 1, 1), **kwargs)


def resnet18(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> ResNet:
    """ResNet-18: basic blocks (2, 2, 2, 2). ``kwargs`` go to :class:`ResNet`."""
    return _build(spatial_dims, in_channels, num_classes, "basic", (2, 2, 2, 2), **kwargs)


def resnet34(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> ResNet:
    """ResNet-34: basic blocks (3, 4, 6, 3). ``kwargs`` go to :class:`ResNet`."""
    return _build(spatial_dims, in_channels, num_classes, "basic", (3, 4, 6, 3), **kwargs)


def resnet50(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> ResNet:
    """ResNet-50: bottleneck blocks (3, 4, 6, 3). ``kwargs`` go to :class:`ResNet`."""
    return _build(spatial_dims, in_channels, num_classes, "bottleneck", (3, 4, 6, 3), **kwargs)


def resnet101(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> ResNet:
    """ResNet-101: bottleneck blocks (3, 4, 23, 3). ``kwargs`` go to :class:`ResNet`."""
    return _build(spatial_dims, in_channels, num_classes, "bottleneck", (3, 4, 23, 3), **kwargs)


def resnet_tiny(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> ResNet:
    """Tiny ResNet for tests: basic blocks (1, 1), widths (8, 16). ``kwargs`` go to :class:`ResNet`."""
    kwargs.setdefault("widths", (8, 16))
    return _build(spatial_dims, in_channels, num_classes, "basic", (1, 1), **kwargs)
