"""Other libraries' networks (timm, torchvision, MONAI) as local nets and global CNN, the input size check and
pretrained weights from a local file (ddcnn/models/external.py, ddcnn/models/pretrained.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import sys

import numpy as np
import pytest
import torch
from omegaconf import open_dict
from torch import nn

from ddcnn.context import build_context, build_local_net
from ddcnn.models import external, pretrained
from ddcnn.pipeline import train
from ddcnn.predict import predict_main
from ddcnn.rundir import FingerprintMismatch, RunDir, fingerprint, network_identity
from ddcnn.settings import RunSettings
from tests.conftest import compose_config, shared_data
from tests.models.conftest import NUM_CLASSES

pytest.importorskip("timm")
pytest.importorskip("monai")

# The smallest networks of each library that train in a second on 8x8 digits.
TIMM = ["model=timm", "model.arch=mobilenetv2_035"]
TORCHVISION = ["model=torchvision", "model.arch=mobilenet_v2", "+model.width_mult=0.25"]
# MONAI's DenseNet with two small dense blocks: 5 pixels per side at least (a stride-2 stem, a max pool, one transition)
MONAI_SMALL = [
    "model=monai",
    "model.arch=DenseNet",
    "+model.init_features=8",
    "+model.growth_rate=4",
    "+model.block_config=[1,1]",
]
FAST = ["trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "coarse.max_epochs=1"]
# Only the staged CNN-DNN and the global CNN (the default's other coarse fits do not depend on the backbone).
STAGED_ONLY = [f"methods.enabled.{m}=false" for m in ("coarse_alt", "stacker", "coarse_val")]
ALL_NETWORK_METHODS = [f"methods.enabled.{m}=true" for m in ("e2e", "transfer", "global_transfer")]


def _adapter_nets():
    yield external.timm_net("mobilenetv2_035", 2, 2, NUM_CLASSES), 2
    yield external.torchvision_net("mobilenet_v2", 2, 2, NUM_CLASSES, width_mult=0.25), 2
    for dims in (2, 3):
        yield (
            external.monai_net("DenseNet", dims, 2, NUM_CLASSES, init_features=8, growth_rate=4, block_config=[1, 1]),
            dims,
        )


@pytest.mark.parametrize("case", range(4), ids=["timm", "torchvision", "monai-2d", "monai-3d"])
def test_each_library_builds_for_the_data_channels_and_classes(case):
    net, dims = list(_adapter_nets())[case]
    x = torch.randn(2, 2, *(12,) * dims)
    out = net.train()(x)
    assert out.shape == (2, NUM_CLASSES)
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters() if p.requires_grad)
    first = next(m for m in net.modules() if isinstance(m, nn.modules.conv._ConvNd))
    assert first.in_channels == 2  # torchvision's 3-channel stem replaced, timm's and MONAI's built for 2


# Networks whose library initialises the classifier for ImageNet's 1000 classes (weights ~ U(+-1/sqrt(num_classes))).
_THOUSAND_CLASS_HEADS = [
    ("timm", "mobilenetv2_035", {}),
    ("torchvision", "mnasnet0_5", {}),
    ("monai", "EfficientNetBN", {"model_name": "efficientnet-b0"}),
]


@pytest.mark.parametrize("library, arch, kwargs", _THOUSAND_CLASS_HEADS, ids=[a for _, a, _ in _THOUSAND_CLASS_HEADS])
@pytest.mark.parametrize("classes", [2, 10])
def test_a_fresh_backbone_starts_near_ln_k_whatever_the_class_count(library, arch, kwargs, classes, monkeypatch):
    """A fresh network's first loss is that of uniform guesses, ln K, not several times it: with the libraries' own
    classifier (timm's mobilenetv2_100 on 14x14 MNIST: 6.8 for 10 classes) training spends its first epochs shrinking
    logits. Also: nothing is downloaded (MONAI's EfficientNetBN defaults to pretrained=True)."""

    def no_download(*args, **kw):
        raise AssertionError(f"{library} {arch} tried to download weights")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_download)
    monkeypatch.setattr(torch.utils.model_zoo, "load_url", no_download)
    torch.manual_seed(0)
    net = getattr(external, f"{library}_net")(arch, 2, 1, classes, **kwargs).train()
    x = torch.randn(16, 1, 32, 32)
    y = torch.arange(16) % classes
    with torch.no_grad():
        logits = net(x)
    loss = float(nn.functional.cross_entropy(logits, y))
    assert loss < 1.25 * np.log(classes), (loss, np.log(classes))
    assert float(logits.std()) < 1.0


def test_a_sane_classifier_is_kept_as_its_library_initialised_it():
    torch.manual_seed(0)
    net = external.torchvision_net("mobilenet_v2", 2, 1, NUM_CLASSES, width_mult=0.25)  # normal(0, 0.01): gain 0.36
    torch.manual_seed(0)
    import torchvision

    own = torchvision.models.mobilenet_v2(num_classes=NUM_CLASSES, width_mult=0.25)
    assert torch.equal(net.classifier[-1].weight, own.classifier[-1].weight)
    assert external.calm_classifier(net, NUM_CLASSES) is None


def test_library_errors_name_the_fix():
    with pytest.raises(ValueError, match="model=monai"):
        external.timm_net("mobilenetv2_035", 3, 1, 2)
    with pytest.raises(ValueError, match="mobilenetv2_035"):  # a close name is offered
        external.timm_net("mobilenetv2_036", 2, 1, 2)
    with pytest.raises(ValueError, match="never downloads.*model.weights=PATH"):
        external.timm_net("mobilenetv2_035", 2, 1, 2, pretrained=True)
    with pytest.raises(ValueError, match="never downloads.*model.weights=PATH"):
        external.torchvision_net("mobilenet_v2", 2, 1, 2, weights="DEFAULT")
    with pytest.raises(ValueError, match="never downloads"):
        external.monai_net("DenseNet121", 2, 1, 2, pretrained=True)


def test_a_missing_library_is_named_with_its_install_command(make_cfg, monkeypatch):
    # sys.modules[name] = None is how Python marks a module as not importable: `import timm` raises ImportError.
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(ImportError, match=r"pip install 'ddcnn\[timm\]'"):
        build_context(make_cfg(*TIMM), claim=False)


def test_a_library_target_gets_only_what_it_takes(make_cfg):
    """``model._target_=torchvision.models.mobilenet_v2`` on a group of ddcnn's VGG (with its norm and width_mult)."""
    ctx = build_context(make_cfg("model._target_=torchvision.models.mobilenet_v2"), claim=False)
    net = build_local_net(ctx.settings, ctx.data)
    assert type(net).__name__ == "MobileNetV2" and net.classifier[-1].out_features == 10


# --- the input size ------------------------------------------------------------------------------
def test_smallest_input_of_densenet121_is_29():
    net = external.monai_net("DenseNet121", 2, 1, 2)
    assert external.smallest_input(net, 2, 1) == 29


def test_too_small_subdomains_are_refused_naming_the_smallest_size_and_the_settings(make_cfg):
    # digits: 16x16 images, 2x2 sub-domains of 9x9 (overlap 2); MONAI's DenseNet121 needs 29
    with pytest.raises(ValueError) as err:
        build_context(make_cfg("model=monai", "model.arch=DenseNet121"), claim=False)
    text = str(err.value)
    assert "needs at least 29 pixels per side" in text and "(sub-domains of 9x9)" in text
    assert "data.image_size=[55,55]" in text  # ceil((55 + 2) / 2) = 29
    assert "small-input stem" in text
    # the settings it names work
    build_context(make_cfg("model=monai", "model.arch=DenseNet121", "data.image_size=[55,55]"), claim=False)


def test_adrenal_28_is_refused_naming_29_and_64_with_overlap_works(make_cfg):
    shared_data("adrenalmnist3d_28.npz")
    shared_data("adrenalmnist3d_64.npz")
    small = ["model=monai", "model.arch=DenseNet121", "decomposition=2x2x2", "decomposition.overlap=0"]
    with pytest.raises(ValueError, match=r"sub-domains of 14x14x14\): it needs at least 29 pixels per side"):
        build_context(make_cfg("data=adrenal3d_28", *small, "data.train_subset=50", "data.test_subset=20"), claim=False)
    ctx = build_context(
        make_cfg(
            "data=adrenal3d_64", *small[:3], "decomposition.overlap=2", "data.train_subset=50", "data.test_subset=20"
        ),
        claim=False,
    )
    assert ctx.decomposition.sub_shape == (33, 33, 33)


def test_padded_nets_warn_when_their_maps_collapse(make_cfg, caplog):
    with caplog.at_level(logging.WARNING, logger="ddcnn.context"):
        build_context(make_cfg(*TIMM), claim=False)
    # 9x9 sub-domains: MobileNetV2's five stride-2 stages see 9, 5, 3, 2, 1 pixels
    assert "shrink to one pixel before 1 of its 5 downsampling stages" in caplog.text
    assert "at least 32 per side" in caplog.text


# --- pretrained weights --------------------------------------------------------------------------
def test_adapt_input_conv_is_timms():
    from timm.models import adapt_input_conv as timm_adapt

    w = torch.randn(8, 3, 3, 3)
    for channels in (1, 2, 5):
        assert torch.allclose(pretrained.adapt_input_conv(channels, w), timm_adapt(channels, w.clone()))
    # 3D kernels too: a constant input gives the response it gave with 3 channels (exactly for 1 channel and for
    # multiples of 3)
    w3 = torch.randn(4, 3, 3, 3, 3)
    x3 = torch.ones(1, 3, 5, 5, 5)
    for channels in (1, 6):
        x = torch.ones(1, channels, 5, 5, 5)
        adapted = pretrained.adapt_input_conv(channels, w3)
        assert torch.allclose(nn.functional.conv3d(x, adapted), nn.functional.conv3d(x3, w3), atol=1e-5)


def test_weights_load_with_the_first_conv_and_classifier_adapted(tmp_path):
    source = external.timm_net("mobilenetv2_035", 2, 3, 7)
    path = tmp_path / "ckpt.pth"
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, path)
    net = external.timm_net("mobilenetv2_035", 2, 1, NUM_CLASSES)
    fresh_head = net.classifier.weight.detach().clone()
    record = pretrained.load_weights(net, pretrained.read_weights(path), 1, NUM_CLASSES)
    assert record["prefix"] == "module."
    assert record["first_conv"]["tensor"] == "conv_stem.weight" and record["first_conv"]["file_channels"] == 3
    assert torch.allclose(net.conv_stem.weight, source.conv_stem.weight.sum(1, keepdim=True))
    assert record["classifier"] == {
        "tensors": ["classifier.bias", "classifier.weight"],
        "file_classes": 7,
        "classes": 5,
    }
    assert torch.equal(net.classifier.weight, fresh_head)
    assert torch.equal(net.blocks[3][0].conv_pw.weight, source.blocks[3][0].conv_pw.weight)
    other = external.timm_net("mobilenetv2_050", 2, 1, NUM_CLASSES)
    with pytest.raises(pretrained.WeightsError, match="another architecture or width"):
        pretrained.load_weights(other, pretrained.read_weights(path), 1, NUM_CLASSES)


@pytest.mark.parametrize("dims", [2, 3])
def test_weights_of_ddcnn_and_monai_nets_load_into_other_channels_and_classes(dims, tmp_path):
    from ddcnn.models.vgg import vgg_tiny

    kw = {"init_features": 8, "growth_rate": 4, "block_config": [1, 1]}
    for build in (lambda c, k: vgg_tiny(dims, c, k), lambda c, k: external.monai_net("DenseNet", dims, c, k, **kw)):
        source, net = build(3, 7), build(2, NUM_CLASSES)
        torch.save(source.state_dict(), tmp_path / "w.pt")
        record = pretrained.load_weights(net, pretrained.read_weights(tmp_path / "w.pt"), 2, NUM_CLASSES)
        key = record["first_conv"]["tensor"]
        expected = pretrained.adapt_input_conv(2, source.state_dict()[key])
        assert torch.equal(net.state_dict()[key], expected) and expected.shape[1] == 2
        assert (
            record["classifier"]["file_classes"] == 7 and record["loaded"] == len(source.state_dict()) - 2
        )  # all but the classifier
        assert net(torch.randn(2, 2, *(12,) * dims)).shape == (2, NUM_CLASSES)


@pytest.mark.slow
def test_pretrained_weights_train_through_the_pipeline(tmp_path, make_cfg):
    """``model.weights=PATH``: every local net and the global CNN start from it, meta.json and the fingerprint record
    its content hash, the export does not need it any more."""
    source = external.timm_net("mobilenetv2_035", 2, 3, 1000)  # an ImageNet-shaped checkpoint: RGB, 1000 classes
    path = tmp_path / "mobilenetv2_035.pth"
    torch.save(source.state_dict(), path)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    run_dir = tmp_path / "run"
    cfg = make_cfg(
        *TIMM,
        *FAST,
        *STAGED_ONLY,
        f"model.weights={path}",
        "data.train_subset=120",
        "data.test_subset=40",
        run_dir=run_dir,
    )
    train(cfg)
    run = RunDir(run_dir)
    for meta in (run.meta("local", 0), run.meta("local", 3), run.meta("global")):
        meta = meta["pretrained_weights"]
        assert meta["sha256"] == sha and meta["path"] == str(path.resolve())
        assert meta["first_conv"]["channels"] == 1 and meta["classifier"]["file_classes"] == 1000
    recorded = json.loads((run_dir / "fingerprint.json").read_text())["settings"]["model"]
    assert recorded["weights"] == f"sha256:{sha}"
    # another file under the same name is another configuration
    torch.save(external.timm_net("mobilenetv2_035", 2, 3, 1000).state_dict(), path)
    with pytest.raises(FingerprintMismatch, match="model.weights: 'sha256:"):
        RunDir(run_dir).claim(RunSettings.from_config(cfg).identity())
    path.unlink()
    from ddcnn.export import export_run

    assert export_run(run_dir).is_file()  # the finished nets come from net.pt
    with pytest.raises(FileNotFoundError, match=r"model.weights=.*no such file"):
        build_context(cfg, claim=False)


def test_no_weights_leave_the_fingerprint_and_store_keys_as_they_were(make_cfg):
    cfg = make_cfg()
    assert cfg.model.weights is None
    before = RunSettings.from_config(cfg).identity().settings
    with open_dict(cfg):
        del cfg.model["weights"]  # the configuration as it was before model.weights existed
    assert RunSettings.from_config(cfg).identity().settings == before and "weights" not in before["model"]
    assert fingerprint(RunSettings.from_config(cfg).identity().settings) == fingerprint(before)
    spec = {"name": "vgg_small", "_target_": "ddcnn.models.vgg.vgg_small", "width_mult": 1.0, "norm": "batch"}
    assert network_identity({**spec, "weights": None}) == spec


# --- every method, the export and predict ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "backbone, methods", [(TIMM, ALL_NETWORK_METHODS), (TORCHVISION, [])], ids=["timm-every-method", "torchvision"]
)
def test_external_backbones_train_and_the_export_predicts_like_the_pipeline(backbone, methods, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = compose_config(
        [
            *backbone,
            *FAST,
            *STAGED_ONLY,
            *methods,
            "report.export=true",
            "data.train_subset=120",
            "data.test_subset=null",
        ],
        run_dir,
    )
    results = train(cfg)
    for method in ("cnn_dnn", "global", *(m.split(".")[2].split("=")[0] for m in methods)):
        assert results["accuracy"][method] is not None, method
    from ddcnn.data.sources import digits
    from ddcnn.export import load_exported

    model, meta = load_exported(run_dir / "export" / "cnn_dnn.pt")
    assert meta["model"] == cfg.model.name
    with torch.inference_mode():
        probs = model.predict_proba(torch.from_numpy(digits().x_test))
    staged = RunDir(run_dir).load_probs("coarse", "test")["probs"]
    assert torch.allclose(probs, staged, atol=1e-4)
    # ddcnn-predict on a run directory without an export: it exports from config.yaml and the saved nets first
    (run_dir / "export" / "cnn_dnn.pt").unlink()
    batch = tmp_path / "batch.npy"
    np.save(batch, digits().x_test[:3])
    capsys.readouterr()  # the training's printed results
    assert predict_main([str(run_dir), str(batch), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    for j, line in enumerate(lines):
        predicted = torch.tensor([line["probabilities"][str(k)] for k in range(10)])
        assert torch.allclose(predicted, staged[j], atol=1e-4)
    assert len(lines) == 3


@pytest.mark.slow
def test_a_3d_monai_backbone_trains_and_exports(tmp_path):
    # 16^3 volumes, 8^3 sub-volumes: larger than DenseNet's 7^3 stem (on 6^3 inputs torch 2.14's oneDNN conv3d
    # weight gradient on the CPU is now and then not finite; the loop restarts such a training, ddcnn/engine/loop.py).
    rng = np.random.default_rng(0)
    x = rng.random((60, 1, 16, 16, 16), dtype=np.float32)
    y = (x[:, 0, :8].mean(axis=(1, 2, 3)) > x[:, 0, 8:].mean(axis=(1, 2, 3))).astype(np.int64)
    np.savez(tmp_path / "vol.npz", x_train=x[:45], y_train=y[:45], x_test=x[45:], y_test=y[45:])
    overrides = [
        *MONAI_SMALL,
        *FAST,
        *STAGED_ONLY,
        *ALL_NETWORK_METHODS,
        "report.export=true",
        "data=mnist",
        f"data.path={tmp_path / 'vol.npz'}",
        "data.source.spatial_dims=3",
        "data.spatial_dims=3",
        "data.num_classes=2",
        "data.train_subset=null",
        "data.test_subset=null",
        "decomposition=2x2x2",
        "decomposition.overlap=0",
    ]
    run_dir = tmp_path / "run"
    results = train(compose_config(overrides, run_dir))
    for method in ("cnn_dnn", "global", "e2e", "transfer", "global_transfer"):
        assert results["accuracy"][method] is not None, method
    from ddcnn.export import load_exported

    model, _ = load_exported(run_dir / "export" / "cnn_dnn.pt")
    with torch.inference_mode():
        probs = model.predict_proba(torch.from_numpy(x[45:]))
    assert torch.allclose(probs, RunDir(run_dir).load_probs("coarse", "test")["probs"], atol=1e-4)


def test_export_traces_local_nets_that_do_not_script(tmp_path):
    """A local net that TorchScript cannot compile is traced at the sub-domain shape; the export predicts the same."""
    from ddcnn.data.sources import digits
    from ddcnn.export import load_exported

    run_dir = tmp_path / "run"
    overrides = [*FAST, *STAGED_ONLY, "model._target_=tests.models.test_external.UnscriptableNet", "report.export=true"]
    train(compose_config([*overrides, "data.test_subset=null"], run_dir))
    model, _ = load_exported(run_dir / "export" / "cnn_dnn.pt")
    with torch.inference_mode():
        probs = model.predict_proba(torch.from_numpy(digits().x_test))
    assert torch.allclose(probs, RunDir(run_dir).load_probs("coarse", "test")["probs"], atol=1e-4)


class UnscriptableNet(nn.Module):
    """A small CNN whose forward TorchScript cannot compile (a generator expression)."""

    def __init__(self, spatial_dims: int, in_channels: int, num_classes: int, **_) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(in_channels, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)])
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = sum(torch.relu(conv(x)) for conv in self.convs[:1])
        x = torch.relu(self.convs[1](x))
        return self.head(x.mean(dim=(2, 3)))
