"""One unattended GPU check (issues 23, 34, 47): stacking probe, bare loop, ddcnn's loop, channels_last_3d,
SyncBatchNorm in DDP, end-to-end runs, the cost by image size, parallel.workers; under 6 min.

Sections, in this order (each prints as it goes; a section that raises is recorded and the next one still runs):

1. **stacking**: one local net per sub-domain of ``--probe-grid`` (default 16: MNIST 4x4 with overlap 1, 8x8
   sub-domains; the default local net ``vgg_small``, batch 128, the configured AdamW) trained one after another for
   ``--probe-steps`` steps each, against the same nets stacked into one training with
   ``torch.func.stack_module_state`` + ``functional_call`` + ``vmap`` (one AdamW over the stacked parameters).
   Same batches per net (real MNIST from ``$DDCNN_DATA/mnist.npz`` when present, else random), timed after
   warm-up (``torch.cuda.synchronize`` around the clock on CUDA). Prints net-steps/s of both and the ratio
   (sequential time / stacked time for the same work). First the check that it is the same computation: both
   ways trained ``--check-steps`` steps in float64 from the same initial weights on the same batches must end with
   the same weights and batch-norm buffers (every element within 1e-6 + 1e-6 |w|) and the same last-step
   gradients (within 1e-7 (|g| + the net's largest |g|)).

   Batch norm under ``vmap``: ``running_mean``/``running_var``/``num_batches_tracked`` are stacked with the
   parameters and passed with ``in_dims=0``, so inside ``vmap`` they are batched tensors and batch norm's in-place
   update of them in training mode is allowed (the batching rule updates each net's slice). PyTorch's "Patching
   Batch Norm" page (``torch.func.replace_all_batch_norm_modules_``, ``track_running_stats=False``) is about the
   other case, one unbatched module over batched inputs, where that update is an error; dropping the running
   statistics would train the same weights but leave the nets without the statistics they evaluate with. The check
   compares the buffers too.

   Why float64 and why those tolerances: the bias of a convolution followed by batch norm has a zero gradient in
   exact arithmetic, so Adam (update ~ lr g / (sqrt(v) + 1e-8)) turns the rounding noise of that gradient into
   steps: about lr in fp32, where such biases differ between any two summation orders; in float64 (noise
   ~1e-15) about 1e-9 per step (measured here: 3e-9 after 3 steps of vgg_small), hence the weights' 1e-6, which
   any real difference (another batch, a running statistic not written back: ~lr = 2e-3) exceeds by far. Adam is
   blind to a gradient's scale (a mean over the nets instead of a sum would train almost the same weights), so the
   gradients are compared too.
   With ``--probe-precisions fp32,bf16`` (the default on CUDA) it also times both ways under bf16 autocast and
   records whether autocast took effect inside ``vmap`` (it does not on CPU: pytorch/functorch#305).

2. **bare**: the global CNN (``vgg_small`` on 28x28 MNIST, batch 128, AdamW) in a bare PyTorch loop with the data on
   the device, per variant (``fp32``, ``bf16`` autocast, ``bf16+cl`` = bf16 and channels_last; the default on CUDA
   is all three, on CPU ``fp32``): images/s, step time and peak GPU memory, after warm-up.

3. **loop**: ddcnn's own loop (``fit_batches``) in this process, per variant of :data:`LOOP_VARIANTS` (all on
   CUDA; a CPU subset with ``--tiny``): 2D (MNIST) and 3D (random volumes), data held on the device and streamed
   from pinned memory (forced: ``engine.data_on_device=false``), ``32-true``, ``bf16-mixed`` and ``16-mixed``,
   ``torch.compile``, augmentation on the device; with ``DDCNN_SYNC_DEBUG=warn`` on CUDA (torch's sync debug mode
   around the training steps), so every host synchronisation in a step is counted: any is a failure, except in
   ``2d-device-16mixed-unfused`` (:data:`SYNCING_VARIANTS`). That one and ``2d-device-16mixed-sgd`` measure the
   loss scaler's per-step check: SGD without ``fused`` in its node, which the loop makes fused under ``16-mixed`` on
   CUDA (the scaler's ``found_inf`` stays on the device), against SGD with ``fused: false`` (the scaler reads
   ``found_inf`` on the host before every step): steps/s and host syncs per step of each. Per variant: images/s,
   the step time (median between batch fetches) and its ratio to the bare loop of the same precision and layout,
   peak memory, the placement used, the optimizer (fused or not) and the recompiles inside the clock.

4. **cl3d**: 3D convnets (``--cl3d-models``, default ``vgg_small`` and ``resnet10``, batch norm) in the bare loop on
   random 32x64x64 volumes held on the device, NCDHW against ``channels_last_3d`` (NDHWC), fp32 and bf16: step
   times, their ratio and peak memory, and a verdict: ``engine.channels_last=auto`` keeps 3D contiguous unless
   channels-last is at least :data:`CL3D_FASTER` times as fast in every row.

5. **syncbn**: batch norm over the global batch of 2 DDP ranks as ddcnn converts it
   (``ddcnn.engine.sync_norm.convert_batch_norm``: ``torch.nn.SyncBatchNorm`` on CUDA, ``GlobalBatchNorm`` on CPU),
   both ranks on this device with gloo (one GPU cannot hold two NCCL ranks; gloo reduces CUDA tensors through the
   host, so the step time is an upper bound): the float64 check that one DDP step gives the gradients and running
   statistics of one process on the whole batch (a failure otherwise), and the float32 step time against that one
   process.

6. **e2e**: ``ddcnn-train`` in subprocesses into temporary run directories, row ``digits`` (the default run) and
   row ``mnist_2x2`` (``data=mnist data.train_subset=... decomposition=2x2 trainer.max_epochs=...``), both with
   ``device=<--device>`` and ``trainer.precision=<--precision>`` (bf16-mixed on CUDA), and with
   ``engine.channels_last=true`` when the configuration has that setting (checked with ``ddcnn.config.compose``).
   From each stage's ``meta.json`` (and ``logs/metrics.csv`` for the steps run, else the configuration) and the
   run's ``results.json``: per stage time, images/s (training samples x epochs / fit time: validation and
   checkpoints are in the fit time), step time (fit time / steps) and peak GPU memory when ``meta.json`` records
   it (any numeric key whose name holds ``peak`` and ``mem``).

7. **size_cost**: ``bench/size_cost.py`` on this device (issue #47's cost curve): the global ``vgg_small`` against one
   local net of each grid, 2D 64² to 512² and 3D 32³ to 128³, overlap 0 and 2, batch 2, fp32: the per-step device
   time of each and their ratio (median of 3 measurements), what a step of each adds to the allocated memory beside
   the plan's saved-for-backward figure, and the FLOP ratio; rows that would start past the budget are planned only.
   With ``--tiny``: its four quick rows, timed once.

8. **workers**: the local stage (``ddcnn-train stage=local``, MNIST ``--workers-subset`` images, ``--workers-grid``
   4x4: 16 local nets, 1 epoch) with ``parallel.workers`` = each of ``--workers-counts`` (1,4), every worker on this
   device: sub-domains/s of training and of the stage's wall (worker start-up included), the device memory all
   processes held at their peak and one net's peak. Last, so that the budget cuts it first: run it on its own with
   ``--sections workers`` when it was skipped.

The header gives the machine (GPU, CUDA/cuDNN, torch, TF32 and ``cudnn.benchmark`` as found and as applied to the
in-process sections; the e2e subprocesses follow the package's own policy); a summary table ends the output;
everything is written to ``--out`` as JSON after every section. ``--budget-s`` is checked before each section and
row: what would start past it is skipped, and an e2e run is killed at it (reported, not a failure). Exit status 1
only on a real failure: an e2e run that fails, stacked weights that differ, a section that raised; 2 on bad usage.

    python bench/gpu_check.py                              # on a GPU machine: about 2-4 minutes
    python bench/gpu_check.py --tiny                       # CPU, tiny settings, seconds (the test runs this)
    python bench/gpu_check.py --device cpu --sections stacking --probe-steps 20

On this workplace's H200 machine (no package registry there) the image has torch, scikit-learn, scipy, filelock,
tqdm and PyYAML but not hydra-core, omegaconf or antlr4 (a digits run imports nothing else; nibabel is for NIfTI
data only). One command, in the checkout with its environment, prepares what that machine needs:

    python bench/gpu_check.py --prepare

copies those three pure-Python packages and ``packaging`` (which hydra imports; about 4 MB in all) from this
environment into ``bench/_vendor/`` (git-ignored;
this script puts it on its own path and the e2e runs' ``PYTHONPATH``, after anything installed) and MNIST into
``data/mnist.npz`` (ignored), and prints the run: ``carry=["bench/_vendor", "data/mnist.npz"]``, ``timeout_s`` about
420 and ``DDCNN_DATA=data PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --budget-s 360 --out $OUT/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import itertools
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This checkout's ddcnn, not whichever one the environment installed (the subprocesses get the same PYTHONPATH).
sys.path.insert(0, str(ROOT))
# The pure-Python packages --prepare copies for a machine that lacks them: after anything installed.
VENDOR = ROOT / "bench" / "_vendor"
VENDORED = ("hydra", "omegaconf", "antlr4", "packaging")  # hydra.version imports packaging
if VENDOR.is_dir():
    sys.path.append(str(VENDOR))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

# The float64 check (see the module docstring): every element of every weight and buffer within
# WEIGHT_ATOL + WEIGHT_RTOL |sequential value|, and of the last step's gradients within
# GRAD_TOL (|g| + max |g| of that net).
WEIGHT_ATOL, WEIGHT_RTOL, GRAD_TOL = 1e-6, 1e-6, 1e-7
ROWS = ("digits", "mnist_2x2")
SECTIONS = ("stacking", "bare", "loop", "cl3d", "syncbn", "e2e", "size_cost", "workers")
# The loop section's trainings: (name, spatial dims, where the data are, precision, compile, augmentation). "pinned"
# forces the streamed path (engine.data_on_device=false); 3D runs on synthetic volumes.
LOOP_VARIANTS = {
    "2d-device-bf16": (2, "device", "bf16-mixed", False, False),
    "2d-device-fp32": (2, "device", "32-true", False, False),
    "2d-pinned-16mixed": (2, "pinned", "16-mixed", False, False),
    "2d-device-compile": (2, "device", "bf16-mixed", True, False),
    "2d-device-aug": (2, "device", "bf16-mixed", False, True),
    "3d-device-bf16": (3, "device", "bf16-mixed", False, True),
    "3d-pinned-bf16": (3, "pinned", "bf16-mixed", False, False),
    "2d-device-16mixed-sgd": (2, "device", "16-mixed", False, False),
    "2d-device-16mixed-unfused": (2, "device", "16-mixed", False, False),
}
# Variants trained with another optimizer node than the configured one (AdamW, fused: true): SGD, which the loop makes
# fused under 16-mixed on CUDA (ddcnn.engine.gpu.amp_optimizer), and SGD with fused: false, whose loss scaler reads
# found_inf on the host before every step: the pair measures what that read costs (steps/s, host syncs).
SGD_NODE = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.05, "momentum": 0.9, "nesterov": True}
LOOP_OPTIMIZERS = {
    "2d-device-16mixed-sgd": SGD_NODE,
    "2d-device-16mixed-unfused": {**SGD_NODE, "fused": False},
}
# Variants whose steps synchronise with the host by design: the unfused optimizer under 16-mixed (see above).
SYNCING_VARIANTS = ("2d-device-16mixed-unfused",)
BARE_VARIANTS = ("fp32", "bf16", "bf16+cl")
# cl3d: channels_last_3d counts as faster from this ratio (contiguous step time / channels-last step time) on.
CL3D_FASTER = 1.05
# syncbn: the float64 check's bound on the gradients' and running statistics' largest relative difference; the ranks'
# time limit.
SYNCBN_TOL, SYNCBN_TIMEOUT_S = 1e-9, 180.0
# Settings every e2e row gets: the evaluate stage's figures and TorchScript export change no time in meta.json.
# Every row trains its global CNN: a copy reused from an earlier run (store.reuse) would time that run instead.
E2E_COMMON = ["trainer.enable_progress_bar=false", "report.plots=false", "report.export=false", "store.reuse=false"]
TINY_E2E = [
    "model=vgg_tiny",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "coarse.max_epochs=1",
    "data.train_subset=200",
    "data.test_subset=100",
    "methods.enabled.coarse_alt=false",
]
# Defaults of the flags that --tiny shrinks: (normal, tiny). The tiny ones run in seconds on a CPU.
DEFAULTS = {
    "threads": (0, 1),  # two threads on a loaded 2-core machine made a tiny step 10-20x slower than one
    "probe_grid": ("4,4", "2,2"),
    "probe_model": (None, "vgg_tiny"),
    "probe_batch": (None, 16),
    "probe_batches": (8, 2),
    "probe_steps": (100, 1),
    "probe_warmup": (5, 1),
    "probe_rounds": (2, 1),
    "check_steps": (3, 2),
    "bare_model": (None, "vgg_tiny"),
    "bare_batch": (None, 16),
    "bare_images": (20000, 64),
    "bare_steps": (300, 3),
    "bare_warmup": (30, 1),
    "loop_images": (20000, 48),
    "loop_epochs": (2, 1),
    "cl3d_models": ("vgg_small,resnet10", "vgg_tiny,resnet_tiny"),
    "cl3d_shape": ("32,64,64", "8,8,8"),
    "cl3d_batch": (16, 2),
    "cl3d_steps": (30, 2),
    "cl3d_warmup": (5, 1),
    "syncbn_model": ("vgg_small", "vgg_tiny"),
    "syncbn_batch": (64, 4),
    "syncbn_steps": (30, 2),
    "workers_counts": ("1,4", "1,2"),
}
# The loop's channels-last setting once issue 23's data-path piece adds it: the first of these the config has.
CHANNELS_LAST_KEYS = ("engine.channels_last", "trainer.channels_last")
# What a stage's meta.json may record of the engine's GPU policy (top level, or under "engine"/"gpu"/"cuda").
ENGINE_KEYS = ("channels_last", "memory_format", "tf32", "cudnn_benchmark", "compile", "data_on_device")


# --- small helpers --------------------------------------------------------------------------------------------
def log(text: str = "") -> None:
    print(text, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def autocast(device: torch.device, precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    if precision == "fp32":
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def fmt(value, spec: str = ".1f", missing: str = "-") -> str:
    """``value`` formatted by ``spec``; ``missing`` right-aligned to the spec's width when it is ``None``."""
    if value is None:
        width = "".join(itertools.takewhile(str.isdigit, spec))
        return missing.rjust(int(width or 0))
    return format(value, spec)


def compose(overrides: list[str]):
    from ddcnn.config import compose as ddcnn_compose

    return ddcnn_compose(overrides)


def make_net(cfg, in_channels: int = 1, num_classes: int = 10, spatial_dims: int = 2) -> nn.Module:
    """The configured network (``cfg.model``), built as :func:`ddcnn.context.build_local_net` builds it."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    spec = OmegaConf.to_container(cfg.model, resolve=True)
    spec.pop("name", None)
    spec.pop("weights", None)  # a pretrained weights file is loaded after building (ddcnn.context), never here
    return instantiate(spec, spatial_dims=spatial_dims, in_channels=in_channels, num_classes=num_classes)


def make_optimizer(cfg, params) -> torch.optim.Optimizer:
    from hydra.utils import instantiate

    return instantiate(cfg.optimizer)(params)


def mnist_images(path: Path, count: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``count`` MNIST training images ``(count, 1, 28, 28)``, standardised, and labels; random ones without it."""
    if path.is_file():
        import numpy as np

        with np.load(path) as archive:
            x = torch.from_numpy(archive["x_train"][:count].copy()).float().unsqueeze(1) / 255.0
            y = torch.from_numpy(archive["y_train"][:count].copy()).long()
        return (x - x.mean()) / x.std(), y, f"MNIST ({path})"
    gen = torch.Generator().manual_seed(0)
    return torch.randn(count, 1, 28, 28, generator=gen), torch.randint(10, (count,), generator=gen), "random"


# --- the machine ----------------------------------------------------------------------------------------------
def _read(getter: Callable[[], object]) -> object:
    try:
        return getter()
    except Exception as err:  # torch >= 2.9 refuses some reads of the legacy TF32 flags after the new API was used
        return f"unreadable ({type(err).__name__})"


def math_settings() -> dict:
    """TF32 and cuDNN settings of this process (the new ``fp32_precision`` API where torch has it)."""
    out: dict[str, object] = {
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
        "matmul_allow_tf32": _read(lambda: torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": _read(lambda: torch.backends.cudnn.allow_tf32),
    }
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        out["matmul_fp32_precision"] = _read(lambda: torch.backends.cuda.matmul.fp32_precision)
        out["conv_fp32_precision"] = _read(lambda: conv.fp32_precision)
    return out


def prepare_machine(vendor: Path = VENDOR, data_dir: Path = ROOT / "data") -> list[str]:
    """``--prepare``: copy :data:`VENDORED` from this environment into ``vendor`` and MNIST into ``data_dir``; the
    lines to print (what to carry, the command)."""
    import importlib

    vendor.mkdir(parents=True, exist_ok=True)
    lines = []
    for name in VENDORED:
        source = Path(importlib.import_module(name).__file__).parent
        target = vendor / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        lines.append(f"copied {source} -> {target}")
    candidates = [Path(os.environ["DDCNN_DATA"])] if os.environ.get("DDCNN_DATA") else []
    candidates.append(ROOT.parent / "shared" / "data")
    mnist = next((c / "mnist.npz" for c in candidates if (c / "mnist.npz").is_file()), None)
    if mnist is not None and mnist.resolve() != (data_dir / "mnist.npz").resolve():
        data_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(mnist, data_dir / "mnist.npz")
        lines.append(f"copied {mnist} -> {data_dir / 'mnist.npz'}")
    elif mnist is None:
        lines.append("no mnist.npz found (set DDCNN_DATA): the mnist row will be skipped")
    rel = os.path.relpath(vendor, ROOT)
    lines.append(
        f'run on the GPU machine with carry=["{rel}", "data/mnist.npz"], timeout_s about 420: DDCNN_DATA=data '
        f"PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --budget-s 360 --out $OUT/gpu_check.json"
    )
    return lines


def apply_math_policy(device: torch.device, tf32: str, benchmark: str) -> None:
    """TF32 and ``cudnn.benchmark`` for the in-process sections (``keep`` leaves torch's setting). TF32 as ddcnn's
    loop sets it (:func:`ddcnn.engine.gpu.set_tf32`), so that every reader of the flags keeps working."""
    from ddcnn.engine.gpu import set_tf32

    if device.type != "cuda":
        return
    if benchmark != "keep":
        torch.backends.cudnn.benchmark = benchmark == "on"
    if tf32 != "keep":
        set_tf32(tf32 == "on")


def machine(device: torch.device) -> dict:
    info: dict[str, object] = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "data_dir": os.environ.get("DDCNN_DATA"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
        )
        if shutil.which("nvidia-smi"):
            with contextlib.suppress(Exception):
                query = [
                    "nvidia-smi",
                    "--query-gpu=driver_version",
                    "--format=csv,noheader",
                    f"--id={device.index or 0}",
                ]
                info["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    with contextlib.suppress(Exception):
        git = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
        info["commit"] = subprocess.run(git, capture_output=True, text=True, timeout=20).stdout.strip() or None
    return info


# --- 1. stacking ----------------------------------------------------------------------------------------------
def stack(nets: list[nn.Module]) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A stateless copy of the architecture (on the meta device) and the nets' stacked parameters and buffers."""
    from torch.func import stack_module_state

    params, buffers = stack_module_state(nets)  # new leaf tensors (N, ...): the nets keep their own
    base = copy.deepcopy(nets[0]).to("meta")
    base.train()
    return base, params, buffers


def stacked_loss(base: nn.Module) -> Callable:
    """``(params, buffers, x (N, B, ...), y (B,)) -> (N,)``: every net's mean cross-entropy on its own inputs.

    The buffers are batched like the parameters, so batch norm's in-place update of its running statistics
    writes each net's slice of the stacked buffers (see the module docstring).
    """
    from torch.func import functional_call, vmap

    def loss(params, buffers, x, y):
        return F.cross_entropy(functional_call(base, (params, buffers), (x,)), y)

    # randomness="different": each net draws its own dropout mask, as separate nets would (vgg_small's p is 0).
    return vmap(loss, in_dims=(0, 0, 0, None), randomness="different")


def train_sequential(nets, optimizers, x, y, steps: int, start: int, precision_ctx) -> None:
    """Each net in turn for ``steps`` steps; net ``i`` at step ``t`` takes batch ``x[t % P, i]``."""
    for i, (net, opt) in enumerate(zip(nets, optimizers, strict=True)):
        net.train()
        for t in range(start, start + steps):
            p = t % len(x)
            with precision_ctx():
                loss = F.cross_entropy(net(x[p, i]), y[p])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def train_stacked(loss_fn, params, buffers, opt, x, y, steps: int, start: int, precision_ctx) -> None:
    """All nets at once for ``steps`` steps; step ``t`` takes batch ``x[t % P]`` (every net its sub-domain)."""
    for t in range(start, start + steps):
        p = t % len(x)
        with precision_ctx():
            # The sum's gradient for net i is that of its own loss: the nets share nothing.
            loss = loss_fn(params, buffers, x[p], y[p]).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def autocast_reaches_vmap(base: nn.Module, params: dict, buffers: dict, x: torch.Tensor, precision_ctx) -> bool:
    """Whether autocast casts inside ``vmap`` here (the logits come out bf16); some builds skip it (CPU)."""
    from torch.func import functional_call, vmap

    buffers = {k: v.clone() for k, v in buffers.items()}  # this forward's running-statistics update is thrown away
    with torch.no_grad(), precision_ctx():
        logits = vmap(lambda p, b, xb: functional_call(base, (p, b), (xb,)))(params, buffers, x)
    return logits.dtype == torch.bfloat16


def mismatch(nets: list[nn.Module], params: dict, buffers: dict) -> dict:
    """The stacked weights, buffers and last-step gradients against the sequential nets' (the float64 check).

    Returns ``ok`` and, for weights/buffers and for gradients, the largest difference and the tensor it is in.
    """
    worst = {"weight": (-math.inf, 0.0, None), "grad": (-math.inf, 0.0, None)}

    def keep(kind: str, excess: float, diff: float, where: str) -> None:
        if excess > worst[kind][0]:
            worst[kind] = (excess, diff, where)

    for i, net in enumerate(nets):
        grads = [p.grad.detach().double() for p in net.parameters() if p.grad is not None]
        grad_scale = max((g.abs().max().item() for g in grads), default=0.0)
        for name, ref in [*net.named_parameters(), *net.named_buffers()]:
            stacked = params[name] if name in params else buffers[name]
            ref64, diff = ref.detach().double(), (stacked[i].detach().double() - ref.detach().double()).abs()
            excess = (diff - WEIGHT_ATOL - WEIGHT_RTOL * ref64.abs()).max().item()
            keep("weight", excess, diff.max().item(), f"net {i} {name}")
            if name in params and ref.grad is not None:
                if stacked.grad is None:
                    keep("grad", math.inf, math.inf, f"net {i} {name} (no stacked gradient)")
                    continue
                g_ref = ref.grad.detach().double()
                g_diff = (stacked.grad[i].detach().double() - g_ref).abs()
                tol = GRAD_TOL * (g_ref.abs() + grad_scale)
                keep("grad", (g_diff - tol).max().item(), g_diff.max().item() / (grad_scale or 1.0), f"net {i} {name}")
    return {
        "ok": worst["weight"][0] <= 0 and worst["grad"][0] <= 0,
        "weight_abs_diff": worst["weight"][1],
        "weight_tensor": worst["weight"][2],
        "grad_rel_diff": worst["grad"][1],
        "grad_tensor": worst["grad"][2],
        "compared_grads": worst["grad"][2] is not None,
    }


def probe_data(cfg, args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], str]:
    """``(P, N, B, 1, *sub)`` sub-images and ``(P, B)`` labels on ``device``: P batches cut into N sub-domains."""
    from ddcnn.decomposition import Decomposition

    dec = Decomposition(args.probe_grid, (28, 28), args.probe_overlap)
    batches, batch = args.probe_batches, int(args.probe_batch or cfg.data.batch_size)
    images, labels, source = mnist_images(Path(str(cfg.data.path)), batches * batch)
    parts = dec.split(images).view(batches, batch, dec.num_subdomains, 1, *dec.sub_shape).transpose(1, 2)
    return parts.contiguous().to(device), labels.view(batches, batch).to(device), dec.sub_shape, source


def time_stacking(args, device: torch.device, nets: list[nn.Module], cfg, x, y, precision: str) -> dict:
    """Net-steps/s of ``nets`` trained one after another and stacked, same work each, after warm-up."""
    n = len(nets)
    ctx = autocast(device, precision)
    base, params, buffers = stack(nets)
    loss_fn = stacked_loss(base)
    seq_opts = [make_optimizer(cfg, net.parameters()) for net in nets]
    stack_opt = make_optimizer(cfg, list(params.values()))
    row: dict[str, object] = {"precision": precision}
    if precision != "fp32":
        row["autocast_in_vmap"] = autocast_reaches_vmap(base, params, buffers, x[0], ctx)
    train_sequential(nets, seq_opts, x, y, args.probe_warmup, 0, ctx)
    train_stacked(loss_fn, params, buffers, stack_opt, x, y, args.probe_warmup, 0, ctx)
    seconds: dict[str, list[float]] = {"sequential": [], "stacked": []}
    peaks: dict[str, float | None] = {"sequential": None, "stacked": None}
    step = args.probe_warmup
    for r in range(args.probe_rounds):
        # Alternate the order so that a drift of the machine (clocks, other load) hits both alike.
        for kind in ("sequential", "stacked") if r % 2 == 0 else ("stacked", "sequential"):
            sync(device)
            reset_peak(device)
            start = time.perf_counter()
            if kind == "sequential":
                train_sequential(nets, seq_opts, x, y, args.probe_steps, step, ctx)
            else:
                train_stacked(loss_fn, params, buffers, stack_opt, x, y, args.probe_steps, step, ctx)
            sync(device)
            seconds[kind].append(time.perf_counter() - start)
            peak = peak_mib(device)
            peaks[kind] = None if peak is None else max(peak, peaks[kind] or 0.0)
        step += args.probe_steps
    seq, stk = min(seconds["sequential"]), min(seconds["stacked"])
    row.update(
        sequential_s=seq,
        stacked_s=stk,
        sequential_net_steps_per_s=n * args.probe_steps / seq,
        stacked_steps_per_s=args.probe_steps / stk,
        stacked_net_steps_per_s=n * args.probe_steps / stk,
        ratio=seq / stk,
        sequential_peak_mib=peaks["sequential"],
        stacked_peak_mib=peaks["stacked"],
        sequential_s_all=seconds["sequential"],
        stacked_s_all=seconds["stacked"],
    )
    note = "" if row.get("autocast_in_vmap", True) else " (autocast had no effect inside vmap)"
    log(
        f"  {precision}: sequential {row['sequential_net_steps_per_s']:.0f} net-steps/s "
        f"({1e3 * seq / (n * args.probe_steps):.2f} ms/step), stacked {row['stacked_steps_per_s']:.1f} steps/s "
        f"= {row['stacked_net_steps_per_s']:.0f} net-steps/s; stacked/sequential {row['ratio']:.2f}x{note}; peak "
        f"{fmt(peaks['sequential'], '.0f')} / {fmt(peaks['stacked'], '.0f')} MiB"
    )
    return row


def run_stacking(args, device: torch.device) -> dict:
    cfg = compose(["data=mnist", *([f"model={args.probe_model}"] if args.probe_model else [])])
    x, y, sub_shape, source = probe_data(cfg, args, device)
    n = x.shape[1]
    log(
        f"  {n} x {cfg.model.name} on {'x'.join(map(str, sub_shape))} sub-domains (grid "
        f"{'x'.join(map(str, args.probe_grid))} of 28x28, overlap {args.probe_overlap}), batch {y.shape[1]}, "
        f"{cfg.optimizer._target_.rsplit('.', 1)[-1]} "
        f"lr {cfg.optimizer.lr}; data: {source}"
    )

    def fresh_nets(dtype: torch.dtype) -> list[nn.Module]:
        nets = []
        for i in range(n):
            torch.manual_seed(args.seed + i)
            nets.append(make_net(cfg).to(device=device, dtype=dtype))
        return nets

    out: dict[str, object] = {
        "nets": n,
        "model": str(cfg.model.name),
        "sub_shape": list(sub_shape),
        "batch": int(y.shape[1]),
        "data": source,
        "steps_per_net": args.probe_steps,
        "warmup_steps": args.probe_warmup,
        "rounds": args.probe_rounds,
    }

    # The check first: a stacking that is not the same computation makes its timing meaningless.
    nets = fresh_nets(torch.float64)
    base, params, buffers = stack(nets)
    loss_fn = stacked_loss(base)
    x64 = x.double()
    seq_opts = [make_optimizer(cfg, net.parameters()) for net in nets]
    train_sequential(nets, seq_opts, x64, y, args.check_steps, 0, contextlib.nullcontext)
    opt = make_optimizer(cfg, list(params.values()))
    train_stacked(loss_fn, params, buffers, opt, x64, y, args.check_steps, 0, contextlib.nullcontext)
    check = mismatch(nets, params, buffers)
    tolerances = {"weight_atol": WEIGHT_ATOL, "weight_rtol": WEIGHT_RTOL, "grad_tol": GRAD_TOL}
    check.update(steps=args.check_steps, dtype="float64", **tolerances)
    out["check"] = check
    log(
        f"  check ({args.check_steps} steps, float64): {'PASS' if check['ok'] else 'FAIL'}; weights and buffers "
        f"differ by at most {check['weight_abs_diff']:.1e} ({check['weight_tensor']}; tolerance {WEIGHT_ATOL:g} + "
        f"{WEIGHT_RTOL:g} |w|), last-step gradients by {check['grad_rel_diff']:.1e} of the net's largest "
        f"({check['grad_tensor']}; tolerance {GRAD_TOL:g} (|g| + largest))"
    )
    del nets, params, buffers, x64, seq_opts, opt

    timings = []
    for precision in args.probe_precisions:
        try:
            row = time_stacking(args, device, fresh_nets(torch.float32), cfg, x, y, precision)
        except Exception as err:
            if precision == "fp32":
                raise
            # bf16 autocast under vmap is the experimental part (pytorch#105442, #184890): an answer, not a failure.
            row = {"precision": precision, "error": f"{type(err).__name__}: {err}"}
            log(f"  {precision}: {row['error']}")
        timings.append(row)
    out["timings"] = timings
    return out


# --- 2. bare loop on the global CNN ---------------------------------------------------------------------------
def bare_steps(net, opt, images, labels, batch: int, gen, memory_format, precision_ctx, count: int) -> None:
    """``count`` training steps on random batches of the device-resident ``images``."""
    for _ in range(count):
        idx = torch.randint(len(labels), (batch,), device=images.device, generator=gen)
        xb = images[idx].contiguous(memory_format=memory_format)
        with precision_ctx():
            loss = F.cross_entropy(net(xb), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def run_bare(args, device: torch.device) -> dict:
    cfg = compose(["data=mnist", *([f"model={args.bare_model}"] if args.bare_model else [])])
    batch = int(args.bare_batch or cfg.data.batch_size)
    pool = max(batch, min(args.bare_images, 60000))
    images, labels, source = mnist_images(Path(str(cfg.data.path)), pool)
    images, labels = images.to(device), labels.to(device)
    log(
        f"  {cfg.model.name} on 28x28, batch {batch}, {cfg.optimizer._target_.rsplit('.', 1)[-1]}, "
        f"{len(labels)} images on {device}; data: {source}"
    )
    rows = []
    for variant in args.bare_variants:
        precision = "bf16" if variant.startswith("bf16") else "fp32"
        memory_format = torch.channels_last if variant.endswith("+cl") else torch.contiguous_format
        torch.manual_seed(args.seed)
        net = make_net(cfg).to(device=device, memory_format=memory_format).train()
        opt = make_optimizer(cfg, net.parameters())
        gen = torch.Generator(device=device).manual_seed(args.seed)
        ctx = autocast(device, precision)

        train = (net, opt, images, labels, batch, gen, memory_format, ctx)
        reset_peak(device)
        bare_steps(*train, args.bare_warmup)
        sync(device)
        start = time.perf_counter()
        bare_steps(*train, args.bare_steps)
        sync(device)
        seconds = time.perf_counter() - start
        row = {
            "variant": variant,
            "images_per_s": batch * args.bare_steps / seconds,
            "step_ms": 1e3 * seconds / args.bare_steps,
            "peak_mib": peak_mib(device),
            "seconds": seconds,
            "steps": args.bare_steps,
            "batch": batch,
            "model": str(cfg.model.name),
        }
        rows.append(row)
        log(
            f"  {variant:8s} {row['images_per_s']:10.0f} images/s  {row['step_ms']:7.2f} ms/step  "
            f"peak {fmt(row['peak_mib'], '.0f')} MiB"
        )
        del net, opt, train
    return {"rows": rows, "data": source}


# --- 3. ddcnn's loop in this process, under CUDA's sync debug mode ---------------------------------------------
def loop_data(spatial: int, count: int, cfg, seed: int):
    """Prepared (uint8, compact) data for the loop section: MNIST's first ``count`` training images for 2D when
    present (else random), random 16x32x32 volumes for 3D; val = a sixth of it."""
    import numpy as np

    from ddcnn.data.prepare import prepare
    from ddcnn.data.sources import Splits

    rng = np.random.default_rng(seed)
    path = Path(str(cfg.data.path))
    if spatial == 2 and path.is_file():
        with np.load(path) as archive:
            x, y = archive["x_train"][:count][:, None], archive["y_train"][:count]
        source = f"MNIST ({path})"
    else:
        shape = (28, 28) if spatial == 2 else (16, 32, 32)
        x, y = rng.integers(0, 256, size=(count, 1, *shape), dtype=np.uint8), rng.integers(0, 10, size=count)
        source = "random"
    n_val = max(1, len(y) // 6)
    splits = Splits(x[n_val:], y[n_val:], x[:n_val], y[:n_val], class_names=[str(k) for k in range(10)], name="gc")
    return prepare(splits, num_classes=10, in_channels=1, spatial_dims=spatial), source


def run_loop(args, device: torch.device, bare: dict | None = None) -> dict:
    """Each of ``--loop-variants`` trained by ddcnn's loop (:func:`ddcnn.engine.loop.fit_batches`, the configured
    network and optimizer, the default GPU policy) with ``DDCNN_SYNC_DEBUG=warn`` on CUDA: the host synchronisations
    in its steps are counted (any in a variant whose precision needs none is a failure), with images/s (training
    samples x epochs / fit time, validation and checkpoints included), the step time (median time between the
    fetches of consecutive batches), peak memory, the recompiles inside the clock, and the bare loop's step time
    over this one for the same precision and layout (1.0: no overhead)."""
    import warnings

    from ddcnn.data.augment import Augment
    from ddcnn.data.datamodule import PreparedBatches
    from ddcnn.engine.gpu import SYNC_DEBUG_ENV
    from ddcnn.engine.loop import fit_batches
    from ddcnn.settings import LoopSettings

    class TimedBatches(PreparedBatches):
        """Records when each training batch is fetched: the loop's step boundaries (as bench/overhead.py times
        them); ``fetched`` is shared by the copies :meth:`placed` makes."""

        def train_batch(self, idx, epoch, device):
            self.fetched.append((epoch, time.perf_counter()))
            return super().train_batch(idx, epoch, device)

    from omegaconf import OmegaConf

    from ddcnn.engine.gpu import amp_optimizer

    cfg = compose(["data=mnist", *([f"model={args.bare_model}"] if args.bare_model else [])])
    batch = int(args.bare_batch or cfg.data.batch_size)
    rows, data_cache, sources = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_loop_") as tmp:
        for name in args.loop_variants:
            spatial, where, precision, compiled, augmented = LOOP_VARIANTS[name]
            optimizer = LOOP_OPTIMIZERS.get(name) or OmegaConf.to_container(cfg.optimizer, resolve=True)
            row = {"variant": name, "precision": precision, "placement_asked": where, "compile": compiled}
            # the optimizer the loop builds from that node (fused or not) on this device
            row["optimizer"] = str(optimizer["_target_"]).rsplit(".", 1)[-1]
            row["fused"] = bool(amp_optimizer(optimizer, device, precision, None).get("fused"))
            if compiled and device.type != "cuda":
                row.update(status="skipped", reason="compile on a CPU builds C++ kernels for minutes")
                rows.append(row)
                log(f"  {name:26s} skipped: {row['reason']}")
                continue
            if spatial not in data_cache:
                data_cache[spatial], sources[spatial] = loop_data(spatial, args.loop_images, cfg, args.seed)
            augment = Augment(flip_axes=tuple(range(spatial)), rotate_deg=10.0, seed=args.seed) if augmented else None
            data = TimedBatches(data_cache[spatial], batch, seed=args.seed, augment=augment)
            data.fetched = []
            torch.manual_seed(args.seed)
            net = make_net(cfg, spatial_dims=spatial)
            gpu = {"channels_last": "auto", "tf32": "auto", "cudnn_benchmark": "auto", "compile": compiled}
            gpu["data_on_device"] = where == "device"
            previous = os.environ.get(SYNC_DEBUG_ENV)
            if device.type == "cuda":
                os.environ[SYNC_DEBUG_ENV] = "warn"
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    settings = LoopSettings(
                        optimizer=optimizer,
                        max_epochs=args.loop_epochs,
                        device=device,
                        precision=precision,
                        write_best=False,
                        **gpu,
                    )
                    result = fit_batches(net, data, Path(tmp) / name, settings)
            finally:
                if previous is None:
                    os.environ.pop(SYNC_DEBUG_ENV, None)
                else:
                    os.environ[SYNC_DEBUG_ENV] = previous
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
            steps = int(result.history[-1]["step"]) if result.history else 0
            samples = data.size("train") * len(result.history)
            gaps = [b - a for (ea, a), (eb, b) in itertools.pairwise(data.fetched) if ea == eb]
            step_ms = 1e3 * statistics.median(gaps) if gaps else None
            engine = result.engine
            row.update(
                status="ok",
                spatial_dims=spatial,
                data=sources[spatial],
                placement=engine.get("data_placement"),
                memory_format=engine.get("memory_format"),
                host_syncs=len(syncs),
                first_sync=syncs[0][:300] if syncs else None,
                steps=steps,
                images_per_s=samples / result.fit_time_s if result.fit_time_s else None,
                step_ms=step_ms,
                steps_per_s=1e3 / step_ms if step_ms else None,
                host_syncs_per_step=len(syncs) / steps if steps else None,
                peak_mib=result.gpu_peak_memory_bytes / 2**20 if result.gpu_peak_memory_bytes else None,
                compile_recompiles=engine.get("compile_recompiles"),
                warmup_s=result.warmup_s,
                batch=batch,
                model=str(cfg.model.name),
            )
            bare_row = _matching_bare(bare, precision, engine.get("memory_format"))
            if bare_row and row["step_ms"]:
                row["bare_variant"], row["step_ratio"] = bare_row["variant"], bare_row["step_ms"] / row["step_ms"]
            rows.append(row)
            log(
                f"  {name:26s} {fmt(row['images_per_s'], '10.0f')} images/s {fmt(row['step_ms'], '8.2f')} ms/step "
                f"peak {fmt(row['peak_mib'], '.0f')} MiB  host syncs in steps: {row['host_syncs']}  "
                f"placement {row['placement']}, {row['memory_format']}"
                + (f"  bare/loop {row['step_ratio']:.2f}" if "step_ratio" in row else "")
            )
            del net, data, result
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"rows": rows, "on_cuda": device.type == "cuda"}


def _matching_bare(bare: dict | None, precision: str, memory_format: str | None) -> dict | None:
    """The bare loop's row of the same precision and layout (same network, batch and images), if it ran."""
    want = ("bf16" if precision == "bf16-mixed" else "fp32" if precision == "32-true" else None, memory_format)
    for row in (bare or {}).get("rows", []):
        layout = "channels_last" if row["variant"].endswith("+cl") else "contiguous_format"
        if (row["variant"].split("+")[0], layout) == want:
            return row
    return None


def loop_failures(result: dict) -> list[str]:
    """Host synchronisations in the steps of a variant that should make none (every one but
    :data:`SYNCING_VARIANTS`; on CUDA)."""
    if not result.get("on_cuda"):
        return []
    return [
        f"loop {row['variant']}: {row['host_syncs']} host sync(s) in the training steps ({row['first_sync']})"
        for row in result["rows"]
        if row.get("status") == "ok" and row["host_syncs"] and row["variant"] not in SYNCING_VARIANTS
    ]


# --- 4. channels_last_3d: cuDNN's NDHWC kernels against NCDHW ------------------------------------------------------
def run_channels_last_3d(args, device: torch.device) -> dict:
    """3D convnets (``--cl3d-models``, batch norm) in the bare loop on random volumes held on the device, contiguous
    (NCDHW) against ``channels_last_3d`` (NDHWC), per precision: step time, their ratio (contiguous / channels-last:
    above 1, channels-last is faster) and peak memory. ``engine.channels_last=auto`` leaves 3D contiguous until these
    numbers say otherwise (:func:`ddcnn.engine.gpu.resolve_policy`)."""
    shape = tuple(args.cl3d_shape)
    gen = torch.Generator().manual_seed(args.seed)
    pool = 4 * args.cl3d_batch
    images = torch.randn(pool, 1, *shape, generator=gen).to(device)
    labels = torch.randint(10, (pool,), generator=gen).to(device)
    log(f"  volumes {'x'.join(map(str, shape))}, batch {args.cl3d_batch}, {args.cl3d_steps} timed steps")
    rows = []
    for model in args.cl3d_models:
        cfg = compose([f"model={model}"])
        for precision in args.cl3d_precisions:
            row: dict[str, object] = {"model": model, "precision": precision, "batch": args.cl3d_batch}
            for layout, memory_format in (("contiguous", torch.contiguous_format), ("cl3d", torch.channels_last_3d)):
                torch.manual_seed(args.seed)
                net = make_net(cfg, spatial_dims=3).to(device=device, memory_format=memory_format).train()
                opt = make_optimizer(cfg, net.parameters())
                steps_gen = torch.Generator(device=device).manual_seed(args.seed)
                train = (
                    net,
                    opt,
                    images,
                    labels,
                    args.cl3d_batch,
                    steps_gen,
                    memory_format,
                    autocast(device, precision),
                )
                reset_peak(device)
                bare_steps(*train, args.cl3d_warmup)
                sync(device)
                start = time.perf_counter()
                bare_steps(*train, args.cl3d_steps)
                sync(device)
                row[f"{layout}_step_ms"] = 1e3 * (time.perf_counter() - start) / args.cl3d_steps
                row[f"{layout}_peak_mib"] = peak_mib(device)
                del net, opt, train
            row["ratio"] = row["contiguous_step_ms"] / row["cl3d_step_ms"]
            rows.append(row)
            log(
                f"  {model:12s} {precision:5s} contiguous {row['contiguous_step_ms']:8.2f} ms  channels_last_3d "
                f"{row['cl3d_step_ms']:8.2f} ms  contiguous/cl3d {row['ratio']:.2f}  peak "
                f"{fmt(row['contiguous_peak_mib'], '.0f')}/{fmt(row['cl3d_peak_mib'], '.0f')} MiB"
            )
    faster = bool(rows) and all(r["ratio"] >= CL3D_FASTER for r in rows)
    verdict = (
        f"channels_last_3d at least {CL3D_FASTER:.2f}x faster in every row: a case for channels_last=auto on 3D"
        if faster
        else "channels_last_3d not faster in every row: keep 3D contiguous under auto"
    )
    log(f"  {verdict}")
    return {"rows": rows, "shape": list(shape), "cl3d_faster_everywhere": faster, "verdict": verdict}


# --- 5. batch norm synchronised over DDP ranks ----------------------------------------------------------------------
def syncbn_rank(
    rank: int, world: int, init_file: str, out_file: str, device: str, model: str, batch: int, steps: int, seed: int
) -> None:
    """One DDP rank of the syncbn section (started by :func:`run_syncbn` as its own process). gloo on every device:
    one GPU cannot hold two NCCL ranks, and gloo reduces CUDA tensors too."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddcnn.engine.sync_norm import convert_batch_norm

    torch.set_num_threads(1)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = compose([f"model={model}"])
        ids = [dev] if dev.type == "cuda" else None
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(world * batch, 1, 28, 28, generator=gen, dtype=torch.float64).to(dev)
        y = torch.randint(10, (world * batch,), generator=gen).to(dev)
        share = slice(rank * batch, (rank + 1) * batch)
        # The check, in float64: one DDP step on this rank's share gives the gradients and running statistics of one
        # process on the whole batch.
        torch.manual_seed(seed)
        single = make_net(cfg).train()
        for module in single.modules():  # the same computation on both sides: no random dropout masks
            if isinstance(module, nn.Dropout):
                module.eval()
        # converted first, then cast and moved, in the loop's order (it converts; Fabric casts and moves)
        net = convert_batch_norm(copy.deepcopy(single), dev).double().to(dev)
        single = single.double().to(dev)
        norm = sorted({type(m).__name__ for m in net.modules() if "Norm" in type(m).__name__})
        ddp = DistributedDataParallel(net, device_ids=ids)
        F.cross_entropy(ddp(x[share]), y[share]).backward()
        F.cross_entropy(single(x), y).backward()

        def worst(pairs, scale: float) -> tuple[float, str]:
            """The largest difference over ``scale``, and where."""
            return max((float((a.double() - b.double()).abs().max()) / scale, name) for name, a, b in pairs)

        # gradients relative to the net's largest (a convolution's bias before batch norm has a zero gradient in
        # exact arithmetic: rounding noise only), buffers relative to max(1, the buffer's largest)
        pairs = zip(net.named_parameters(), single.parameters(), strict=True)
        params = [(name, a.grad, b.grad) for (name, a), b in pairs]
        grad, grad_at = worst(params, max(float(b.abs().max()) for _, _, b in params))
        buffers = [(name, a, b) for (name, a), b in zip(net.named_buffers(), single.buffers(), strict=True)]
        buffer, buffer_at = max(worst([item], max(1.0, float(item[2].double().abs().max()))) for item in buffers)
        check = {"grad_rel_diff": grad, "grad_tensor": grad_at, "buffer_rel_diff": buffer, "buffer_tensor": buffer_at}
        check["norm"] = norm
        check["ok"] = check["grad_rel_diff"] < SYNCBN_TOL and check["buffer_rel_diff"] < SYNCBN_TOL
        # The time of a float32 DDP step with synchronised batch norm (this rank's share of the batch).
        torch.manual_seed(seed)
        ddp = DistributedDataParallel(convert_batch_norm(make_net(cfg).to(dev).train(), dev), device_ids=ids)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        xs, ys = x[share].float(), y[share]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(xs), ys).backward()
            opt.step()

        step()
        sync(dev)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(dev)
        seconds = time.perf_counter() - start
        if rank == 0:
            out = {**check, "ddp_step_ms": 1e3 * seconds / steps, "peak_mib": peak_mib(dev), "world": world}
            Path(out_file).write_text(json.dumps(out))
        # both ranks done before either tears gloo down: a rank that destroys the group while its peer still uses it
        # can abort the peer at exit ("terminate called without an active exception", SIGABRT; seen once in CI)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_syncbn(args, device: torch.device, deadline: float) -> dict:
    """Batch norm over the global batch of 2 DDP ranks as ddcnn converts it (:func:`ddcnn.engine.sync_norm.
    convert_batch_norm`: ``torch.nn.SyncBatchNorm`` on CUDA, ``GlobalBatchNorm`` elsewhere), both ranks on this
    device (gloo): the float64 check that one DDP step equals one process on the whole batch (gradients and running
    statistics within :data:`SYNCBN_TOL`, relative), and the float32 step time against one process training the
    whole batch. On one GPU both ranks share it and gloo reduces through the host: the step time is an upper bound,
    the check is what counts (SyncBatchNorm's CUDA kernels and the conversion)."""
    world, batch, steps = 2, args.syncbn_batch, args.syncbn_steps
    cfg = compose([f"model={args.syncbn_model}"])
    torch.manual_seed(args.seed)
    net = make_net(cfg).to(device).train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(world * batch, 1, 28, 28, generator=gen).to(device)
    y = torch.randint(10, (world * batch,), generator=gen).to(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()

    step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    single_ms = 1e3 * (time.perf_counter() - start) / steps
    log(
        f"  {args.syncbn_model}, {world} ranks x batch {batch} on {device} (gloo); one process: {single_ms:.2f} ms/step"
    )
    with tempfile.TemporaryDirectory(prefix="gpu_check_syncbn_") as tmp:
        out_file = Path(tmp) / "rank0.json"
        params = {
            "world": world,
            "init_file": str(Path(tmp) / "rendezvous"),
            "out_file": str(out_file),
            "device": str(device),
            "model": args.syncbn_model,
            "batch": batch,
            "steps": steps,
            "seed": args.seed,
        }
        code = (
            "import json, sys; sys.path.insert(0, sys.argv[1]); import gpu_check; "
            "gpu_check.syncbn_rank(int(sys.argv[2]), **json.loads(sys.argv[3]))"
        )
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(Path(__file__).resolve().parent), str(rank), json.dumps(params)],
                cwd=ROOT,
                env=_child_env(args),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(world)
        ]
        timeout = max(10.0, min(SYNCBN_TIMEOUT_S, deadline - time.perf_counter()))
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                raise RuntimeError(f"the DDP ranks did not finish within {timeout:.0f} s") from None
        if any(proc.returncode for proc in procs) or not out_file.is_file():
            tail = "\n".join(f"rank {r}: {out[-1500:]}" for r, out in enumerate(outputs))
            raise RuntimeError(f"a DDP rank failed (exit codes {[p.returncode for p in procs]}):\n{tail}")
        result = json.loads(out_file.read_text())
    result.update(single_step_ms=single_ms, batch_per_rank=batch, model=args.syncbn_model)
    result["ratio"] = single_ms / result["ddp_step_ms"]
    log(
        f"  check {'PASS' if result['ok'] else 'FAIL'} ({', '.join(result['norm'])}: gradients "
        f"{result['grad_rel_diff']:.1e} at {result['grad_tensor']}, buffers {result['buffer_rel_diff']:.1e} at "
        f"{result['buffer_tensor']}); DDP "
        f"{result['ddp_step_ms']:.2f} ms/step, one process / DDP {result['ratio']:.2f}"
    )
    return result


# --- 7. the cost curve by image size (bench/size_cost.py) on this device ---------------------------------------------
def run_size_cost(args, device: torch.device, deadline: float) -> dict:
    """``bench/size_cost.py``'s rows timed on ``device``: every row on a GPU (whose global step is cheap there), the
    quick rows once with ``--tiny``."""
    import importlib

    size_cost = importlib.import_module("bench.size_cost")
    budget = max(0.0, deadline - time.perf_counter())
    argv = ["--quick", "--timed", "--repeats", "1"] if args.tiny else ["--repeats", "3", "--max-gflop", "100000"]
    rows = size_cost.main([*argv, "--device", str(device), "--budget-s", f"{budget:.0f}"])
    return {"device": str(device), "rows": rows}


# --- 8. parallel.workers: local nets in worker processes sharing one device ----------------------------------------
def run_workers(args, device: torch.device, deadline: float) -> dict:
    """The local stage (``ddcnn-train stage=local``) of one decomposition with ``parallel.workers`` = each of
    ``--workers-counts``, every worker on this device (``parallel.accelerator`` follows ``--device``): sub-domains
    per second of training (the busiest worker's training time in ``parallel.json``; in this process for 1: the sum
    of the nets' times) and of the stage's wall time (worker start-up and calibration included), the device memory
    all processes held at their peak (polled free memory, against the free memory before) and the largest peak of
    one net's allocator (``meta.json``)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_workers_") as tmp:
        for workers in args.workers_counts:
            left = deadline - time.perf_counter()
            if left <= 5:
                rows.append({"workers": workers, "status": "skipped", "reason": "over the time budget"})
                log(f"  workers={workers}: skipped, over the time budget")
                continue
            if args.tiny:
                data = ["decomposition=2x2", *TINY_E2E]
            else:
                data = ["data=mnist", f"data.train_subset={args.workers_subset}", f"decomposition={args.workers_grid}"]
                data.append("trainer.max_epochs=1")
            accelerator = "cuda" if device.type == "cuda" else "cpu"
            overrides = [
                "stage=local",
                *data,
                f"device={device}",
                f"parallel.workers={workers}",
                f"parallel.accelerator={accelerator}",
                f"trainer.precision={args.precision}",
                f"seed={args.seed}",
                *E2E_COMMON,
            ]
            run_dir = Path(tmp) / f"workers_{workers}"
            log(f"  workers={workers}: ddcnn-train {' '.join(overrides)}")
            with DeviceMemoryPoll(device) as memory:
                proc, wall_s = ddcnn_train(overrides, run_dir, args, left)
            row: dict[str, object] = {"workers": workers, "overrides": overrides, "wall_s": wall_s}
            if proc is None or proc.returncode != 0:
                reason = "killed at the budget" if proc is None else proc.stderr.strip().splitlines()[-1:]
                row.update(status="failed" if proc is not None else "timeout", reason=str(reason)[-300:])
                if proc is not None:
                    row["stderr_tail"] = proc.stderr[-4000:]
                rows.append(row)
                log(f"  workers={workers}: {row['status'].upper()} {row['reason']}")
                continue
            metas = [json.loads(p.read_text()) for p in run_dir.glob("local/*/meta.json")]
            parallel = run_dir / "parallel.json"
            nets_s = sum(float(m.get("time_s") or 0) for m in metas)
            if parallel.is_file():  # workers: the stage's wall, and the busiest worker's training time
                pool = json.loads(parallel.read_text())
                stage_s = float(pool["wall_s"])
                training_s = max(float(w["actual_s"] or 0) for w in pool["workers"])
            else:  # in this process: one net after another
                stage_s = training_s = nets_s
            peaks = [m.get("gpu_peak_memory_bytes") for m in metas if m.get("gpu_peak_memory_bytes")]
            row.update(
                status="ok",
                subdomains=len(metas),
                stage_s=stage_s,
                training_s=training_s,
                subdomains_per_s=len(metas) / training_s if training_s > 0 else None,
                subdomains_per_s_wall=len(metas) / stage_s if stage_s > 0 else None,
                device_peak_mib=memory.peak_mib,
                net_peak_mib=max(peaks) / 2**20 if peaks else None,
                devices=sorted({str(m.get("device")) for m in metas}),
            )
            rows.append(row)
            log(
                f"  workers={workers}: {row['subdomains']} sub-domains, training {training_s:.1f} s "
                f"({fmt(row['subdomains_per_s'], '.2f')} sub-domains/s), stage {stage_s:.1f} s with start-up "
                f"({fmt(row['subdomains_per_s_wall'], '.2f')}/s); device memory at peak "
                f"{fmt(row['device_peak_mib'], '.0f')} MiB (all processes), one net "
                f"{fmt(row['net_peak_mib'], '.0f')} MiB"
            )
    done = [r for r in rows if r.get("status") == "ok"]
    if len(done) > 1 and done[0]["subdomains_per_s"]:
        for r in done[1:]:
            r["speedup"] = r["subdomains_per_s"] / done[0]["subdomains_per_s"]  # against the first count (1)
    return {"rows": rows}


class DeviceMemoryPoll:
    """The most device memory in use (all processes: ``torch.cuda.mem_get_info``) while the block runs, beyond what
    was in use when it began, polled every 0.1 s (``peak_mib``; ``None`` off CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak_mib = device, None
        self._stop = None

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def __enter__(self) -> DeviceMemoryPoll:
        if self.device.type != "cuda":
            return self
        import threading

        base, peak, self._stop = self._used(), [0], threading.Event()

        def poll() -> None:
            while not self._stop.wait(0.1):
                peak[0] = max(peak[0], self._used() - base)

        self._peak, self._thread = peak, threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join()
            self.peak_mib = self._peak[0] / 2**20


def _child_env(args) -> dict:
    """The environment of a child Python: this checkout's ddcnn and the vendored packages on its path."""
    paths = (str(ROOT), os.environ.get("PYTHONPATH"), str(VENDOR) if VENDOR.is_dir() else None)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def ddcnn_train(overrides: list[str], run_dir: Path, args, timeout_s: float):
    """``ddcnn-train`` with ``overrides`` into ``run_dir`` in a subprocess: ``(completed process or None when killed
    at timeout_s, wall seconds)``."""
    code = "import sys; from ddcnn.cli import train_main; sys.argv[0] = 'ddcnn-train'; train_main()"
    cmd = [sys.executable, "-c", code, *overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(args), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - start
    return proc, time.perf_counter() - start


# --- 6. end to end through the package ------------------------------------------------------------------------
def row_overrides(name: str, args, device: torch.device) -> list[str]:
    """The ``ddcnn-train`` overrides of e2e row ``name`` (without ``hydra.run.dir``)."""
    if name == "digits":
        data = []
    elif args.tiny:  # the same path on the bundled data
        data = ["decomposition=2x2"]
    else:
        data = [
            "data=mnist",
            f"data.train_subset={args.mnist_subset}",
            "decomposition=2x2",
            f"trainer.max_epochs={args.mnist_epochs}",
        ]
    run = [f"device={device}", f"trainer.precision={args.precision}", f"seed={args.seed}", *E2E_COMMON]
    return [*data, *run, *(TINY_E2E if args.tiny else []), *args.e2e_override]


def has_setting(cfg, dotted: str) -> bool:
    from omegaconf import OmegaConf

    parent, _, key = dotted.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return node is not None and key in node


def metrics_steps(folder: Path) -> tuple[int, int] | None:
    """``(epochs, optimizer steps)`` from the last row of a stage's ``logs/metrics.csv``, if it has them."""
    path = folder / "logs" / "metrics.csv"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        with path.open() as file:
            rows = list(csv.DictReader(file))
        if rows:
            return int(float(rows[-1]["epoch"])) + 1, int(float(rows[-1]["step"]))
    return None


def peak_memory_from_meta(meta: dict) -> tuple[float | None, str | None]:
    """Peak GPU memory in MiB from any numeric key whose name holds ``peak`` and ``mem`` (bytes unless its name
    says ``mib``/``mb``/``gib``/``gb``), searched through nested dictionaries; ``(None, None)`` when absent."""

    def walk(node: dict, prefix: str) -> Iterator[tuple[str, object]]:
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    for key, value in walk(meta, ""):
        name = key.lower().rsplit(".", 1)[-1]
        if "peak" in name and "mem" in name and isinstance(value, int | float) and not isinstance(value, bool):
            if name.endswith(("gib", "gb")):
                return float(value) * 1024, key
            if name.endswith(("mib", "mb")):
                return float(value), key
            return float(value) / 2**20, key
    return None, None


def engine_policy(meta: dict) -> dict:
    """The GPU policy a stage's ``meta.json`` records (``ENGINE_KEYS``), wherever the loop put it."""
    nodes = [meta, *(meta[k] for k in ("engine", "gpu", "cuda") if isinstance(meta.get(k), dict))]
    return {k: node[k] for node in nodes for k in ENGINE_KEYS if k in node}


def coarse_batch_size(meta: dict, cfg) -> int | None:
    """The batch size a coarse stage trained with: the plan its ``meta.json`` records (``coarse.batch_size=auto``
    is resolved from the data size), else a number in the configuration."""
    plan = (meta.get("fit") or {}).get("plan") or {}
    if plan.get("batch_size"):
        return int(plan["batch_size"])
    value = cfg.coarse.get("batch_size")
    return int(value) if isinstance(value, int) else None


def stage_rows(run_dir: Path, cfg, results: dict) -> list[dict]:
    """One row per trained stage of a finished run directory, from its ``meta.json`` files."""
    n_train = int(results.get("data", {}).get("n_train") or 0)
    rows = []
    # Pipeline order: the local nets by index, then the other stages.
    order = {"coarse": 0, "coarse_alt": 1, "coarse_val": 2, "coarse_oof": 3, "stacker": 4, "global": 5}
    metas = sorted(
        run_dir.glob("local/*/meta.json"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0
    )
    metas += sorted(run_dir.glob("*/meta.json"), key=lambda p: (order.get(p.parent.name, 9), p.parent.name))
    for path in metas:
        meta = json.loads(path.read_text())
        stage = str(meta.get("stage", path.parent.name))
        coarse = stage.startswith("coarse")
        batch = coarse_batch_size(meta, cfg) if coarse else None
        batch = int(batch or cfg.data.batch_size)
        fit_s = float(meta.get("fit_time_s") or meta.get("time_s") or 0.0)
        counted = metrics_steps(path.parent)
        if counted is not None:
            epochs, steps = counted
        else:  # from the configuration (the loop may have stopped writing metrics.csv)
            planned = ((meta.get("fit") or {}).get("plan") or {}).get("max_epochs")
            epochs = int(
                meta.get("max_epochs") or planned or (cfg.coarse.max_epochs if coarse else cfg.trainer.max_epochs)
            )
            from ddcnn.settings.loop import num_batches

            limit = None if coarse else cfg.trainer.get("limit_train_batches")
            steps = epochs * num_batches(-(-n_train // min(batch, n_train)), limit, "limit_train_batches")
        per_epoch = min(n_train, math.ceil(steps / max(epochs, 1)) * batch)
        peak, peak_key = peak_memory_from_meta(meta)
        name = f"local {meta['subdomain']}" if "subdomain" in meta else stage
        rows.append(
            {
                "stage": name,
                "time_s": meta.get("time_s"),
                "fit_time_s": fit_s,
                "epochs": epochs,
                "steps": steps,
                "samples_per_epoch": per_epoch,
                "images_per_s": per_epoch * epochs / fit_s if fit_s > 0 else None,
                "step_ms": 1e3 * fit_s / steps if steps else None,
                "peak_mib": peak,
                "peak_key": peak_key,
                "device": meta.get("device"),
                "loop": meta.get("loop"),
                "test_accuracy": (meta.get("accuracy") or {}).get("test"),
                "engine": engine_policy(meta),
            }
        )
    return rows


def run_e2e_row(name: str, args, device: torch.device, base: Path, timeout_s: float) -> dict:
    overrides = row_overrides(name, args, device)
    cfg = compose(overrides)
    key = next((k for k in CHANNELS_LAST_KEYS if has_setting(cfg, k)), None)
    if key is not None and device.type == "cuda":
        overrides.append(f"{key}=true")
        cfg = compose(overrides)
    run_dir = base / name
    out: dict[str, object] = {
        "row": name,
        "overrides": overrides,
        "channels_last": (
            "not a setting of this ddcnn"
            if key is None
            else f"{key}=true"
            if device.type == "cuda"
            else f"{key} at its default (not on CUDA)"
        ),
    }
    if cfg.data.name == "mnist" and not Path(str(cfg.data.path)).is_file():
        out.update(status="skipped", reason=f"{cfg.data.path} is missing (set DDCNN_DATA)")
        log(f"  {name}: skipped, {out['reason']}")
        return out
    log(f"  {name}: ddcnn-train {' '.join(overrides)}")
    proc, out["wall_s"] = ddcnn_train(overrides, run_dir, args, timeout_s)
    if proc is None:
        out.update(status="timeout", reason=f"killed at {timeout_s:.0f} s")
        log(f"  {name}: killed after {timeout_s:.0f} s (the budget): no figures")
        return out
    if proc.returncode != 0:
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or [f"exit {proc.returncode}"]
        out.update(status="failed", returncode=proc.returncode, reason=last[0][-300:], stderr_tail=proc.stderr[-4000:])
        log(f"  {name}: FAILED (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return out
    results = json.loads((run_dir / "results.json").read_text())
    out.update(
        status="ok",
        stages=stage_rows(run_dir, cfg, results),
        n_train=results.get("data", {}).get("n_train"),
        accuracy={k: results["accuracy"].get(k) for k in ("global", "cnn_dnn")},
        projected_speedup=results.get("projected_speedup"),
    )
    stage_sum = sum(float(s["time_s"] or 0) for s in out["stages"])
    log(
        f"  {name}: {out['wall_s']:.1f} s in all ({stage_sum:.1f} s in stages, the rest start-up, data and "
        f"evaluate); CNN-DNN test acc {fmt(out['accuracy']['cnn_dnn'], '.4f')}, global "
        f"{fmt(out['accuracy']['global'], '.4f')}"
    )
    for s in out["stages"]:
        log(
            f"    {s['stage']:10s} {fmt(s['time_s'], '6.2f')} s  {fmt(s['images_per_s'], '9.0f')} images/s  "
            f"{fmt(s['step_ms'], '7.2f')} ms/step  peak {fmt(s['peak_mib'], '.0f')} MiB  ({s['loop']}, {s['device']})"
        )
    return out


def run_e2e(args, device: torch.device, deadline: float) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddcnn-gpu-check-") as tmp:
        # A fresh folder per run even with --keep: a finished stage found in a run directory is skipped, not timed.
        base = Path(args.keep) / time.strftime("gpu_check_%Y-%m-%d_%H-%M-%S") if args.keep else Path(tmp)
        for name in args.rows:
            left = deadline - time.perf_counter()
            if left <= 5:
                rows.append({"row": name, "status": "skipped", "reason": "over the time budget"})
                log(f"  {name}: skipped, over the time budget")
                continue
            try:
                rows.append(run_e2e_row(name, args, device, base, left))
            except Exception as err:  # this row's configuration or its files: the next row still runs
                rows.append({"row": name, "status": "error", "reason": f"{type(err).__name__}: {err}"})
                log(f"  {name}: ERROR\n{traceback.format_exc()}")
    return {"rows": rows}


# --- the summary ----------------------------------------------------------------------------------------------
def summary(report: dict) -> list[str]:
    lines = ["", "=" * 100, "summary"]
    m = report["machine"]
    lines.append(
        f"machine: {m.get('gpu') or 'CPU'} ({m['device']}), torch {m['torch']}, CUDA {m['cuda_runtime']}, cuDNN "
        f"{m['cudnn']}, {m['cpu_count']} CPUs; applied: {json.dumps(report['math_applied'])}"
    )
    stacking = report["sections"].get("stacking", {})
    if stacking.get("status") == "ok":
        r, c = stacking["result"], stacking["result"]["check"]
        lines.append(
            f"\nstacking: {r['nets']} x {r['model']} on {'x'.join(map(str, r['sub_shape']))}, batch {r['batch']}, "
            f"{r['steps_per_net']} steps per net; check {'PASS' if c['ok'] else 'FAIL'} "
            f"(weights {c['weight_abs_diff']:.1e}, gradients {c['grad_rel_diff']:.1e})"
        )
        lines.append(
            f"  {'precision':9s} {'sequential net-steps/s':>22s} {'stacked net-steps/s':>20s} {'ratio':>7s} "
            f"{'peak MiB seq/stacked':>21s}"
        )
        for t in r["timings"]:
            if "error" in t:
                lines.append(f"  {t['precision']:9s} {t['error'][:90]}")
                continue
            flag = "" if t.get("autocast_in_vmap", True) else "  (autocast not applied in vmap)"
            peaks = f"{fmt(t['sequential_peak_mib'], '.0f')}/{fmt(t['stacked_peak_mib'], '.0f')}"
            lines.append(
                f"  {t['precision']:9s} {t['sequential_net_steps_per_s']:22.0f} {t['stacked_net_steps_per_s']:20.0f} "
                f"{t['ratio']:6.2f}x {peaks:>21s}{flag}"
            )
    bare = report["sections"].get("bare", {})
    if bare.get("status") == "ok":
        lines.append(f"\nbare loop, global CNN on 28x28 ({bare['result']['data']}):")
        lines.append(f"  {'variant':9s} {'images/s':>10s} {'ms/step':>8s} {'peak MiB':>9s}")
        for b in bare["result"]["rows"]:
            lines.append(
                f"  {b['variant']:9s} {b['images_per_s']:10.0f} {b['step_ms']:8.2f} {fmt(b['peak_mib'], '9.0f')}"
            )
    loop = report["sections"].get("loop", {})
    if loop.get("status") == "ok":
        lines.append("\nddcnn's loop (host syncs counted in the training steps under CUDA's sync debug mode):")
        lines.append(
            f"  {'variant':26s} {'images/s':>9s} {'ms/step':>8s} {'bare/loop':>9s} {'peak MiB':>9s} {'syncs':>6s} "
            f"{'placement':>9s}  optimizer"
        )
        for r in loop["result"]["rows"]:
            if r.get("status") != "ok":
                lines.append(f"  {r['variant']:26s} {r['status']}: {r.get('reason', '')}")
                continue
            lines.append(
                f"  {r['variant']:26s} {fmt(r['images_per_s'], '9.0f')} {fmt(r['step_ms'], '8.2f')} "
                f"{fmt(r.get('step_ratio'), '9.2f')} {fmt(r['peak_mib'], '9.0f')} {r['host_syncs']:6d} "
                f"{r['placement']:>9s}  {r['optimizer']}{' (fused)' if r['fused'] else ''}"
            )
    cl3d = report["sections"].get("cl3d", {})
    if cl3d.get("status") == "ok":
        r = cl3d["result"]
        lines.append(f"\nchannels_last_3d, bare loop on {'x'.join(map(str, r['shape']))} volumes: {r['verdict']}")
        lines.append(f"  {'model':12s} {'precision':9s} {'NCDHW ms':>9s} {'NDHWC ms':>9s} {'NCDHW/NDHWC':>11s}")
        for row in r["rows"]:
            lines.append(
                f"  {row['model']:12s} {row['precision']:9s} {row['contiguous_step_ms']:9.2f} "
                f"{row['cl3d_step_ms']:9.2f} {row['ratio']:11.2f}"
            )
    syncbn = report["sections"].get("syncbn", {})
    if syncbn.get("status") == "ok":
        r = syncbn["result"]
        lines.append(
            f"\nsynchronised batch norm, {r['world']} DDP ranks (gloo) x batch {r['batch_per_rank']}, {r['model']}: "
            f"check {'PASS' if r['ok'] else 'FAIL'} ({', '.join(r['norm'])}; gradients {r['grad_rel_diff']:.1e}, "
            f"buffers {r['buffer_rel_diff']:.1e}); {r['ddp_step_ms']:.2f} ms/step, one process on the whole batch "
            f"{r['single_step_ms']:.2f}"
        )
    workers = report["sections"].get("workers", {})
    if workers.get("status") == "ok":
        lines.append("\nparallel.workers, the local stage with its workers sharing this device:")
        lines.append(
            f"  {'workers':>7s} {'nets':>5s} {'train s':>8s} {'nets/s':>7s} {'stage s':>8s} {'nets/s':>7s} "
            f"{'device MiB':>10s} {'net MiB':>8s}"
        )
        for r in workers["result"]["rows"]:
            if r.get("status") != "ok":
                lines.append(f"  {r['workers']:7d} {r['status'].upper()}: {r.get('reason', '')}")
                continue
            lines.append(
                f"  {r['workers']:7d} {r['subdomains']:5d} {r['training_s']:8.1f} {fmt(r['subdomains_per_s'], '7.2f')} "
                f"{r['stage_s']:8.1f} {fmt(r['subdomains_per_s_wall'], '7.2f')} {fmt(r['device_peak_mib'], '10.0f')} "
                f"{fmt(r['net_peak_mib'], '8.0f')}"
            )
    e2e = report["sections"].get("e2e", {})
    if e2e.get("status") == "ok":
        lines.append("\nend to end (ddcnn-train; images/s = samples x epochs / fit time, step = fit time / steps):")
        lines.append(
            f"  {'row':10s} {'stage':10s} {'time s':>7s} {'images/s':>9s} {'ms/step':>8s} {'peak MiB':>9s} {'loop':>6s}"
        )
        for row in e2e["result"]["rows"]:
            if row["status"] != "ok":
                lines.append(f"  {row['row']:10s} {row['status'].upper()}: {row.get('reason', '')}")
                continue
            for s in row["stages"]:
                lines.append(
                    f"  {row['row']:10s} {s['stage']:10s} {fmt(s['time_s'], '7.2f')} {fmt(s['images_per_s'], '9.0f')} "
                    f"{fmt(s['step_ms'], '8.2f')} {fmt(s['peak_mib'], '9.0f')} {s['loop'] or '-':>6s}"
                )
            lines.append(
                f"  {row['row']:10s} {'(process)':10s} {row['wall_s']:7.1f}  channels_last: {row['channels_last']}"
            )
    size_cost = report["sections"].get("size_cost", {})
    if size_cost.get("status") == "ok":
        lines.append(f"\ncost by image size, global vgg_small / one local net on {size_cost['result']['device']}:")
        lines.append(
            f"  {'input':>6s} {'grid':>6s} {'ov':>2s} {'FLOP x':>7s} {'time x':>7s} {'global ms':>9s} "
            f"{'added MiB g/l':>14s} {'planned MiB g/l':>16s}"
        )
        for r in size_cost["result"]["rows"]:
            added = f"{fmt(r.get('step_added_global_mib'), '.0f')}/{fmt(r.get('step_added_local_mib'), '.0f')}"
            planned = f"{r['saved_global_mib']:.0f}/{r['saved_local_mib']:.0f}"
            global_ms = None if r["time_global_s"] is None else 1e3 * r["time_global_s"]
            lines.append(
                f"  {str(r['size']) + '^' + str(r['spatial_dims']):>6s} {r['grid']:>6s} {r['overlap']:2d} "
                f"{r['flop_ratio']:7.2f} {fmt(r['time_ratio'], '7.2f')} {fmt(global_ms, '9.2f')} {added:>14s} "
                f"{planned:>16s}"
            )
    for name, section in report["sections"].items():
        if section.get("status") not in ("ok", None):
            lines.append(f"\n{name}: {section['status'].upper()} {section.get('reason', '')}".rstrip())
    b = report["budget"]
    lines.append(f"\nwall time {b['elapsed_s']:.0f} s of a {b['budget_s']:.0f} s budget")
    lines.append("failures: " + ("; ".join(report["failures"]) if report["failures"] else "none"))
    return lines


# --- main -----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU, tiny nets, step counts and e2e runs, 1 thread (tests)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu; cpu with --tiny)")
    p.add_argument("--out", default="gpu_check.json", help="JSON report (default: ./gpu_check.json)")
    p.add_argument("--budget-s", type=float, default=360.0, help="wall budget checked before each part (360)")
    p.add_argument("--prepare", action="store_true", help="copy hydra/omegaconf/antlr4 and MNIST for a GPU machine")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch's CPU threads here, OMP_NUM_THREADS of the e2e runs (0: leave)")
    p.add_argument("--tf32", choices=("on", "off", "keep"), default="on", help="CUDA, in-process sections (on)")
    p.add_argument("--cudnn-benchmark", choices=("on", "off", "keep"), default="on", help="likewise (on)")
    g = p.add_argument_group("stacking probe")
    g.add_argument("--probe-grid", help="grid of the 28x28 images: one net per sub-domain (4,4)")
    g.add_argument("--probe-overlap", type=int, default=1, help="(1)")
    g.add_argument("--probe-model", help="model config (default: the configured local net, vgg_small)")
    g.add_argument("--probe-batch", type=int, help="batch per net (default: data.batch_size of mnist, 128)")
    g.add_argument("--probe-batches", type=int, help="distinct batches cycled through (8)")
    g.add_argument("--probe-steps", type=int, help="timed steps per net and round (100)")
    g.add_argument("--probe-warmup", type=int, help="untimed steps per net first (5)")
    g.add_argument("--probe-rounds", type=int, help="timed rounds, order alternating; the best counts (2)")
    g.add_argument("--probe-precisions", help="fp32[,bf16] (default: fp32,bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--check-steps", type=int, help="float64 steps of the equality check (3)")
    g = p.add_argument_group("bare loop")
    g.add_argument("--bare-model", help="model config (default: the configured one, vgg_small)")
    g.add_argument("--bare-batch", type=int, help="default: data.batch_size of mnist, 128")
    g.add_argument("--bare-images", type=int, help="images held on the device (20000)")
    g.add_argument("--bare-steps", type=int, help="timed steps per variant (300)")
    g.add_argument("--bare-warmup", type=int, help="untimed steps first (30)")
    g.add_argument("--bare-variants", help=f"subset of {','.join(BARE_VARIANTS)} (default: all on CUDA, fp32 on CPU)")
    g = p.add_argument_group("ddcnn's loop")
    g.add_argument("--loop-variants", help=f"subset of {','.join(LOOP_VARIANTS)} (default: all on CUDA)")
    g.add_argument("--loop-images", type=int, help="training + validation images (20000; 3D: random volumes)")
    g.add_argument("--loop-epochs", type=int, help="epochs per variant (2)")
    g = p.add_argument_group("channels_last_3d")
    g.add_argument("--cl3d-models", help="3D model configs (vgg_small,resnet10)")
    g.add_argument("--cl3d-shape", help="volume D,H,W (32,64,64)")
    g.add_argument("--cl3d-batch", type=int, help="(16)")
    g.add_argument("--cl3d-steps", type=int, help="timed steps per layout (30)")
    g.add_argument("--cl3d-warmup", type=int, help="untimed steps first (5)")
    g.add_argument("--cl3d-precisions", help="fp32[,bf16] (default: fp32,bf16 on CUDA, fp32 on CPU)")
    g = p.add_argument_group("synchronised batch norm in DDP")
    g.add_argument("--syncbn-model", help="model config (vgg_small)")
    g.add_argument("--syncbn-batch", type=int, help="batch per rank (64)")
    g.add_argument("--syncbn-steps", type=int, help="timed steps (30)")
    g = p.add_argument_group("parallel.workers")
    g.add_argument("--workers-counts", help="parallel.workers values, each a local stage (1,4)")
    g.add_argument("--workers-grid", default="4x4", help="decomposition of the local stage (4x4: 16 nets)")
    g.add_argument("--workers-subset", type=int, default=5000, help="data.train_subset of MNIST (5000)")
    g = p.add_argument_group("end to end")
    g.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    g.add_argument("--precision", help="trainer.precision (default: bf16-mixed on CUDA, 32-true on CPU)")
    g.add_argument("--mnist-subset", type=int, default=20000, help="data.train_subset of the mnist row (20000)")
    g.add_argument("--mnist-epochs", type=int, default=3, help="trainer.max_epochs of the mnist row (3)")
    g.add_argument("--e2e-override", action="append", default=[], help="another override for every row")
    g.add_argument("--keep", help="keep the run directories in this folder")
    args = p.parse_args(argv)

    def listed(text: str | None, allowed: tuple[str, ...], what: str) -> list[str]:
        items = [s for s in (text or "").split(",") if s]
        bad = sorted(set(items) - set(allowed))
        if bad:
            p.error(f"{what}: unknown {bad}; choose from {','.join(allowed)}")
        return items

    args.device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    args.sections = listed(args.sections, SECTIONS, "--sections")
    args.rows = listed(args.rows, ROWS, "--rows")
    default_precisions, default_variants = ("fp32,bf16", ",".join(BARE_VARIANTS)) if cuda else ("fp32", "fp32")
    args.probe_precisions = listed(args.probe_precisions or default_precisions, ("fp32", "bf16"), "--probe-precisions")
    args.bare_variants = listed(args.bare_variants or default_variants, BARE_VARIANTS, "--bare-variants")
    default_loop = (
        ",".join(LOOP_VARIANTS)
        if cuda
        else "2d-device-fp32,3d-pinned-bf16,2d-device-aug,2d-device-16mixed-sgd,2d-device-16mixed-unfused"
    )
    args.loop_variants = listed(args.loop_variants or default_loop, tuple(LOOP_VARIANTS), "--loop-variants")
    args.precision = args.precision or ("bf16-mixed" if cuda else "32-true")
    args.cl3d_precisions = listed(args.cl3d_precisions or default_precisions, ("fp32", "bf16"), "--cl3d-precisions")
    for name, (normal, tiny) in DEFAULTS.items():  # what the user did not give: normal, or tiny with --tiny
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else normal)
    args.cl3d_models = [m for m in str(args.cl3d_models).split(",") if m]
    try:
        args.cl3d_shape = tuple(int(n) for n in str(args.cl3d_shape).split(","))
        args.workers_counts = [int(n) for n in str(args.workers_counts).split(",") if n]
    except ValueError:
        p.error("--cl3d-shape and --workers-counts take whole numbers separated by commas, e.g. 32,64,64 and 1,4")
    if len(args.cl3d_shape) != 3:
        p.error(f"--cl3d-shape is D,H,W, got {args.cl3d_shape}")
    try:
        args.probe_grid = tuple(int(g) for g in str(args.probe_grid).split(","))
    except ValueError:
        p.error(f"--probe-grid must be whole numbers separated by commas, e.g. 4,4; got {args.probe_grid!r}")
    for name in (
        "probe_batches",
        "probe_steps",
        "probe_rounds",
        "check_steps",
        "bare_steps",
        "cl3d_batch",
        "cl3d_steps",
        "syncbn_batch",
        "syncbn_steps",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare:
        for line in prepare_machine():
            log(line)
        return 0
    try:
        import hydra  # noqa: F401
        import omegaconf  # noqa: F401
    except ImportError as err:
        log(f"gpu_check: {err}; ddcnn needs hydra-core and omegaconf (see this script's docstring for a GPU machine)")
        return 2
    # Development data of this repository beside the checkout, else data/ in it; users set DDCNN_DATA themselves.
    if "DDCNN_DATA" not in os.environ:
        for candidate in (ROOT.parent / "shared" / "data", ROOT / "data"):
            if (candidate / "mnist.npz").is_file():
                os.environ["DDCNN_DATA"] = str(candidate)
                break
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return run_all(args)
    finally:
        torch.set_num_threads(threads)  # main() also runs inside the test process


def run_all(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    deadline = started + args.budget_s
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the stacked and bare sections allocate on the current device too
        device = torch.device("cuda", torch.cuda.current_device())  # "cuda" -> "cuda:0": one name everywhere
    found = math_settings()
    apply_math_policy(device, args.tf32, args.cudnn_benchmark)
    report: dict[str, object] = {
        "machine": machine(device),
        "math_found": found,
        "math_applied": math_settings(),
        "args": {k: v for k, v in vars(args).items()},
        "sections": {},
        "failures": [],
        "budget": {"budget_s": args.budget_s, "elapsed_s": 0.0},
    }
    out_path = Path(args.out)

    def save() -> None:
        report["budget"]["elapsed_s"] = time.perf_counter() - started
        report["budget"]["within"] = report["budget"]["elapsed_s"] <= args.budget_s
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1, default=str))

    m = report["machine"]
    log(f"gpu_check{' --tiny' if args.tiny else ''}: {m['host']}, device {device}, budget {args.budget_s:.0f} s")
    if device.type == "cuda":
        log(
            f"  GPU {m['gpu']} (sm {m['capability']}, {m['multiprocessors']} SMs, {m['gpu_memory_gib']} GiB), "
            f"driver {m.get('driver') or '?'}"
        )
    log(
        f"  torch {m['torch']}, CUDA {m['cuda_runtime']}, cuDNN {m['cudnn']}, python {m['python']}, "
        f"{m['cpu_count']} CPUs, {m['torch_threads']} torch threads, commit {m.get('commit') or '?'}"
    )
    log(f"  math found: {json.dumps(found)}")
    log(f"  math applied to sections 1-2: {json.dumps(report['math_applied'])}")
    log(f"  data: DDCNN_DATA={os.environ.get('DDCNN_DATA')}")

    runners = {
        "stacking": lambda: run_stacking(args, device),
        "bare": lambda: run_bare(args, device),
        "loop": lambda: run_loop(args, device, report["sections"].get("bare", {}).get("result")),
        "cl3d": lambda: run_channels_last_3d(args, device),
        "syncbn": lambda: run_syncbn(args, device, deadline),
        "e2e": lambda: run_e2e(args, device, deadline),
        "size_cost": lambda: run_size_cost(args, device, deadline),
        "workers": lambda: run_workers(args, device, deadline),
    }
    titles = {
        "stacking": "1. stacking probe: local nets one after another against stacked under torch.func.vmap",
        "bare": "2. bare PyTorch loop, global CNN",
        "loop": "3. ddcnn's loop in this process (2D/3D, data on the device and streamed, precisions, compile)",
        "cl3d": "4. channels_last_3d against contiguous, 3D convnets in the bare loop",
        "syncbn": "5. batch norm synchronised over 2 DDP ranks (gloo) on this device",
        "e2e": "6. end to end: ddcnn-train",
        "size_cost": "7. the cost by image size: the global CNN against one local net on this device",
        "workers": "8. parallel.workers: the local stage in worker processes sharing this device",
    }
    for name in args.sections:
        log(f"\n{titles[name]}")
        if time.perf_counter() >= deadline:
            report["sections"][name] = {"status": "skipped", "reason": "over the time budget"}
            log("  skipped: over the time budget")
            save()
            continue
        start = time.perf_counter()
        try:
            result = runners[name]()
        except Exception as err:
            reason = f"{type(err).__name__}: {err}"
            report["sections"][name] = {"status": "error", "reason": reason, "traceback": traceback.format_exc()}
            report["failures"].append(f"{name} raised {reason}")
            log(traceback.format_exc())
        else:
            report["sections"][name] = {"status": "ok", "seconds": time.perf_counter() - start, "result": result}
            if name == "stacking" and not result["check"]["ok"]:
                c = result["check"]
                report["failures"].append(
                    f"stacked training differs from sequential (weights: {c['weight_tensor']} by "
                    f"{c['weight_abs_diff']:.2e}; gradients: {c['grad_tensor']} by {c['grad_rel_diff']:.2e})"
                )
            if name == "loop":
                report["failures"].extend(loop_failures(result))
            if name == "e2e":
                for row in result["rows"]:
                    if row["status"] in ("failed", "error"):
                        report["failures"].append(f"e2e {row['row']} {row['status']}: {row['reason']}")
            if name == "syncbn" and not result["ok"]:
                report["failures"].append(
                    f"DDP with {', '.join(result['norm'])} differs from one process on the whole batch (gradients "
                    f"{result['grad_rel_diff']:.1e}, running statistics {result['buffer_rel_diff']:.1e})"
                )
            if name == "workers":
                for row in result["rows"]:
                    if row["status"] == "failed":
                        report["failures"].append(f"workers={row['workers']} failed: {row['reason']}")
        log(f"  ({time.perf_counter() - start:.1f} s)")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    save()
    for line in summary(report):
        log(line)
    log(f"report: {out_path.resolve()}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
