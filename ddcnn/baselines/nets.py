"""Networks of the baseline papers, rebuilt so their reported speedups can be checked on the same shapes.

:func:`marques_cifar` is the CIFAR-10 network of Marques, Falcao & Alexandre, "Distributed Learning of CNNs on
Heterogeneous CPU/GPU Architectures", 2017, https://arxiv.org/abs/1712.02546, on which filter-parallel training
reached 3.28x on four CPUs: two convolutional layers with 500 and 1500 filters, then a classifier. The abstract
gives only the layer and filter counts; the rest (5x5 kernels without padding, each followed by a ReLU and a 2x2
max pool, a linear classifier on the flattened features: the LeNet/Caffe CIFAR-10 layout) is our assumption.
On 32x32 inputs the feature maps are 28x28x500, 14x14x500, 10x10x1500 and 5x5x1500; the second convolution is
about 98% of the multiply-adds.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from ddcnn.models import layers

__all__ = ["MARQUES_WIDTHS", "marques_cifar"]

# Filters of the two convolutional layers of the paper's CIFAR-10 network.
MARQUES_WIDTHS = (500, 1500)


def marques_cifar(
    spatial_dims: int = 2,
    in_channels: int = 3,
    num_classes: int = 10,
    widths: Sequence[int] = MARQUES_WIDTHS,
    kernel_size: int | Sequence[int] = 5,
    image_size: int | Sequence[int] = 32,
) -> nn.Sequential:
    """The CIFAR-10 network of Marques et al.: per width a conv (no padding), ReLU and 2x max pool; a linear head.

    Args:
        spatial_dims: Number of spatial axes, 2 for images, 3 for volumes.
        in_channels: Input channels (3 for CIFAR-10).
        num_classes: Output logits.
        widths: Filters of each convolutional layer; the paper's ``(500, 1500)``, smaller ones for tests.
        kernel_size: Conv kernel size, an int or one per axis.
        image_size: Input size, an int or one per axis: the head is a linear layer over the flattened features,
            so the input size is fixed.

    Returns:
        ``nn.Sequential(features, flatten, head)``: ``features`` holds the conv, ReLU and pool layers.

    Raises:
        ValueError: If there are no widths, or the input is too small for the convolutions and pools.
    """
    kernel = layers.as_tuple(kernel_size, spatial_dims, "kernel_size")
    size = list(layers.as_tuple(image_size, spatial_dims, "image_size"))
    layers.check_positive(in_channels=in_channels, num_classes=num_classes)
    if len(widths) == 0:
        raise ValueError("widths must hold at least one filter count, e.g. (500, 1500).")
    conv, pool = layers.conv_nd(spatial_dims), layers.pool_nd("max", spatial_dims)
    features: list[nn.Module] = []
    channels = in_channels
    for width in widths:
        size = [(n - k + 1) // 2 for n, k in zip(size, kernel, strict=True)]
        if min(size) < 1:
            raise ValueError(
                f"image_size {image_size} is too small for {len(widths)} layers of {kernel_size} convs and 2x pools."
            )
        features += [conv(channels, width, kernel), nn.ReLU(), pool(kernel_size=2, stride=2)]
        channels = width
    head = nn.Linear(channels * math.prod(size), num_classes)
    return nn.Sequential(OrderedDict(features=nn.Sequential(*features), flatten=nn.Flatten(), head=head))
