"""GPU-first defaults (issue 23), checked on CPU: ``device=auto``, the GPU policy of the loop, peak memory, data held on
the device, and the opt-ins (``engine.compile``, ``engine.profile_steps``). Every path a CUDA run takes is exercised
with the device as an argument, so the same code runs here."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ddcnn.data.augment import Augment
from ddcnn.data.datamodule import PreparedBatches, RowSubset
from ddcnn.data.prepare import prepare
from ddcnn.data.sources import Splits
from ddcnn.decomposition import Decomposition
from ddcnn.engine import gpu
from ddcnn.engine.train import fit
from ddcnn.parallel.devices import plan_workers, process_device
from ddcnn.pipeline import train
from ddcnn.rundir import RunDir
from ddcnn.runtime import resolve_device
from ddcnn.settings import RunSettings
from tests.conftest import load_script

K = 5  # an odd class count, so that a hard-coded 10 cannot pass
SGD = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "momentum": 0.9}


def _gpu_check():
    return load_script("bench/gpu_check.py", "gpu_check")


def _prepared(shape=(12, 16), n=60, seed=0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % K
    x = rng.integers(0, 60, size=(n, 1, *shape), dtype=np.uint8)
    for j, label in enumerate(y):  # the class is the brightest band of rows
        x[j, 0, 2 * label : 2 * label + 2] += 150
    splits = Splits(x[:40], y[:40], x[40:], y[40:], class_names=[str(k) for k in range(K)], name="bands")
    return prepare(splits, num_classes=K, in_channels=1, spatial_dims=len(shape))


class _Recording(nn.Module):
    """A small CNN (2D or 3D) that records the memory format its first convolution computes in (a one-channel batch
    is laid out alike in both formats; the network's weights decide)."""

    def __init__(self, spatial_dims: int = 2) -> None:
        super().__init__()
        conv = nn.Conv2d if spatial_dims == 2 else nn.Conv3d
        pool = nn.AdaptiveAvgPool2d if spatial_dims == 2 else nn.AdaptiveAvgPool3d
        torch.manual_seed(0)
        self.body = nn.Sequential(conv(1, 4, 3, padding=1), nn.ReLU(), pool(2), nn.Flatten())
        self.head = nn.Linear(4 * 2**spatial_dims, K)
        self.layouts: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body[0](x)
        if self.training:  # channels last: the channels are the innermost axis of the activations
            self.layouts.append(h.stride(1) == 1)
        return self.head(self.body[1:](h))


def _fit(make_cfg, folder: Path, *overrides: str, net=None, data=None):
    cfg = make_cfg("trainer.max_epochs=2", "trainer.limit_train_batches=null", *overrides)
    data = (
        data if data is not None else PreparedBatches(_prepared(), 8, seed=0, augment=Augment(flip_axes=(1,), seed=2))
    )
    run = RunSettings.from_config(cfg)
    start = time.perf_counter()
    return fit(run, net or _Recording(), data, folder, start, seed=0, device="cpu", optimizer=SGD)


# --- device=auto ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cuda_count", [0, 1, 4])
def test_auto_resolves_to_the_kind_parallel_workers_use(cuda_count):
    device = resolve_device("auto", cuda_count=cuda_count)
    assert device == ("cuda" if cuda_count else "cpu")
    kinds = {w.device.split(":")[0] for w in plan_workers(3, "auto", cores=6, cuda_count=cuda_count)}
    assert kinds == {device}  # local nets of the workers and the one-device stages: one kind


def test_explicit_devices_are_kept_and_auto_never_picks_mps():
    assert [resolve_device(d, cuda_count=2) for d in ("cpu", "cuda:1", "mps", None)] == ["cpu", "cuda:1", "mps", "cpu"]
    assert resolve_device("AUTO", cuda_count=0) == "cpu"


def test_the_default_config_says_auto_and_resolves_to_cpu_without_a_gpu(make_cfg, monkeypatch):
    cfg = make_cfg()
    assert cfg.device == "auto"
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert process_device(RunSettings.from_config(cfg).device) == "cpu"


def test_a_run_dir_recorded_with_device_cpu_accepts_device_auto(make_cfg, tmp_path):
    run = RunDir(tmp_path / "run")
    run.claim(RunSettings.from_config(make_cfg("device=cpu")).identity())
    run.claim(RunSettings.from_config(make_cfg()).identity())  # device=auto (here: cpu) is not a settings change
    run.claim(
        RunSettings.from_config(make_cfg("device=cuda")).identity()
    )  # where a run trains never changes its fingerprint


# --- the GPU policy --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("device", "deterministic", "settings", "dims", "expected"),
    [
        ("cuda:0", False, {}, 4, (True, "channels_last", True, True)),
        ("cuda", False, {}, 5, (False, "contiguous_format", True, True)),  # 3D: not measured yet, off under auto
        ("cuda", False, {"channels_last": True}, 5, (True, "channels_last_3d", True, True)),
        ("cuda", False, {}, 3, (False, "contiguous_format", True, True)),  # the coarse DNN's (B, N, K)
        ("cuda", True, {}, 4, (True, "channels_last", False, False)),
        ("cuda", True, {"tf32": True}, 4, (True, "channels_last", True, False)),
        (
            "cuda",
            False,
            {"channels_last": False, "tf32": False, "cudnn_benchmark": False},
            4,
            (False, None, False, False),
        ),
        ("cpu", False, {}, 4, (False, "contiguous_format", False, False)),
        ("cpu", False, {"channels_last": True}, 4, (True, "channels_last", False, False)),
        ("cpu", False, {"channels_last": True}, 5, (True, "channels_last_3d", False, False)),
    ],
)
def test_the_policy_follows_the_device_and_deterministic(device, deterministic, settings, dims, expected):
    policy = gpu.resolve_policy(device, deterministic=deterministic, input_dims=dims, **settings)
    layout, fmt, tf32, benchmark = expected
    assert policy["channels_last"] is layout and policy["tf32"] is tf32 and policy["cudnn_benchmark"] is benchmark
    assert policy["memory_format"] == (fmt or "contiguous_format")


def test_autotuning_under_deterministic_and_bad_values_are_refused(make_cfg):
    with pytest.raises(ValueError, match="cudnn_benchmark=true .* trainer.deterministic=true"):
        gpu.resolve_policy("cuda", deterministic=True, cudnn_benchmark=True)
    for override, message in [
        ("engine.cudnn_benchmark=true trainer.deterministic=true", "set engine.cudnn_benchmark=auto"),
        ("engine.channels_last=yes", "engine.channels_last must be auto, true or false"),
        ("engine.data_on_device=maybe", "engine.data_on_device must be auto, true or false"),
        ("engine.device_data_fraction=1.5", r"engine.device_data_fraction must be a fraction in \(0, 1\]"),
        ("engine.compile=auto", "engine.compile must be true"),
        ("engine.profile_steps=-1", "engine.profile_steps must be a whole number >= 0"),
        ("+engine.cuda_graphs=true", r"engine.cuda_graphs=True is not a setting .* the engine settings are"),
        ("+trainer.profiler=simple", "engine.profile_steps=N"),
    ]:
        with pytest.raises(ValueError, match=message):
            RunSettings.from_config(make_cfg(*override.split()))


def _legacy_tf32() -> tuple:
    """What Lightning Fabric and inductor read (torch 2.9+ raises in them after some settings of the new API)."""
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )


def test_math_flags_are_set_for_a_cuda_training_and_restored_after_it():
    def flags():
        return [gpu.tf32_state(), torch.backends.cudnn.benchmark]

    before = flags()
    policy = gpu.resolve_policy("cuda", input_dims=4)  # torch's flags need no GPU to be set
    with gpu.math_flags(policy, "cuda"):
        assert _legacy_tf32() == ("high", True, True) and torch.backends.cudnn.benchmark is True
        assert torch.backends.cuda.matmul.fp32_precision == "tf32" == torch.backends.cudnn.conv.fp32_precision
    assert flags() == before
    with gpu.math_flags(policy, "cpu"):
        assert flags() == before  # nothing touched off CUDA


def test_tf32_set_by_ddcnn_leaves_both_of_torchs_apis_readable():
    """Inside a CUDA training (TF32 on, or off under deterministic) and after it, the legacy readers work; flags a
    caller set through the new API come back exactly as it set them."""
    before = gpu.tf32_state()
    legacy = _legacy_tf32()
    try:
        for deterministic in (False, True):
            policy = gpu.resolve_policy("cuda", deterministic=deterministic, input_dims=4)
            with gpu.math_flags(policy, "cuda"):
                on = not deterministic
                assert _legacy_tf32() == ("high" if on else "highest", on, on)
            assert _legacy_tf32() == legacy and gpu.tf32_state() == before
        # A caller that chose TF32 through fp32_precision (after which torch itself refuses the legacy reads).
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        chosen = gpu.tf32_state()
        with gpu.math_flags(gpu.resolve_policy("cuda", deterministic=True), "cuda"):
            assert _legacy_tf32() == ("highest", False, False)
        assert gpu.tf32_state() == chosen
        assert (
            torch.backends.cuda.matmul.fp32_precision == "tf32" and torch.backends.cudnn.conv.fp32_precision == "ieee"
        )
    finally:
        gpu.restore_tf32(before)
    assert _legacy_tf32() == legacy


def test_channels_last_on_cpu_trains_as_the_default_layout_and_is_recorded(make_cfg, tmp_path):
    plain_net, last_net = _Recording(), _Recording()
    plain = _fit(make_cfg, tmp_path / "plain", net=plain_net)
    last = _fit(make_cfg, tmp_path / "last", "engine.channels_last=true", net=last_net)
    assert plain.engine["channels_last"] is False and not any(plain_net.layouts)
    assert last.engine["channels_last"] is True and last.engine["memory_format"] == "channels_last"
    assert last_net.layouts and all(last_net.layouts)  # every training step ran channels-last
    assert last.best_epoch == plain.best_epoch and last.best_metric == pytest.approx(plain.best_metric, abs=1e-6)
    for a, b in zip(plain.history, last.history, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
    assert all(p.is_contiguous() for p in last.net.parameters())  # handed back in the caller's layout
    assert last.engine["tf32"] is False and last.engine["cudnn_benchmark"] is False  # cpu


def test_a_stage_records_the_device_the_policy_and_no_gpu_memory_on_cpu(make_cfg):
    cfg = make_cfg("stage=local", "subdomain=0")  # device=auto
    train(cfg)
    meta = RunDir(cfg.paths.run_dir).meta("local", 0)
    assert meta["device"] == resolve_device("auto") == "cpu"
    check = _gpu_check()
    assert set(check.engine_policy(meta)) == set(check.ENGINE_KEYS)
    assert meta["engine"]["data_placement"] == "host" and meta["engine"]["channels_last"] is False
    assert meta["gpu_peak_memory_bytes"] is None and check.peak_memory_from_meta(meta) == (None, None)


# --- peak GPU memory -------------------------------------------------------------------------------------------------
def test_peak_memory_is_counted_on_cuda_only(monkeypatch):
    assert gpu.peak_memory_bytes("cpu") is None and gpu.free_memory_bytes("cpu") is None
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**20)
    gpu.reset_peak_memory("cpu")
    assert calls == []
    gpu.reset_peak_memory("cuda:1")
    assert calls == [("reset", torch.device("cuda:1"))] and gpu.peak_memory_bytes("cuda:1") == 3 * 2**20
    meta = {"gpu_peak_memory_bytes": gpu.peak_memory_bytes("cuda:1")}
    assert _gpu_check().peak_memory_from_meta(meta) == (3.0, "gpu_peak_memory_bytes")


# --- where the data live ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "device", "nbytes", "free", "expected"),
    [
        ("auto", "cuda:0", 100, 1000, "device"),
        ("auto", "cuda:0", 600, 1000, "pinned"),  # more than half the free memory
        ("auto", "cuda:0", None, 1000, "host"),  # not stored splits (the coarse DNN's tensors): as they are
        (True, "cuda:0", None, 1000, "host"),
        ("auto", "cpu", 100, None, "host"),
        (True, "cpu", 100, None, "device"),
        (True, "cuda", 10**12, 1000, "device"),
        (False, "cuda", 100, 1000, "pinned"),
        (False, "cpu", 100, None, "host"),
    ],
)
def test_the_data_placement_follows_the_device_and_the_free_memory(mode, device, nbytes, free, expected):
    assert gpu.data_placement(mode, device, nbytes, free, 0.5) == expected


@pytest.mark.parametrize("spatial", [(12, 16), (6, 8, 10)], ids=["2d", "3d"])
@pytest.mark.parametrize("augment", [None, Augment(flip_axes=(0, 1), rotate_deg=10, seed=3)], ids=["plain", "aug"])
def test_batches_held_on_the_device_are_bitwise_those_streamed(spatial, augment):
    data = _prepared(spatial)
    dec = Decomposition((2,) * len(spatial), spatial, 1)
    idx, val = torch.tensor([7, 0, 31, 12, 5]), torch.tensor([3, 0, 4])
    for box in (None, dec.box(0), dec.box(dec.num_subdomains - 1)):
        streamed = PreparedBatches(data, 8, seed=1, box=box, augment=augment)
        placed, where = gpu.place_data(streamed, "cpu", True, 0.5)  # data_on_device=true: held as device tensors
        assert where == "device" and placed.data.stored["train"] is not data.stored["train"]
        assert placed.data.stored["test"] is data.stored["test"]  # only what the training reads
        for epoch in (0, 2):
            (a, ya), (b, yb) = streamed.train_batch(idx, epoch, "cpu"), placed.train_batch(idx, epoch, "cpu")
            assert torch.equal(a, b) and torch.equal(ya, yb)
        (a, ya), (b, yb) = streamed.eval_batch("val", val, "cpu"), placed.eval_batch("val", val, "cpu")
        assert torch.equal(a, b) and torch.equal(ya, yb)
    subset = RowSubset(streamed, {"train": torch.arange(0, 35, 2)})
    placed, where = gpu.place_data(subset, "cpu", True, 0.5)
    assert where == "device" and torch.equal(placed.train_batch(val, 1, "cpu")[0], subset.train_batch(val, 1, "cpu")[0])


def test_a_training_on_data_held_on_the_device_is_the_streamed_training(make_cfg, tmp_path):
    streamed = _fit(make_cfg, tmp_path / "streamed", "engine.data_on_device=false")
    held = _fit(make_cfg, tmp_path / "held", "engine.data_on_device=true")
    assert streamed.engine["data_on_device"] is False and streamed.engine["data_placement"] == "host"
    assert held.engine["data_on_device"] is True and held.engine["data_placement"] == "device"
    times = [row["time_s"] for row in held.history]
    assert held.history == [{**row, "time_s": t} for row, t in zip(streamed.history, times, strict=True)]


def test_prefetching_reads_the_next_batch_in_the_background_and_changes_nothing():
    threads = []

    def fetch(i):
        threads.append(threading.current_thread().name)
        return i * i

    assert list(gpu.prefetched(fetch, range(5), enabled=False)) == [(i, i * i) for i in range(5)]
    assert set(threads) == {threading.current_thread().name}
    threads.clear()
    assert list(gpu.prefetched(fetch, range(5), enabled=True)) == [(i, i * i) for i in range(5)]
    assert all(name.startswith("ddcnn-prefetch") for name in threads)


# --- opt-ins ---------------------------------------------------------------------------------------------------------
def test_profile_steps_writes_a_chrome_trace_of_that_many_steps(make_cfg, tmp_path):
    result = _fit(make_cfg, tmp_path / "prof", "engine.profile_steps=2")
    trace = json.loads((tmp_path / "prof" / "profile" / "trace.json").read_text())
    assert trace["traceEvents"] and result.engine["profile_steps"] == 2
    _fit(make_cfg, tmp_path / "none")
    assert not (tmp_path / "none" / "profile").exists()


def test_compile_compiles_the_network_outside_the_training_clock(make_cfg, tmp_path, monkeypatch):
    # torch.compile of even a tiny convnet takes about two minutes of CPU here (inductor builds C++ kernels), so the
    # compiler is replaced by a recorder that takes a measurable time: what is checked is the plumbing and the clock.
    compiled = []

    def recording_compile(net, **kwargs):
        compiled.append(net)
        original = net.forward

        def slow_first_forward(*args):
            if len(compiled) == 1:
                compiled.append("compiled")
                time.sleep(0.3)
            return original(*args)

        net.forward = slow_first_forward
        return net

    monkeypatch.setattr(torch, "compile", recording_compile)
    net = _Recording()
    result = _fit(make_cfg, tmp_path / "compiled", "engine.compile=true", net=net)
    assert compiled[0] is net and result.engine["compile"] is True
    assert result.compile_time_s >= 0.3 and result.warmup_s >= 0.3
    plain = _fit(make_cfg, tmp_path / "plain")
    assert plain.engine["compile"] is False and plain.compile_time_s is None and len(compiled) == 2


def test_the_streamed_cuda_path_pins_every_batch_and_prefetches_without_changing_the_training(
    make_cfg, tmp_path, monkeypatch
):
    # Pinned memory needs a GPU; on CPU torch's pinned allocator and pin_memory are stood in for (recording what they
    # do), so that the path a CUDA run takes when its splits do not fit (batches gathered into pinned memory, the next
    # one read by a background thread) runs here.
    from ddcnn.data import datamodule

    plain = _fit(make_cfg, tmp_path / "plain")
    staged, copied, threads = [], [], set()

    def pinned_empty(shape, dtype):
        staged.append(torch.empty(shape, dtype=dtype))
        threads.add(threading.current_thread().name)
        return staged[-1]

    def pin_memory(tensor):  # as torch's: the tensor itself when it is pinned already, else a pinned copy
        if any(tensor.data_ptr() == buffer.data_ptr() for buffer in staged):
            return tensor
        copied.append(tensor.shape)
        return tensor.clone()

    monkeypatch.setattr(datamodule, "pinned_empty", pinned_empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(gpu, "data_placement", lambda *args, **kwargs: "pinned")
    streamed = _fit(make_cfg, tmp_path / "pinned")
    assert streamed.engine["data_placement"] == "pinned" and streamed.engine["prefetch"] is True
    assert staged and any(name.startswith("ddcnn-prefetch") for name in threads)
    assert copied == []  # every batch (images, labels) was gathered into pinned memory: one host copy each
    times = [row["time_s"] for row in streamed.history]
    assert streamed.history == [{**row, "time_s": t} for row, t in zip(plain.history, times, strict=True)]


def test_compile_is_warmed_up_on_every_batch_shape_and_counts_recompiles_in_the_clock(tmp_path, monkeypatch):
    """20 training samples in batches of 8: 8, 8 and a partial 4. The warm-up compiles both shapes outside the clock,
    so the epochs compile nothing (``compile_recompiles`` 0, recorded with the policy in meta.json's ``engine``).
    Real dynamo with its ``aot_eager`` backend: inductor would spend minutes building C++ kernels on this CPU."""
    import functools

    from torch._dynamo.utils import counters

    from ddcnn.data.datamodule import TensorDataModule
    from ddcnn.engine.loop import fit_batches
    from ddcnn.settings import LoopSettings

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    x = {s: torch.randn(20, 1, 6, 6) for s in ("train", "val", "test")}
    y = {s: torch.arange(20) % 3 for s in x}
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(32, 3))
    sgd = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}
    before = counters["frames"]["ok"]
    data = TensorDataModule(x, y, 8, eval_batch_size=16)
    result = fit_batches(net, data, tmp_path, LoopSettings(optimizer=sgd, max_epochs=2, compile=True))
    assert result.engine["compile"] is True and result.compile_time_s > 0
    assert counters["frames"]["ok"] - before >= 2  # the full batch and the tail were compiled ...
    assert result.engine["compile_recompiles"] == 0  # ... in the warm-up, none in the training's clock
    plain = fit_batches(net, TensorDataModule(x, y, 8), tmp_path / "plain", LoopSettings(optimizer=sgd, max_epochs=1))
    assert "compile_recompiles" not in plain.engine


def test_the_local_nets_of_a_process_share_one_device_copy_of_the_splits():
    """Two local nets (two boxes) and the global CNN placed on the same device: one copy of the stored splits, made
    by the first placement; placing again adds no bytes; released on demand and with the host data."""
    import gc

    from ddcnn.data.datamodule import _DEVICE_COPIES, release_device_copies

    data = _prepared((12, 16))
    dec = Decomposition((2, 2), (12, 16), 1)
    nets = [PreparedBatches(data, 8, box=dec.box(i)) for i in range(2)] + [PreparedBatches(data, 8)]
    assert nets[0].placed_nbytes("cpu") == data.nbytes("train") + data.nbytes("val") > 0
    placed = [gpu.place_data(net, "cpu", True, 0.5)[0] for net in nets]
    assert placed[0].data.stored["train"] is not data.stored["train"]  # a copy ...
    assert all(p.data.stored["train"] is placed[0].data.stored["train"] for p in placed)  # ... one for all
    assert all(p._labels["val"] is placed[0]._labels["val"] for p in placed)
    assert nets[1].placed_nbytes("cpu") == 0 and nets[1].placed_nbytes("meta") > 0
    idx = torch.tensor([3, 0, 9])
    assert torch.equal(placed[1].train_batch(idx, 0, "cpu")[0], nets[1].train_batch(idx, 0, "cpu")[0])
    release_device_copies(data)
    again = gpu.place_data(nets[0], "cpu", True, 0.5)[0]
    assert again.data.stored["train"] is not placed[0].data.stored["train"]
    del data, nets, placed, again
    gc.collect()
    assert not any(key.image_shape == (12, 16) for key in _DEVICE_COPIES)  # gone with the host data


def test_sync_debug_mode_is_asked_for_cuda_trainings_only_and_bad_values_are_refused(monkeypatch):
    """DDCNN_SYNC_DEBUG turns torch's CUDA sync debug mode on around a CUDA training's steps (bench/gpu_check.py runs
    its loop section under it); torch cannot set the mode without a GPU, so here only the decision is checked."""
    from ddcnn.engine.gpu import sync_debug_mode

    monkeypatch.delenv("DDCNN_SYNC_DEBUG", raising=False)
    assert sync_debug_mode(torch.device("cuda", 0)) is None
    monkeypatch.setenv("DDCNN_SYNC_DEBUG", "error")
    assert sync_debug_mode(torch.device("cuda", 0)) == "error" and sync_debug_mode(torch.device("cpu")) is None
    monkeypatch.setenv("DDCNN_SYNC_DEBUG", "loud")
    with pytest.raises(ValueError, match="DDCNN_SYNC_DEBUG='loud': use warn or error"):
        sync_debug_mode(torch.device("cuda", 0))
