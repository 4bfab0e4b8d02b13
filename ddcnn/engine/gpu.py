"""How ddcnn's loop uses a GPU: memory format, TF32, cuDNN autotuning, peak memory, where the data live, and the
opt-ins ``torch.compile`` and ``torch.profiler``.

Every decision is a function of the device (and the settings), so that the CUDA path is the code a CPU test runs:

- :func:`resolve_policy`: ``engine.channels_last``, ``tf32`` and ``cudnn_benchmark`` (``auto``: on for CUDA, TF32 and
  autotuning off under ``trainer.deterministic``, channels-last for 2D only; off on CPU unless ``true``), and the
  memory format of 4D/5D inputs;
- :func:`math_flags`: torch's global TF32 and ``cudnn.benchmark`` flags within one training, restored afterwards;
- :func:`reset_peak_memory` / :func:`peak_memory_bytes`: a training's peak GPU memory (``None`` off CUDA);
- :func:`data_placement` / :func:`place_data`: the stored (compact) splits on the device when they fit
  ``engine.device_data_fraction`` of its free memory, else pinned host batches copied with ``non_blocking``;
- :func:`prefetched`: the next batch read by a background thread while the current one trains;
- :func:`amp_optimizer`: a fused optimizer under ``16-mixed`` on CUDA, so that the loss scaler's check for infinite
  gradients stays on the device (no host read of ``found_inf`` per step);
- :func:`profiled`: ``torch.profiler`` over the first ``engine.profile_steps`` training steps, a Chrome trace.

The policy a training ran under is returned with its result and written to every stage's ``meta.json`` (``engine``),
under the names ``bench/gpu_check.py`` reads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PLACEMENTS",
    "POLICY_OFF",
    "resolve_policy",
    "memory_format",
    "math_flags",
    "tf32_state",
    "set_tf32",
    "restore_tf32",
    "reset_peak_memory",
    "peak_memory_bytes",
    "free_memory_bytes",
    "data_placement",
    "place_data",
    "prefetched",
    "amp_optimizer",
    "profiled",
    "SYNC_DEBUG_ENV",
    "sync_debug_mode",
    "on_training_stream",
    "under_sync_debug",
    "compiled_frames",
    "batches_ahead",
]

# Where a training's batches come from: stored splits on the device, pinned host memory (CUDA), plain host memory.
PLACEMENTS = ("device", "pinned", "host")
# What a training gets when no GPU policy is given (fit_batches called directly, e.g. the coarse DNN): nothing on.
POLICY_OFF: dict[str, Any] = {
    "channels_last": False,
    "tf32": False,
    "cudnn_benchmark": False,
    "data_on_device": False,
    "device_data_fraction": 0.5,
    "compile": False,
    "profile_steps": 0,
}
_FORMATS = {4: "channels_last", 5: "channels_last_3d"}


def _switch(value: Any, auto: bool, what: str) -> bool:
    if value == "auto":
        return auto
    if isinstance(value, bool):
        return value
    raise ValueError(f"engine.{what} must be auto, true or false, got {value!r}.")


def resolve_policy(
    device: str | torch.device,
    *,
    deterministic: bool = False,
    channels_last: str | bool = "auto",
    tf32: str | bool = "auto",
    cudnn_benchmark: str | bool = "auto",
    compile: bool = False,
    input_dims: int | None = None,
) -> dict[str, Any]:
    """The GPU policy of one training (pure: no GPU needed to ask what a CUDA run would do).

    Args:
        device: Where it trains.
        deterministic: ``trainer.deterministic``: ``auto`` keeps TF32 and cuDNN autotuning off.
        channels_last, tf32, cudnn_benchmark: ``auto``, ``True`` or ``False`` (``engine.*``); ``channels_last=auto``
            is on for 2D convnets on CUDA only (3D: ``True`` opts in).
        compile: ``engine.compile``.
        input_dims: Dimensions of a batch of network inputs (4: images, 5: volumes; the channels-last formats exist
            for those only, so ``channels_last`` is off for anything else, e.g. the coarse DNN's ``(B, N, K)``).

    Returns:
        ``channels_last``, ``memory_format`` (``channels_last``, ``channels_last_3d`` or ``contiguous_format``),
        ``tf32``, ``cudnn_benchmark``, ``compile``.

    Raises:
        ValueError: For ``cudnn_benchmark=True`` with ``deterministic`` (autotuning picks algorithms by timing).
    """
    cuda = torch.device(device).type == "cuda"
    # auto: channels-last for 2D convnets on CUDA (cuDNN's documented preference for 4D NHWC convolutions and batch
    # norm); not for 3D until bench/gpu_check.py measures cuDNN's NDHWC kernels against NCDHW (``true`` opts in).
    layout = _switch(channels_last, cuda and input_dims == 4, "channels_last") and input_dims in _FORMATS
    benchmark = _switch(cudnn_benchmark, cuda and not deterministic, "cudnn_benchmark")
    if benchmark and deterministic:
        raise ValueError(
            "engine.cudnn_benchmark=true picks cuDNN's algorithms by timing them, which trainer.deterministic=true "
            "forbids: set engine.cudnn_benchmark=auto or false."
        )
    return {
        "channels_last": bool(layout),
        "memory_format": _FORMATS[input_dims] if layout else "contiguous_format",
        "tf32": _switch(tf32, cuda and not deterministic, "tf32"),
        "cudnn_benchmark": benchmark,
        "compile": bool(compile),
    }


def memory_format(policy: Mapping[str, Any]) -> torch.memory_format:
    """The torch memory format a resolved policy names."""
    return getattr(torch, str(policy.get("memory_format", "contiguous_format")))


def _fp32_precision_switches() -> list[tuple[object, str]]:
    """``(object, "fp32_precision")`` of torch's per-backend precision switches (torch 2.9 on; none before)."""
    cudnn, mkldnn = torch.backends.cudnn, torch.backends.mkldnn
    objs = [torch.backends.cuda.matmul, getattr(cudnn, "conv", None), getattr(cudnn, "rnn", None)]
    objs.append(getattr(mkldnn, "matmul", None))  # the legacy matmul setter sets oneDNN's too
    return [(obj, "fp32_precision") for obj in objs if obj is not None and hasattr(obj, "fp32_precision")]


# The legacy readers of the TF32 flags, which Lightning Fabric and inductor call: torch 2.9+ raises a RuntimeError in
# them once a flag was set through ``fp32_precision`` to a value they cannot express.
_LEGACY_TF32 = {
    "matmul": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "cudnn": (
        lambda: torch.backends.cudnn.allow_tf32,
        lambda value: setattr(torch.backends.cudnn, "allow_tf32", value),
    ),
}


def tf32_state() -> dict[str, Any]:
    """torch's TF32 flags as they are: the per-backend ``fp32_precision`` values and what the legacy readers say
    (``torch.get_float32_matmul_precision()``, ``torch.backends.cudnn.allow_tf32``; a reader that raises is left
    out)."""
    state: dict[str, Any] = {"fp32_precision": [getattr(obj, name) for obj, name in _fp32_precision_switches()]}
    for key, (read, _) in _LEGACY_TF32.items():
        with contextlib.suppress(RuntimeError):
            state[key] = read()
    return state


def set_tf32(enabled: bool) -> None:
    """TF32 for CUDA matmuls and cuDNN convolutions on or off, set through the legacy API
    (``torch.set_float32_matmul_precision``, ``torch.backends.cudnn.allow_tf32``), which sets the ``fp32_precision``
    switches too and, unlike setting those directly, leaves every reader of either API working."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = bool(enabled)


def restore_tf32(state: Mapping[str, Any]) -> None:
    """The flags as :func:`tf32_state` found them: the values the legacy readers returned through the legacy setters
    (torch keeps a value of its own for them), then the ``fp32_precision`` values exactly."""
    for key, (_, write) in _LEGACY_TF32.items():
        if key in state:
            write(state[key])
    for (obj, name), value in zip(_fp32_precision_switches(), state["fp32_precision"], strict=True):
        setattr(obj, name, value)


@contextlib.contextmanager
def math_flags(policy: Mapping[str, Any], device: str | torch.device) -> Iterator[None]:
    """torch's TF32 and ``cudnn.benchmark`` flags as ``policy`` says within the block, restored after it. Process-wide
    flags, so set for the training only: a later training (or the caller) finds them as they were. TF32 is set so
    that both torch's APIs keep reading it (:func:`set_tf32`). Off CUDA nothing is touched (the flags steer CUDA
    kernels only)."""
    if torch.device(device).type != "cuda":
        yield
        return
    saved, benchmark = tf32_state(), torch.backends.cudnn.benchmark
    try:
        set_tf32(bool(policy["tf32"]))
        torch.backends.cudnn.benchmark = bool(policy["cudnn_benchmark"])
        yield
    finally:
        torch.backends.cudnn.benchmark = benchmark
        restore_tf32(saved)


# --- memory -------------------------------------------------------------------------------------------------------
def reset_peak_memory(device: str | torch.device) -> None:
    """Start counting the peak GPU memory of ``device`` afresh (nothing off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: str | torch.device) -> int | None:
    """The most memory torch's allocator held on ``device`` since :func:`reset_peak_memory`; ``None`` off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def free_memory_bytes(device: str | torch.device) -> int | None:
    """Free memory of a CUDA device (``None`` for any other device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


# --- the data -----------------------------------------------------------------------------------------------------
def data_placement(
    mode: str | bool, device: str | torch.device, nbytes: int | None, free_bytes: int | None, fraction: float = 0.5
) -> str:
    """Where a training's batches come from (one of :data:`PLACEMENTS`).

    Args:
        mode: ``engine.data_on_device``: ``auto`` (on the device when it is CUDA and the splits fit), ``True`` (on the
            device, whichever it is: on CPU the stored splits are simply held as tensors there) or ``False``.
        device: Where it trains.
        nbytes: Bytes the splits take on the device; ``None`` when the data cannot be placed (not stored splits:
            then ``host``, the source reads its batches as it does).
        free_bytes: Free device memory (``None``: unknown).
        fraction: ``engine.device_data_fraction``: the share of the free memory they may take.
    """
    cuda = torch.device(device).type == "cuda"
    streamed = "pinned" if cuda else "host"
    if nbytes is None:  # not stored splits (the coarse DNN's tensors): read as they are
        return "host"
    if mode is False:
        return streamed
    if mode is True:
        return "device"
    if mode != "auto":
        raise ValueError(f"engine.data_on_device must be auto, true or false, got {mode!r}.")
    fits = cuda and free_bytes is not None and nbytes <= float(fraction) * free_bytes
    return "device" if fits else streamed


def place_data(data: Any, device: str | torch.device, mode: str | bool, fraction: float) -> tuple[Any, str]:
    """``data`` (a :class:`~ddcnn.data.datamodule.Batches`) as :func:`data_placement` decides, and the placement.

    A source that can be placed has ``placed(device, pin) -> Batches`` and ``placed_nbytes(device) -> int`` (the
    bytes placing it would add on ``device``: 0 when this process holds them there already)
    (:class:`~ddcnn.data.datamodule.PreparedBatches`, :class:`~ddcnn.data.datamodule.RowSubset`); any other source
    is read as it is (its batches still reach the device with ``non_blocking`` copies).
    """
    device = torch.device(device)
    placeable = callable(getattr(data, "placed", None)) and callable(getattr(data, "placed_nbytes", None))
    nbytes = data.placed_nbytes(device) if placeable else None
    where = data_placement(mode, device, nbytes, free_memory_bytes(device), fraction)
    if where == "host":
        return data, where
    if where == "device":
        return data.placed(device, pin=False), where
    return data.placed(None, pin=True), where


def prefetched(fetch: Callable[[Any], Any], items: Iterable[Any], enabled: bool) -> Iterator[tuple[Any, Any]]:
    """``(item, fetch(item))`` for every item, the next one fetched by a background thread while the caller works on
    the current one (``enabled``; else one after the other). ``fetch`` must not depend on global random state: the
    batches of ddcnn depend on ``(sample, epoch)`` only, so they are the same either way."""
    items = list(items)
    if not enabled or len(items) < 2:
        for item in items:
            yield item, fetch(item)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddcnn-prefetch") as pool:
        ahead = pool.submit(fetch, items[0])
        for k, item in enumerate(items):
            value = ahead.result()
            if k + 1 < len(items):
                ahead = pool.submit(fetch, items[k + 1])
            yield item, value


# --- the optimizer under a loss scaler -----------------------------------------------------------------------------
# torch's optimizers that step with a loss scaler's state on the device when ``fused=True``
# (``optimizer._step_supports_amp_scaling``): GradScaler hands them ``grad_scale`` and ``found_inf`` as tensors and the
# fused kernel unscales and skips a step with infinite gradients itself.
_AMP_FUSED = ("Adam", "AdamW", "SGD")


def _torch_optimizer(target: Any) -> str | None:
    """The name of the torch optimizer a Hydra ``_target_`` names (``torch.optim.AdamW``, ``torch.optim.sgd.SGD``),
    else ``None``."""
    module, _, name = str(target).rpartition(".")
    return name if module.split(".")[:2] == ["torch", "optim"] and hasattr(torch.optim, name) else None


def amp_optimizer(spec: Any, device: str | torch.device, precision: str, gradient_clip_val: float | None) -> Any:
    """The optimizer node a training builds: ``spec`` with ``fused: true`` added where that keeps the loss scaler's
    per-step check on the device, else ``spec`` as it is.

    Under ``16-mixed`` the loss scaler (``torch.amp.GradScaler.step``) reads ``found_inf`` on the host before every
    optimizer step (a device synchronisation per step) unless the optimizer unscales and skips the step itself,
    which torch's Adam, AdamW and SGD do with ``fused=True``. So a node of one of those gets ``fused: true`` when the
    training runs on CUDA under ``16-mixed``, without gradient clipping (Lightning Fabric unscales the gradients
    before clipping them, which it refuses for such an optimizer) and when the node says nothing of ``fused`` or
    ``foreach`` (its choice stands) nor asks for ``differentiable``. Anywhere else nothing changes: on CPU the
    optimizer is exactly the one the node asks for (a fused step rounds differently from the loop over the
    parameters: about 1e-8 after 20 Adam steps), so CPU results stay bitwise as they were.

    Args:
        spec: A plain Hydra ``_partial_`` mapping (``{_target_: torch.optim.SGD, _partial_: true, lr: ...}``) or a
            callable ``params -> Optimizer`` (returned as it is).
        device: Where it trains.
        precision: ``trainer.precision``.
        gradient_clip_val: ``trainer.gradient_clip_val`` (``None``: no clipping).

    Raises:
        ValueError: For ``fused: true`` in the node with ``16-mixed`` and gradient clipping, which cannot run together
            (Fabric would fail at the first clipped step).
    """
    if not isinstance(spec, Mapping) or precision != "16-mixed":
        return spec
    if gradient_clip_val is not None and spec.get("fused"):
        raise ValueError(
            f"the optimizer {spec.get('_target_')} with fused: true unscales its gradients inside its step, so "
            f"trainer.gradient_clip_val={gradient_clip_val} cannot clip them under trainer.precision=16-mixed: set "
            f"fused: false in its optimizer node (e.g. optimizer.fused=false), or use trainer.precision=bf16-mixed, or "
            f"trainer.gradient_clip_val=null."
        )
    chosen = ("fused", "foreach", "differentiable")
    if (
        torch.device(device).type != "cuda"
        or gradient_clip_val is not None
        or _torch_optimizer(spec.get("_target_")) not in _AMP_FUSED
        or any(key in spec for key in chosen)
    ):
        return spec
    return {**spec, "fused": True}


# --- profiling ----------------------------------------------------------------------------------------------------
class profiled:
    """``torch.profiler`` over the first ``steps`` training steps (``step()`` after each), then a Chrome trace in
    ``path`` (written when the steps are done or the training ends first). ``steps=0``: nothing."""

    def __init__(self, steps: int, path: Path, device: str | torch.device) -> None:
        self.steps, self.path, self.done = int(steps), Path(path), 0
        self._prof = None
        if self.steps > 0:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.device(device).type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.__enter__()

    @property
    def active(self) -> bool:
        return self._prof is not None

    def step(self) -> None:
        if self._prof is None:
            return
        self.done += 1
        if self.done >= self.steps:
            self.close()

    def close(self) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp.json")
        prof.export_chrome_trace(str(tmp))
        json.loads(tmp.read_text())  # a trace Chrome cannot read is an error here, not in the user's browser
        tmp.replace(self.path)


# --- debugging and compile counters of a CUDA training ------------------------------------------------------
SYNC_DEBUG_ENV = "DDCNN_SYNC_DEBUG"


def sync_debug_mode(device: torch.device) -> str | None:
    """``warn`` or ``error`` from ``$DDCNN_SYNC_DEBUG`` for a CUDA training (``None``: unset, or not CUDA)."""
    mode = os.environ.get(SYNC_DEBUG_ENV, "").strip().lower()
    if mode in ("", "0", "off", "default"):
        return None
    if mode not in ("warn", "error"):
        raise ValueError(f"{SYNC_DEBUG_ENV}={mode!r}: use warn or error (or leave it unset).")
    return mode if torch.device(device).type == "cuda" else None


def on_training_stream(items: Iterator, device: torch.device) -> Iterator:
    """``(idx, batch)`` of batches made on a side stream (``(idx, (batch, ready event))``), usable on the current
    stream: it waits for the event, and each tensor is recorded as used there."""
    current = torch.cuda.current_stream(device)
    for idx, (batch, ready) in items:
        current.wait_event(ready)
        for tensor in batch:
            tensor.record_stream(current)
        yield idx, batch


def under_sync_debug(items: Iterator, mode: str) -> Iterator:
    """``items``, with torch's CUDA sync debug mode ``mode`` while the caller works on each one."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield from items
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def compiled_frames() -> int:
    """Frames ``torch.compile`` (dynamo) has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def batches_ahead(
    fetch: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    batches: list[torch.Tensor],
    prefetch: bool,
    device: torch.device,
) -> Iterator[tuple[torch.Tensor, tuple]]:
    """``(idx, fetch(idx))`` of an epoch's training batches, the next one read by a background thread while this
    one trains when the batches stream from pinned host memory to a GPU (``prefetch``). On CUDA with
    ``DDCNN_SYNC_DEBUG`` set (``warn`` or ``error``), torch's sync debug mode is on while they are read and trained on
    (every step of the epoch, nothing after it): a host synchronisation there warns or fails.

    Streamed to a GPU, each batch is copied (and decoded) on a side stream, so that its copy overlaps the current
    batch's computation; the training stream waits for it (an event, no host synchronisation) and the batch's memory
    is marked as used there, so the allocator does not hand it out early."""
    side = torch.cuda.Stream(device) if prefetch and device.type == "cuda" else None

    def fetch_on_stream(idx: torch.Tensor) -> tuple:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            if side is None:
                return fetch(idx)
            with torch.cuda.stream(side):
                batch = fetch(idx)
                ready = torch.cuda.Event()
                ready.record(side)
            return batch, ready

    items = prefetched(fetch_on_stream, batches, prefetch)
    if side is not None:
        items = on_training_stream(items, device)
    mode = sync_debug_mode(device)
    return items if mode is None else under_sync_debug(items, mode)
