"""The CNN-DNN as one module: same function as the staged pipeline, scriptable, trainable end to end."""

from __future__ import annotations

import pytest
import torch

from ddcnn.context import assemble_cnn_dnn, build_context
from ddcnn.decomposition import Decomposition
from ddcnn.engine.common import predict_logits
from ddcnn.models.cnn_dnn import CNNDNN
from ddcnn.models.coarse import CoarseMLP
from ddcnn.models.vgg import vgg_tiny
from ddcnn.pipeline import train
from ddcnn.rundir import RunDir


def _model(spatial_dims: int, coarse_input: str = "probs") -> CNNDNN:
    shape = (12, 10) if spatial_dims == 2 else (8, 8, 6)
    dec = Decomposition((2,) * spatial_dims, shape, overlap=2)
    nets = [vgg_tiny(spatial_dims=spatial_dims, in_channels=2, num_classes=5) for _ in range(dec.num_subdomains)]
    return CNNDNN(dec, nets, CoarseMLP(dec.num_subdomains, 5), coarse_input)


@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_local_nets_see_their_own_subdomain(spatial_dims):
    model = _model(spatial_dims).eval()
    x = torch.randn(3, 2, *model.image_shape)
    parts = model.decomposition.split(x)
    logits = model.local_logits(x)
    for i, net in enumerate(model.local_nets):
        assert torch.allclose(logits[:, i], net(parts[:, i]), atol=1e-6)
    assert model(x).shape == (3, 5)


@pytest.mark.parametrize("coarse_input", ["probs", "logits"])
def test_scripted_module_matches_and_end_to_end_gradients_reach_every_part(coarse_input):
    model = _model(2, coarse_input).eval()
    x = torch.randn(4, 2, 12, 10)
    scripted = torch.jit.script(model)
    assert torch.allclose(scripted(x), model(x), atol=1e-6)
    model.train()
    model(x).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    with pytest.raises(ValueError, match="resize the input"):
        model(torch.randn(1, 2, 10, 10))


def test_assembled_module_reproduces_staged_test_predictions(make_cfg):
    cfg = make_cfg("stage=all")
    train(cfg)
    ctx = build_context(cfg)
    model = assemble_cnn_dnn(ctx)
    from ddcnn.data.datamodule import TensorDataModule

    dm = TensorDataModule(ctx.data.x, ctx.data.y, batch_size=32)
    logits, labels = predict_logits(model, dm, "test")
    staged = RunDir(cfg.paths.run_dir).load_probs("coarse", "test")
    assert torch.equal(labels, staged["labels"])
    assert torch.allclose(logits.softmax(-1), staged["probs"], atol=1e-5)
    assert torch.equal(logits.argmax(-1), staged["probs"].argmax(-1))
