"""Activation checkpointing (ddcnn/models/checkpointing.py): the same step as without it, bit for bit in float64."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from ddcnn.engine.train import fit_tensors
from ddcnn.models.checkpointing import (
    CheckpointRefused,
    apply_checkpointing,
    checkpoint_segments,
    is_checkpointed,
    remove_checkpointing,
)
from ddcnn.models.resnet import resnet_tiny
from ddcnn.models.vgg import vgg_tiny
from ddcnn.settings import LoopSettings

K = 5
ADAM = {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 1e-2}
BUILDERS = {"vgg": vgg_tiny, "resnet": resnet_tiny}


def _net(name: str, spatial_dims: int) -> nn.Module:
    torch.manual_seed(0)
    kwargs = {"dropout": 0.3} if name == "vgg" else {}
    return BUILDERS[name](spatial_dims=spatial_dims, in_channels=2, num_classes=K, norm="batch", **kwargs).double()


def _batch(spatial_dims: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 2, *(12,) * spatial_dims, generator=gen, dtype=torch.float64)
    return x, torch.randint(K, (n,), generator=gen)


def _step(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    net.train()
    torch.manual_seed(3)  # dropout's masks
    nn.functional.cross_entropy(net(x), y).backward()
    return {f"grad.{k}": p.grad for k, p in net.named_parameters()} | dict(net.named_buffers())


@pytest.mark.parametrize("spatial_dims", [2, 3])
@pytest.mark.parametrize("name", ["vgg", "resnet"])
def test_one_step_is_bit_identical_and_counts_batch_norm_once(name: str, spatial_dims: int) -> None:
    plain = _net(name, spatial_dims)
    cut = apply_checkpointing(copy.deepcopy(plain))
    assert is_checkpointed(cut) and not is_checkpointed(plain)
    assert cut.state_dict().keys() == plain.state_dict().keys()
    x, y = _batch(spatial_dims)
    a, b = _step(plain, x, y), _step(cut, x, y)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    saved = {}
    for label, net in (("plain", copy.deepcopy(plain)), ("cut", copy.deepcopy(cut))):
        nbytes = []

        def pack(t: torch.Tensor, nbytes: list = nbytes) -> torch.Tensor:
            nbytes.append(t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            net(x)
        saved[label] = sum(nbytes)
    assert saved["cut"] < saved["plain"]  # the stages keep only their inputs
    tracked = [v for k, v in b.items() if k.endswith("num_batches_tracked")]
    assert tracked and all(int(v) == 1 for v in tracked)  # plain torch.utils.checkpoint gives 2


def test_plain_checkpoint_would_count_twice() -> None:
    """What the recompute's context prevents: torch's checkpoint alone updates the statistics again in backward."""
    from torch.utils.checkpoint import checkpoint

    bn = nn.BatchNorm2d(3).double()
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn.num_batches_tracked) == 2


@pytest.mark.parametrize("spatial_dims", [2, 3])
@pytest.mark.parametrize("name", ["vgg", "resnet"])
def test_fit_batches_bit_identical(tmp_path: Path, name: str, spatial_dims: int) -> None:
    gen = torch.Generator().manual_seed(2)
    x = {s: torch.randn(n, 2, *(10,) * spatial_dims, generator=gen) for s, n in (("train", 24), ("val", 8))}
    y = {s: torch.randint(K, (len(v),), generator=gen) for s, v in x.items()}
    nets = {}
    for mode in ("none", "all"):
        settings = LoopSettings(
            optimizer=ADAM,
            max_epochs=2,
            seed=5,
            precision="64-true",
            activation_checkpointing=mode,
            monitor="val_loss",
            monitor_mode="min",
        )
        result = fit_tensors(_net(name, spatial_dims).float(), x, y, tmp_path / mode, settings, batch_size=8)
        assert not is_checkpointed(result.net)  # handed back with its own forward
        nets[mode] = result.net.state_dict()
    for key, value in nets["none"].items():
        assert torch.equal(value, nets["all"][key]), key
    assert int(nets["all"]["bn1.num_batches_tracked" if name == "resnet" else "features.1.num_batches_tracked"]) > 0


def test_segments_and_refusal() -> None:
    vgg = vgg_tiny(spatial_dims=2, in_channels=1, num_classes=K, norm="batch")
    assert [s.bounds for s in checkpoint_segments(vgg)] == [((0, 4), (4, 8))]  # conv, norm, act, pool per stage
    seq = nn.Sequential(*(nn.Linear(4, 4) for _ in range(9)))
    (seg,) = checkpoint_segments(seq)
    assert seg.bounds == ((0, 3), (3, 6), (6, 9)) and seg.recomputed == (True, True, False)

    class Code(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(x)

    with pytest.raises(CheckpointRefused, match=r"none of its top-level children.*a \(Linear\)"):
        apply_checkpointing(Code())
    assert remove_checkpointing(apply_checkpointing(seq)) is seq and not is_checkpointed(seq)


def test_the_setting_is_read_checked_and_leaves_the_fingerprint(tmp_path: Path) -> None:
    from ddcnn.settings import RunSettings
    from tests.conftest import compose_config

    plain = RunSettings.from_config(compose_config([], tmp_path / "a"))
    cut = RunSettings.from_config(compose_config(["engine.activation_checkpointing=global"], tmp_path / "b"))
    assert plain.loop.activation_checkpointing == "none" and cut.loop.activation_checkpointing == "global"
    assert plain.identity().fingerprint == cut.identity().fingerprint  # same results: a run directory resumes
    with pytest.raises(ValueError, match="engine.activation_checkpointing must be none, global .* got 'some'"):
        RunSettings.from_config(compose_config(["engine.activation_checkpointing=some"], tmp_path / "c"))
