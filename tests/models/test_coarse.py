"""Tests for the coarse model of the CNN-DNN."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ddcnn.models import CoarseMLP

NUM_SUBDOMAINS = 4
NUM_CLASSES = 5


def _local_probabilities(batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, NUM_SUBDOMAINS, NUM_CLASSES).softmax(dim=-1)


@pytest.mark.parametrize("hidden", [(), (16,), (16, 8)])
@pytest.mark.parametrize("norm", [False, True])
def test_both_layouts_give_the_same_logits(hidden, norm):
    net = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, hidden=hidden, norm=norm).eval()
    scores = _local_probabilities()
    logits = net(scores)
    assert logits.shape == (3, NUM_CLASSES)
    torch.testing.assert_close(net(scores.reshape(3, NUM_SUBDOMAINS * NUM_CLASSES)), logits)


def test_gradients_reach_every_parameter():
    net = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, hidden=(16, 8), dropout=0.2, act="gelu", norm=True).train()
    loss = nn.functional.cross_entropy(net(_local_probabilities()), torch.tensor([0, 1, 4]))
    loss.backward()
    for name, parameter in net.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name


def test_no_hidden_layer_is_linear():
    net = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, hidden=())
    assert [type(m) for m in net.modules() if not isinstance(m, nn.Sequential | CoarseMLP)] == [nn.Linear]
    a, b = _local_probabilities(), _local_probabilities()
    zero = torch.zeros_like(a)
    torch.testing.assert_close(net(a + b), net(a) + net(b) - net(zero))


def test_options_build_the_expected_layers():
    net = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, hidden=(32, 16), dropout=0.1, act="silu", norm=True)
    types = [type(m) for m in net.mlp]
    assert types == [nn.Linear, nn.LayerNorm, nn.SiLU, nn.Dropout] * 2 + [nn.Linear]
    assert net.mlp[0].in_features == net.in_features == NUM_SUBDOMAINS * NUM_CLASSES
    assert net.mlp[-1].out_features == NUM_CLASSES


@pytest.mark.parametrize("shape", [(3, NUM_SUBDOMAINS + 1, NUM_CLASSES), (3, NUM_SUBDOMAINS, 2), (3, 7), (3,)])
def test_wrong_input_shape_raises(shape):
    net = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES)
    with pytest.raises(ValueError, match=r"expected \(B, 4, 5\)"):
        net(torch.randn(*shape))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_subdomains": 0}, "num_subdomains"),
        ({"num_classes": 0}, "num_classes"),
        ({"hidden": (16, 0)}, "hidden"),
        ({"dropout": 1.5}, "dropout"),
        ({"act": "swish"}, "act must be one of"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    arguments = {"num_subdomains": NUM_SUBDOMAINS, "num_classes": NUM_CLASSES, **kwargs}
    with pytest.raises(ValueError, match=message):
        CoarseMLP(**arguments)


def test_torchscript():
    net = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, norm=True).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated but still what many deploy
        scripted = torch.jit.script(net)
    scores = _local_probabilities()
    torch.testing.assert_close(scripted(scores), net(scores))
    torch.testing.assert_close(scripted(scores.flatten(1)), net(scores))
