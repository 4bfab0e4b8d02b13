"""VGG networks for 2D images and 3D volumes.

Simonyan & Zisserman, "Very Deep Convolutional Networks for Large-Scale Image Recognition", 2014,
https://arxiv.org/abs/1409.1556.

Unlike torchvision's VGG, the head is global average pooling and a small MLP instead of a 7x7x4096 MLP (about
103M weights in 2D, 719M in 3D), so the network takes inputs of any size. The ``features`` part keeps
torchvision's layout (conv, norm, act per conv, a max pool per stage), so with ``norm="batch"``, ``kernel_size=3``
and ``width_mult=1`` the ``features.*`` parameters of ``vgg11``..``vgg19`` have the same names and shapes as
torchvision's ``vgg*_bn`` (and with ``norm="none"`` as torchvision's ``vgg*``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ddcnn.models import layers

__all__ = ["VGG", "vgg11", "vgg13", "vgg16", "vgg19", "vgg_small", "vgg_tiny"]

# Per-stage (num_convs, width), the configurations A, B, D, E of the paper.
VGG_STAGES: dict[str, tuple[tuple[int, int], ...]] = {
    "vgg11": ((1, 64), (1, 128), (2, 256), (2, 512), (2, 512)),
    "vgg13": ((2, 64), (2, 128), (2, 256), (2, 512), (2, 512)),
    "vgg16": ((2, 64), (2, 128), (3, 256), (3, 512), (3, 512)),
    "vgg19": ((2, 64), (2, 128), (4, 256), (4, 512), (4, 512)),
    "vgg_small": ((1, 32), (1, 64), (2, 128)),
    "vgg_tiny": ((1, 8), (1, 8)),
}


class VGG(nn.Module):
    """VGG backbone with a global-pooling MLP head, for any ``spatial_dims``, input size and class count.

    Each stage is ``num_convs`` x (conv, norm, act) followed by a 2x max pool with ``ceil_mode=True``: an axis of
    size ``n`` becomes ``ceil(n / 2)``, so an axis that is already 1 stays 1 and any input size, however small or
    anisotropic, passes through every stage (a 5x5 image through ``vgg19``, a 9x9x4 volume through ``vgg16``).
    This needs no per-shape Python logic, so ``torch.jit.script`` and ``torch.jit.trace`` both work.

    Args:
        spatial_dims: Number of spatial axes, 2 for images, 3 for volumes.
        in_channels: Input channels.
        num_classes: Output logits.
        stages: Per-stage ``(num_convs, width)``.
        norm: Normalisation after each conv: ``"batch"``, ``"instance"``, ``"group"``, ``"layer"`` or ``"none"``.
            Instance norm needs more than one spatial position at every stage, see
            :func:`ddcnn.models.layers.norm_nd`.
        act: Activation: ``"relu"``, ``"gelu"``, ``"silu"``, ``"leaky_relu"`` or ``"tanh"``.
        width_mult: Multiplier for every stage width and for ``hidden``.
        kernel_size: Conv kernel size, an odd int or one odd int per axis (e.g. ``(1, 3, 3)`` for thick slices).
        hidden: Width of the head's hidden layer before ``width_mult``; ``None`` or 0 for a linear head.
        dropout: Dropout probability in the head.

    Attributes:
        num_features: Channels of the pooled features returned by :meth:`forward_features`.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        num_classes: int,
        stages: Sequence[tuple[int, int]],
        norm: str = "batch",
        act: str = "relu",
        width_mult: float = 1.0,
        kernel_size: int | Sequence[int] = 3,
        hidden: int | None = 256,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        norm = layers.check_norm(norm)
        act = layers.check_act(act)
        kernel = layers.as_tuple(kernel_size, spatial_dims, "kernel_size")
        padding = layers.same_padding(kernel)
        layers.check_positive(in_channels=in_channels, num_classes=num_classes)
        if len(stages) == 0:
            raise ValueError("stages must hold at least one (num_convs, width) pair.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}.")

        conv = layers.conv_nd(spatial_dims)
        max_pool = layers.pool_nd("max", spatial_dims)
        features: list[nn.Module] = []
        channels = in_channels
        for index, (num_convs, width) in enumerate(stages):
            if num_convs < 1 or width < 1:
                raise ValueError(f"stage {index} needs num_convs >= 1 and width >= 1, got {(num_convs, width)}.")
            out_channels = layers.scale_width(width, width_mult)
            for _ in range(num_convs):
                # bias=True even before a norm, as in torchvision's vgg*_bn, so its features weights stay loadable.
                features.append(conv(channels, out_channels, kernel, padding=padding, bias=True))
                if norm != "none":
                    features.append(layers.norm_nd(norm, spatial_dims, out_channels))
                features.append(layers.act(act))
                channels = out_channels
            features.append(max_pool(kernel_size=2, stride=2, ceil_mode=True))
        self.features = nn.Sequential(*features)
        self.pool = layers.adaptive_avg_pool_nd(spatial_dims)(1)
        self.num_features = channels

        hidden_width = layers.scale_width(hidden, width_mult) if hidden else 0
        if hidden_width:
            self.head = nn.Sequential(
                nn.Linear(channels, hidden_width),
                layers.act(act),
                nn.Dropout(dropout),
                nn.Linear(hidden_width, num_classes),
            )
        else:
            self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(channels, num_classes))

        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.num_classes = num_classes
        layers.init_conv_weights(self)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Return globally pooled features of shape ``(B, num_features)`` for input ``(B, C, *spatial)``."""
        return torch.flatten(self.pool(self.features(x)), 1)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Map pooled features ``(B, num_features)`` to logits ``(B, num_classes)``."""
        return self.head(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits ``(B, num_classes)`` for input ``(B, in_channels, *spatial)``."""
        return self.forward_head(self.forward_features(x))


def _build(name: str, spatial_dims: int, in_channels: int, num_classes: int, **kwargs) -> VGG:
    return VGG(spatial_dims, in_channels, num_classes, stages=VGG_STAGES[name], **kwargs)


def vgg11(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> VGG:
    """VGG-11 (configuration A: 8 convs, widths 64-512). ``kwargs`` go to :class:`VGG`."""
    return _build("vgg11", spatial_dims, in_channels, num_classes, **kwargs)


def vgg13(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> VGG:
    """VGG-13 (configuration B: 10 convs, widths 64-512). ``kwargs`` go to :class:`VGG`."""
    return _build("vgg13", spatial_dims, in_channels, num_classes, **kwargs)


def vgg16(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> VGG:
    """VGG-16 (configuration D: 13 convs, widths 64-512). ``kwargs`` go to :class:`VGG`."""
    return _build("vgg16", spatial_dims, in_channels, num_classes, **kwargs)


def vgg19(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> VGG:
    """VGG-19 (configuration E: 16 convs, widths 64-512). ``kwargs`` go to :class:`VGG`."""
    return _build("vgg19", spatial_dims, in_channels, num_classes, **kwargs)


def vgg_small(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> VGG:
    """Small VGG for 16-32 px inputs: stages (1x32, 1x64, 2x128), head width 128. ``kwargs`` go to :class:`VGG`."""
    kwargs.setdefault("hidden", 128)
    return _build("vgg_small", spatial_dims, in_channels, num_classes, **kwargs)


def vgg_tiny(spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 10, **kwargs) -> VGG:
    """Tiny VGG for tests: two stages of one width-8 conv, head width 16. ``kwargs`` go to :class:`VGG`."""
    kwargs.setdefault("hidden", 16)
    return _build("vgg_tiny", spatial_dims, in_channels, num_classes, **kwargs)
