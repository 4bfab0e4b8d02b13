"""Backbones (VGG, ResNet) for 2D and 3D inputs and the coarse model of the CNN-DNN; adapters for timm, torchvision
and MONAI networks (:mod:`ddcnn.models.external`) and pretrained weights files (:mod:`ddcnn.models.pretrained`).

Plain ``nn.Module``s: no Lightning or Hydra here.
"""

from ddcnn.models.coarse import CoarseMLP
from ddcnn.models.resnet import (
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
from ddcnn.models.vgg import VGG, vgg11, vgg13, vgg16, vgg19, vgg_small, vgg_tiny

__all__ = [
    "VGG",
    "BasicBlock",
    "Bottleneck",
    "CoarseMLP",
    "ResNet",
    "resnet10",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet_tiny",
    "vgg11",
    "vgg13",
    "vgg16",
    "vgg19",
    "vgg_small",
    "vgg_tiny",
]
