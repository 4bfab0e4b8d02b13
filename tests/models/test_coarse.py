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
    layers = [type(m) for m in net.modules() if not isinstance(m, nn.Sequential | CoarseMLP | nn.Identity)]
    assert layers == [nn.Linear]
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
        ({"inputs": "scores"}, "coarse.net.inputs must be one of probs, logits"),
        ({"input_norm": "minmax"}, "coarse.net.input_norm must be one of standardize, none"),
        ({"skip": "vote"}, "coarse.net.skip must be one of mean_prob, none"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    arguments = {"num_subdomains": NUM_SUBDOMAINS, "num_classes": NUM_CLASSES, **kwargs}
    with pytest.raises(ValueError, match=message):
        CoarseMLP(**arguments)


ROBUST = {"input_norm": "standardize", "skip": "mean_prob", "linear": True}


@pytest.mark.parametrize("inputs", ["probs", "logits"])
def test_the_untrained_robust_net_is_the_averaging_combiner(inputs):
    logits = 4 * torch.randn(64, NUM_SUBDOMAINS, NUM_CLASSES)
    scores = logits.softmax(-1) if inputs == "probs" else logits
    net = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, hidden=(16,), inputs=inputs, **ROBUST).eval()
    net.fit_input_scaling(scores)
    averaging = logits.softmax(-1).mean(1).log()
    out = net(scores)
    # Only the hidden layers' small starting correction separates them.
    assert (out - averaging).abs().max() < 0.1
    assert (out.argmax(-1) == averaging.argmax(-1)).float().mean() > 0.9
    with torch.no_grad():
        net.mlp[-1].weight.zero_()
    torch.testing.assert_close(net(scores), averaging)


def test_input_scaling_standardises_the_training_rows_and_is_in_the_state_dict():
    rows = 30 * torch.randn(500, NUM_SUBDOMAINS, NUM_CLASSES) + 7
    rows[:, 0, 0] = 3.0  # a constant feature is centred, not divided by ~0
    net = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, inputs="logits", input_norm="standardize")
    net.fit_input_scaling(rows)
    z = net.scale_inputs(rows)
    assert z.mean(0).abs().max() < 1e-4
    assert torch.allclose(z.std(0)[1:], torch.ones(NUM_SUBDOMAINS * NUM_CLASSES - 1), atol=1e-4)
    assert float(z[:, 0].abs().max()) == 0.0 and float(net.input_std[0]) == 1.0
    copy = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, inputs="logits", input_norm="standardize")
    copy.load_state_dict(net.state_dict())
    torch.testing.assert_close(copy(rows), net(rows))
    plain = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, inputs="logits")  # input_norm none: fitting changes nothing
    plain.fit_input_scaling(rows)
    assert float(plain.input_mean.abs().max()) == 0.0


def test_a_coarse_dnn_saved_before_input_scaling_loads_and_computes_as_before():
    net = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, hidden=(16,)).eval()
    old = {k: v for k, v in net.state_dict().items() if not k.startswith("input_")}
    loaded = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, hidden=(16,)).eval()
    loaded.load_state_dict(old)
    scores = _local_probabilities()
    torch.testing.assert_close(loaded(scores), net(scores))


def test_the_linear_path_adds_a_linear_map_of_the_scaled_inputs():
    net = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, hidden=(8,), inputs="logits", **ROBUST).eval()
    scores = torch.randn(5, NUM_SUBDOMAINS, NUM_CLASSES)
    before = net(scores)
    with torch.no_grad():
        net.linear_layer().bias.fill_(1.5)
    torch.testing.assert_close(net(scores), before + 1.5)
    assert CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, hidden=()).linear_layer() is not None
    with pytest.raises(ValueError, match="no linear path"):
        CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, hidden=(8,)).linear_layer()


@pytest.mark.parametrize("options", [{}, ROBUST])
def test_torchscript(options):
    net = CoarseMLP(NUM_SUBDOMAINS, NUM_CLASSES, norm=True, **options).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated but still what many deploy
        scripted = torch.jit.script(net)
    scores = _local_probabilities()
    torch.testing.assert_close(scripted(scores), net(scores))
    torch.testing.assert_close(scripted(scores.flatten(1)), net(scores))
