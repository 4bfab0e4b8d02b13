"""The GPU hot path's remaining host work (issue 34), checked on CPU through the code a CUDA run takes: the optimizer a
``16-mixed`` training steps with (fused, so that the loss scaler's overflow check stays on the device) and the
streamed batches' single host copy (gathered straight into the memory their copy to the GPU reads)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddcnn.engine import gpu
from ddcnn.engine.loop import fit_batches
from ddcnn.engine.optim import build_optimizer
from ddcnn.settings import LoopSettings
from tests.engine.test_train import _data, _net

SGD = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "momentum": 0.9}
ADAMW = {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 2e-3, "weight_decay": 1e-4}


# --- the optimizer under 16-mixed ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "device", "precision", "clip", "fused"),
    [
        (SGD, "cuda", "16-mixed", None, True),
        (ADAMW, "cuda:1", "16-mixed", None, True),
        ({**ADAMW, "_target_": "torch.optim.adamw.AdamW"}, "cuda", "16-mixed", None, True),
        ({**SGD, "_target_": "torch.optim.Adam"}, "cuda", "16-mixed", None, True),
        (SGD, "cpu", "16-mixed", None, None),  # CPU: exactly the node's optimizer
        (SGD, "cuda", "bf16-mixed", None, None),  # no loss scaler
        (SGD, "cuda", "32-true", None, None),
        (SGD, "cuda", "16-mixed", 1.0, None),  # Fabric clips after unscaling, which a fused step does itself
        ({**SGD, "fused": False}, "cuda", "16-mixed", None, False),  # the node's choice stands
        ({**SGD, "foreach": True}, "cuda", "16-mixed", None, None),
        ({**SGD, "differentiable": True}, "cuda", "16-mixed", None, None),
        ({**SGD, "_target_": "torch.optim.RMSprop"}, "cuda", "16-mixed", None, None),  # no fused step
        ({**SGD, "_target_": "mypackage.optim.SGD"}, "cuda", "16-mixed", None, None),
    ],
)
def test_a_16_mixed_cuda_training_steps_with_a_fused_optimizer_where_the_node_leaves_it_open(
    spec, device, precision, clip, fused
):
    chosen = gpu.amp_optimizer(spec, device, precision, clip)
    assert chosen.get("fused") is fused
    if fused is None:
        assert chosen is spec
    assert spec.get("fused") in (None, False)  # the node itself is never changed


def test_the_fused_choice_is_an_optimizer_that_keeps_the_loss_scalers_check_on_the_device():
    """What GradScaler.step asks before it reads ``found_inf`` on the host: the optimizer built from the chosen node
    unscales and skips an overflowed step itself. On CPU the same contract runs: an overflow skips the step, a
    finite step is the unscaled one."""
    for spec in (SGD, ADAMW):
        chosen = gpu.amp_optimizer(spec, "cuda", "16-mixed", None)
        assert build_optimizer(chosen, nn.Linear(2, 2).parameters())._step_supports_amp_scaling
        assert not getattr(build_optimizer(spec, nn.Linear(2, 2).parameters()), "_step_supports_amp_scaling", False)

    def step(spec, grad_value: float) -> torch.Tensor:
        torch.manual_seed(0)
        net = nn.Linear(3, 2)
        opt = build_optimizer(spec, net.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(net(torch.ones(1, 3)).sum() * grad_value).backward()
        scaler.step(opt)
        scaler.update()
        return torch.cat([p.detach().flatten() for p in net.parameters()])

    fused = gpu.amp_optimizer(SGD, "cuda", "16-mixed", None)
    torch.manual_seed(0)
    start = torch.cat([p.detach().flatten() for p in nn.Linear(3, 2).parameters()])
    assert torch.equal(step(fused, float("inf")), start)  # overflow: the fused step is skipped on the device
    assert torch.allclose(step(fused, 1.0), step(SGD, 1.0), rtol=0, atol=1e-7)
    assert not torch.equal(step(fused, 1.0), start)


def test_on_cpu_a_16_mixed_training_is_bitwise_the_one_of_the_nodes_optimizer(tmp_path):
    """The loop asks the GPU policy for its optimizer: on CPU it is exactly the node's (a fused step would round
    differently), so the weights equal those of a training handed that optimizer as a callable."""
    settings = {"max_epochs": 2, "precision": "16-mixed", "device": "cpu", "write_best": False}
    by_node = fit_batches(_net(), _data(), tmp_path / "node", LoopSettings(optimizer=SGD, **settings))

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    by_callable = fit_batches(_net(), _data(), tmp_path / "callable", LoopSettings(optimizer=sgd, **settings))
    for a, b in zip(by_node.net.state_dict().values(), by_callable.net.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_fused_optimizer_with_clipping_under_16_mixed_is_refused_with_the_fix(tmp_path):
    """Fabric unscales gradients before clipping them, which it cannot do for an optimizer that unscales inside its
    step: refused before the first step, naming the settings and what works."""
    with pytest.raises(ValueError, match=r"fused: true .* trainer.gradient_clip_val=1.0 .* optimizer.fused=false"):
        gpu.amp_optimizer({**ADAMW, "fused": True}, "cpu", "16-mixed", 1.0)
    with pytest.raises(ValueError, match=r"optimizer.fused=false"):
        fit_batches(
            _net(),
            _data(),
            tmp_path / "clip",
            LoopSettings(
                optimizer={**ADAMW, "fused": True},
                max_epochs=1,
                precision="16-mixed",
                device="cpu",
                gradient_clip_val=1.0,
            ),
        )
    assert gpu.amp_optimizer({**ADAMW, "fused": True}, "cpu", "bf16-mixed", 1.0)["fused"] is True


# --- streamed batches: one host copy ---------------------------------------------------------------------------------
class _Recording:
    """An ``into`` allocator that keeps what it handed out (plain host memory: pinning needs CUDA)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def __call__(self, shape, dtype) -> torch.Tensor:
        self.buffers.append(torch.full(shape, 77, dtype=dtype))  # not zeros: every value must be written
        return self.buffers[-1]


@pytest.mark.parametrize(
    ("region", "flips"),
    [
        (None, None),
        ((slice(2, 9), slice(3, 15)), None),
        (None, torch.tensor([[True, False], [False, False], [True, True], [False, True]])),
        ((slice(1, 7), slice(4, 16)), torch.tensor([[True, False], [False, True], [True, True], [False, False]])),
    ],
)
def test_a_host_gather_writes_the_batch_once_into_the_memory_it_travels_from(region, flips):
    """The streamed path gathers a batch straight into the (pinned) memory its copy to the GPU reads: the values of
    the plain gather, in the buffer handed out, for the whole image, a box, flips and both (3D: same code)."""
    from tests.engine.test_gpu_first import _prepared

    data = _prepared()
    idx = torch.tensor([5, 0, 17, 5])
    axes = (0, 1) if flips is not None else ()
    into = _Recording()
    got = data.read("train", idx, region, flips, axes, into=into)
    assert torch.equal(got, data.read("train", idx, region, flips, axes))
    (buffer,) = into.buffers
    assert got.data_ptr() == buffer.data_ptr() and got.dtype == data.stored_dtype


def test_streamed_batches_gather_images_and_labels_into_host_memory_of_the_loops_choice():
    """Every host gather of a streamed PreparedBatches (images and labels, training with augmentation in a box and
    evaluation) goes through ``_host_memory`` (pinned memory on CUDA), and the batches are the values they were."""
    from ddcnn.data.augment import Augment
    from ddcnn.data.datamodule import PreparedBatches
    from tests.engine.test_gpu_first import _prepared

    into = _Recording()

    class Staged(PreparedBatches):
        @property
        def _host_memory(self):
            return into

    data, aug = _prepared(), Augment(flip_axes=(0, 1), rotate_deg=10.0, seed=3)
    box = (slice(2, 10), slice(4, 12))
    plain = PreparedBatches(data, 4, seed=0, box=box, augment=aug, cache=False)
    staged = Staged(data, 4, seed=0, box=box, augment=aug, cache=False)
    idx = torch.tensor([3, 9, 1, 30])
    for got, want in zip(staged.train_batch(idx, 2, "cpu"), plain.train_batch(idx, 2, "cpu"), strict=True):
        assert torch.equal(got, want)
    support = tuple(part.stop - part.start for part in staged.support)  # the box and what rotation reads around it
    assert [tuple(b.shape) for b in into.buffers] == [(4,), (4, 1, *support)]
    idx = torch.tensor([3, 0, 1])
    for got, want in zip(staged.eval_batch("val", idx, "cpu"), plain.eval_batch("val", idx, "cpu"), strict=True):
        assert torch.equal(got, want)
    assert len(into.buffers) == 4 and tuple(into.buffers[-1].shape) == (3, 1, 8, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_a_streamed_batch_is_gathered_into_pinned_memory_and_equals_the_device_resident_one():
    from ddcnn.data.augment import Augment
    from ddcnn.data.datamodule import PreparedBatches, pinned_empty
    from tests.engine.test_gpu_first import _prepared

    data = _prepared()
    got = data.read("train", torch.tensor([4, 2]), into=pinned_empty)
    assert got.is_pinned() and got.pin_memory().data_ptr() == got.data_ptr()  # no second host copy
    batches = PreparedBatches(data, 8, seed=0, augment=Augment(flip_axes=(1,), rotate_deg=10.0, seed=2))
    streamed, resident = batches.placed(None, pin=True), batches.placed("cuda", pin=False)
    idx = torch.arange(8)
    for a, b in zip(streamed.train_batch(idx, 1, "cuda"), resident.train_batch(idx.cuda(), 1, "cuda"), strict=True):
        assert torch.equal(a, b)
