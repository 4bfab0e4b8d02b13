"""The networks of the baseline papers have the shapes the papers report."""

from __future__ import annotations

import pytest
import torch

from ddcnn.baselines.nets import MARQUES_WIDTHS, marques_cifar


def test_marques_cifar_has_the_papers_two_conv_layers_of_500_and_1500_filters() -> None:
    net = marques_cifar()
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == list(MARQUES_WIDTHS) == [500, 1500]
    assert convs[0].in_channels == 3 and convs[1].kernel_size == (5, 5)
    # 32 -> conv 28 -> pool 14 -> conv 10 -> pool 5: the head sees 1500 x 5 x 5 features.
    assert net.head.in_features == 1500 * 5 * 5


@pytest.mark.parametrize(("spatial_dims", "shape"), [(2, (3, 2, 20, 20)), (3, (2, 2, 10, 10, 10))])
def test_marques_cifar_tiny_trains_in_2d_and_3d(spatial_dims: int, shape: tuple[int, ...]) -> None:
    net = marques_cifar(spatial_dims, 2, 5, widths=(4, 6), kernel_size=3, image_size=shape[2])
    logits = net(torch.randn(shape))
    assert logits.shape == (shape[0], 5)
    logits.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


def test_marques_cifar_refuses_an_input_too_small_for_its_layers() -> None:
    with pytest.raises(ValueError, match="too small"):
        marques_cifar(image_size=8)
    with pytest.raises(ValueError, match="widths"):
        marques_cifar(widths=())
