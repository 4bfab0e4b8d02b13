"""What every stage of a run shares: the settings, the data, the decomposition and the networks.

:func:`build_context` checks the settings (:class:`~ddcnn.settings.RunSettings`, unless the entry built them already)
and loads everything a stage needs before anything is written; the network
builders turn the ``model``, ``global_model`` and ``coarse.net`` settings into modules. Nothing here imports
Lightning, so a process that only coordinates (the parent of ``parallel.workers`` processes, the rank-0 check
of a launcher) starts in a fraction of the time a training process needs; the stages that train live in
the modules of :mod:`ddcnn.stages`.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
import numpy as np
import torch
from torch import nn

from ddcnn.data.augment import Augment
from ddcnn.data.memory import device_memory_bytes
from ddcnn.data.prepare import Prepared, load_prepared, split_manifest
from ddcnn.data.sources import NOT_IDENTITY
from ddcnn.decomposition import Decomposition
from ddcnn.io import atomic_write_json, atomic_write_text, load_run_file
from ddcnn.models import external, pretrained
from ddcnn.models.checkpointing import checkpoint_runs
from ddcnn.models.cnn_dnn import CNNDNN
from ddcnn.models.memory import MIB, NetPlan, meta_state, plan_network
from ddcnn.rundir import SPLIT_MANIFEST, RunDir, RunIdentity, file_sha256
from ddcnn.runtime import resolve_device
from ddcnn.settings import CoarseSettings, RunSettings, StoreSettings
from ddcnn.store import Store, default_root

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

__all__ = [
    "Context",
    "load_data",
    "open_store",
    "build_context",
    "open_context",
    "check_networks",
    "memory_plan",
    "write_memory_plan",
    "write_split_manifest",
    "build_augment",
    "subdomain_seed",
    "instantiate",
    "build_local_net",
    "build_global_net",
    "build_coarse_net",
    "weights_meta",
    "coarse_net_spec",
    "finished_coarse_spec",
    "finished_coarse_input",
    "count_parameters",
    "assemble_cnn_dnn",
]


@dataclass
class Context:
    """What every stage of one run shares: the run directory, the data, the decomposition and the checked settings
    (``data.num_classes`` / ``data.in_channels`` as the data have them).

    ``identity``: what the run directory records of the configuration (:class:`~ddcnn.rundir.RunIdentity`: the
    fingerprint the entry claims the directory with, the key of a reusable stage); ``None`` in a local-stage worker
    process, which neither claims the directory nor reuses a stage. ``memory_plan``: what :func:`check_networks`
    planned (:func:`memory_plan`), written to ``memory_plan.json`` once the directory is claimed."""

    run: RunDir
    data: Prepared
    decomposition: Decomposition
    settings: RunSettings
    identity: RunIdentity | None = None
    memory_plan: dict | None = None


def open_store(store: StoreSettings) -> Store:
    """The store of ``store.root`` (else ``$DDCNN_STORE``, else ``~/.cache/ddcnn``): prepared data, reusable stages."""
    return Store(default_root(store.root), stale_after_s=store.stale_after_s)


def _accepts(target: str, name: str) -> bool:
    import inspect

    from hydra.utils import get_method

    try:
        return name in inspect.signature(get_method(target)).parameters
    except (ValueError, TypeError, ImportError, AttributeError):
        return False


def load_data(settings: RunSettings) -> Prepared:
    """The prepared splits of ``data.source``, in memory or memory-mapped from the store as ``data.memory`` says
    (same numbers in every stage and process; see :mod:`ddcnn.data.prepare`), with ``data.val_target_fraction`` of
    the validation split (or, ``data.val_target_from: train``, of the training split) carved out as the held-out
    target split."""
    d = settings.data
    target = str(d.source.get("_target_", ""))
    extra = {"lazy": True} if _accepts(target, "lazy") else {}
    if _accepts(target, "in_channels"):  # a source that can read 1 or 3 channels (image files) reads data.in_channels
        extra["in_channels"] = d.in_channels
    data = load_prepared(
        lambda: instantiate(d.source, **extra),
        {k: v for k, v in d.source.items() if k not in NOT_IDENTITY},
        d,  # the data settings are the preparation's (PrepareSettings)
        mode=d.memory.mode,
        auto_max_mb=d.memory.auto_max_mb,
        limit_gb=d.memory.limit_gb,
        store=open_store(settings.store),
        stage_to=settings.store.stage_to,
    )
    fraction = d.val_target_fraction
    return data.carve_val_target(fraction, d.split_seed, d.val_target_from) if fraction > 0 else data


def open_context(
    settings: RunSettings,
    run_dir: str | Path | None = None,
    data: Prepared | None = None,
    weights: bool = True,
    check: bool = True,
) -> Context:
    """The context of a run from its checked settings: load the data, build the decomposition and (``check``) check
    the networks (:func:`check_networks`).

    ``data`` skips loading: the parent of the parallel workers hands them the data it prepared (the tensors in shared
    memory, or the store entry that each worker maps) instead of each worker reading and preparing them again.
    ``weights=False`` leaves the pretrained weights file (``model.weights``) unread: a finished run's networks come
    from its own ``net.pt`` files (the export). A worker process opens its context with ``check=False``: its parent
    checked the settings and the networks.
    """
    run_dir = run_dir if run_dir is not None else settings.run_dir
    if run_dir is None:
        raise ValueError("no run directory: pass run_dir, or set paths.run_dir (hydra.run.dir under ddcnn-train).")
    if data is None:
        data = load_data(settings)
    # what the stages read and the fingerprint records: a run of 4 classes is not a run of 5
    settings = settings.with_data_counts(data.num_classes, data.in_channels)
    grid, overlap = settings.decomposition.grid, settings.decomposition.overlap
    ctx = Context(RunDir(run_dir), data, Decomposition(grid, data.image_shape, overlap), settings)
    if check:
        check_group_splits(settings, data)
        check_networks(ctx, weights=weights)
    return ctx


def check_group_splits(settings: RunSettings, data: Prepared) -> None:
    """The splits that enabled stages draw later over patient groups are possible, checked before any training:
    ``coarse_val`` halves the validation split, ``local_oof`` folds the training split.

    Raises:
        ValueError: Too few patient groups, with the numbers and the fix.
    """
    if data.groups is None:
        return
    enabled = settings.methods.enabled
    n_val = len(np.unique(data.groups["val"]))
    if enabled.get("coarse_val") and n_val < 2:
        raise ValueError(
            f"coarse_val (methods.enabled.coarse_val) fits on one half of the validation split and selects on the "
            f"other, one patient's studies on one side, but the {len(data.groups['val'])} validation samples come "
            f"from {n_val} patient group(s); raise data.val_fraction or set methods.enabled.coarse_val=false."
        )
    folds = settings.methods.local_oof.folds
    n_train = len(np.unique(data.groups["train"]))
    if (enabled.get("local_oof") or enabled.get("coarse_oof")) and n_train < folds:
        raise ValueError(
            f"methods.local_oof.folds={folds} needs at least {folds} patient groups in the training split, which holds "
            f"{len(data.groups['train'])} samples of {n_train} group(s); lower the folds or add patients."
        )


def build_context(
    cfg: DictConfig,
    run_dir: str | Path | None = None,
    claim: bool = True,
    data: Prepared | None = None,
    weights: bool = True,
    settings: RunSettings | None = None,
) -> Context:
    """The context of the composed configuration ``cfg``, the entry's (:func:`ddcnn.pipeline.train`, notebooks,
    tools): check the settings, :func:`open_context`, and (``claim``) claim the run directory.

    ``settings``: those the entry built from ``cfg`` already; ``None`` builds them here, which checks every setting.
    With ``claim=False`` the caller checks further settings first and then calls ``ctx.run.claim(ctx.identity)``
    itself. ``data`` and ``weights`` as :func:`open_context` takes them.
    """
    if settings is None:
        settings = RunSettings.from_config(cfg)
    settings = settings.in_run_dir(run_dir if run_dir is not None else settings.run_dir)
    ctx = open_context(settings, run_dir, data=data, weights=weights)
    ctx.identity = ctx.settings.identity()
    if claim:  # only a configuration that can run claims the run directory
        ctx.run.claim(ctx.identity)
        write_memory_plan(ctx)
        write_split_manifest(ctx)
    return ctx


def write_split_manifest(ctx: Context) -> None:
    """``RUN_DIR/splits.csv``: which image is in which split (:func:`~ddcnn.data.prepare.split_manifest`), written once
    per run directory by the first process that prepared its data (the claimed run holds one configuration, so one
    split; a process that finds the file leaves it)."""
    path = ctx.run.root / SPLIT_MANIFEST
    if not path.is_file():
        atomic_write_text(path, split_manifest(ctx.data))


def write_memory_plan(ctx: Context) -> None:
    """``RUN_DIR/memory_plan.json``: the plan :func:`check_networks` made (nothing when it made none)."""
    if ctx.memory_plan is not None:
        atomic_write_json(ctx.run.root / "memory_plan.json", ctx.memory_plan)


def check_networks(ctx: Context, weights: bool = True) -> None:
    """Build the local, global and coarse networks once, check them on inputs of their size and plan their memory.

    Catches a wrong model name or argument, a missing library, a pretrained weights file that does not fit
    (``weights``) and an input too small for a network before any stage writes anything, with a message that names
    the setting; for an input too small, the smallest size the network takes and settings that give it. A network
    whose feature maps shrink to one pixel before its last downsampling stages runs, with a warning. The networks run
    on meta tensors (shapes only: a 256³ volume costs what a small one does), then :func:`memory_plan` plans one
    training step of each (``ctx.memory_plan``) and refuses a run whose networks do not fit the device.
    """
    settings, data, dec = ctx.settings, ctx.data, ctx.decomposition
    global_key = "global_model" if settings.global_model else "model"
    checks = [
        ("model", "sub-domains", lambda: build_local_net(settings, data, weights=weights), dec.sub_shape),
        (global_key, "full images", lambda: build_global_net(settings, data, weights=weights), data.image_shape),
    ]
    nets = {}
    for (key, what, build, spatial), role in zip(checks, ("local", "global"), strict=True):
        net = _built(ctx, key, build)
        _log_weights(key, net)
        _check_input_size(ctx, key, what, net, tuple(spatial))
        nets[role] = net
    key, shape = "coarse.net", (2, dec.num_subdomains, data.num_classes)
    net = _built(ctx, key, lambda: build_coarse_net(ctx.settings.coarse, dec.num_subdomains, data.num_classes))
    try:
        with torch.no_grad():
            out = net.eval()(torch.zeros(shape))
    except Exception as err:
        raise ValueError(f"the network of {key} fails on inputs of shape {shape[1:]}: {err}.") from err
    _check_output(key, out, data.num_classes)
    nets["coarse"] = net
    ctx.memory_plan = memory_plan(ctx, nets)


# What each planned network is, the setting that names it, and where its training's batch comes from.
_PLANNED = {"local": "one local net", "global": "the global CNN", "coarse": "the coarse DNN"}


def _gib(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def memory_plan(ctx: Context, nets: dict[str, nn.Module]) -> dict:
    """Plan one training step of the local net, the global CNN and the coarse DNN of ``nets`` at the configured batch,
    precision, optimizer, activation checkpointing and device (:func:`ddcnn.models.memory.plan_network`), log it as
    one block and refuse what does not fit the device's memory (a CUDA device's free memory; on the CPU the host's
    available memory, :func:`ddcnn.data.memory.device_memory_bytes`), unless its stage has finished in the run
    directory (and ``force`` is off): it trains no more.

    Returns:
        ``{"global" | "local" | "coarse": NetPlan.as_dict(), "device_memory_bytes", "device"}``
        (``memory_plan.json``).

    Raises:
        ValueError: A network that does not fit, with its numbers and the fixes.
    """
    s, data, dec = ctx.settings, ctx.data, ctx.decomposition
    device = resolve_device(s.device)
    available = device_memory_bytes(device)
    checkpointing = s.loop.activation_checkpointing
    plans: dict[str, NetPlan] = {}
    inputs = {
        "local": ((data.in_channels, *dec.sub_shape), s.data.batch_size, s.loop.optimizer),
        "global": ((data.in_channels, *data.image_shape), s.data.batch_size, s.loop.optimizer),
    }
    coarse_batch = (
        s.coarse.batch_size if isinstance(s.coarse.batch_size, int) else max(1, len(data.y["train"]))
    )  # auto: at most full batches
    inputs["coarse"] = ((dec.num_subdomains, data.num_classes), coarse_batch, s.coarse.optimizer)
    for role, (shape, batch, optimizer) in inputs.items():
        cut = role == "global" and checkpointing in ("global", "all") or role == "local" and checkpointing == "all"
        runs = checkpoint_runs(nets[role]) if cut else None  # a network that cannot be cut is refused here
        plans[role] = plan_network(
            nets[role], shape, batch, precision=s.loop.precision, optimizer=optimizer, runs=runs,
            num_classes=data.num_classes,
        )  # fmt: skip
    record = {role: plan.as_dict() for role, plan in plans.items()}
    record |= {"device_memory_bytes": available, "device": device}
    if (cost := overlap_cost(ctx, nets["local"], plans["local"])) is not None:
        record["overlap_cost"] = cost
    log.info("%s", _plan_block(record, s.loop.precision, s.data.batch_size))
    # A network whose stage has finished trains no more (stage=evaluate of a run trained elsewhere), unless force=true
    finished = {
        "local": not ctx.run.missing_local(dec.num_subdomains),
        "global": ctx.run.is_done("global"),
        "coarse": ctx.run.is_done("coarse"),
    }
    if available is not None:
        for role in ("local", "global", "coarse"):
            if plans[role].peak_bytes > available and (s.force or not finished[role]):
                raise ValueError(_does_not_fit(ctx, role, plans[role], available, device))
    return record


# The memory plan names an overlap's cost once a local step costs this many times more FLOPs, against the overlap-free
# sub-domain, than its voxels grow (docs/cost.md: vgg_small at 32³ 2x2x2, overlap 2: 1.72x the FLOPs for 1.2x).
OVERLAP_COST_NOTE = 1.1


def overlap_cost(ctx: Context, net: nn.Module, local: NetPlan) -> dict | None:
    """What the decomposition's overlap costs one local step: its FLOPs (``local``, the plan at the overlapping
    sub-domain) against the same net's at the overlap-free sub-domain, beside the ratio of their voxels; ``None``
    without overlap. A net whose strided stages round a side up (pooling with ``ceil_mode``, a strided convolution
    with padding) makes an overlap whose sides are not multiples of their total stride cost more than its voxels.

    Decided (issue #47, ``docs/cost.md``): ddcnn keeps the overlap the user gave, since rounding the sides changes the
    decomposition of every existing run, and an overlap is chosen for its accuracy; the plan names the cost instead."""
    s, dec = ctx.settings, ctx.decomposition
    plain = Decomposition(dec.grid, dec.image_shape, 0).sub_shape
    if plain == dec.sub_shape:
        return None
    try:
        free = plan_network(
            net, (ctx.data.in_channels, *plain), s.data.batch_size, precision=s.loop.precision,
            optimizer=s.loop.optimizer, num_classes=ctx.data.num_classes,
        )  # fmt: skip
    except (RuntimeError, ValueError) as err:  # the overlap-free side is below what the net takes (the overlap needed)
        log.debug("no overlap cost: the local net does not run on %s sub-domains (%s)", plain, err)
        return None
    return {
        "overlap": list(dec.overlap),
        "sub_shape": list(dec.sub_shape),
        "overlap_free_shape": list(plain),
        "flops_ratio": local.flops_per_step / max(free.flops_per_step, 1),
        "voxel_ratio": math.prod(dec.sub_shape) / math.prod(plain),
    }


def _plan_block(record: dict, precision: str, batch: int) -> str:
    lines = [
        f"memory plan of one training step on {record['device']} ({_gib(record['device_memory_bytes'])} available), "
        f"{precision}, batch {batch} (MiB; RUN_DIR/memory_plan.json):",
        f"  {'':7}{'params':>9}{'grads':>9}{'optim':>9}{'saved':>11}{'batch':>9}{'peak':>11}{'GFLOP':>10}  method",
    ]
    for role in ("local", "global", "coarse"):
        p = record[role]
        mib = [p[k] / MIB for k in ("params_bytes", "grads_bytes", "optimizer_bytes")]
        lines.append(
            f"  {role:7}{mib[0]:9.1f}{mib[1]:9.1f}{mib[2]:9.1f}{p['activation_bytes'] / MIB:11.1f}"
            f"{p['batch_bytes'] / MIB:9.1f}{p['peak_bytes'] / MIB:11.1f}{p['flops_per_step'] / 1e9:10.2f}  "
            f"{p['method']}{', checkpointed' if p['checkpointing'] else ''}"
        )
    cost = record.get("overlap_cost")
    if cost and cost["flops_ratio"] > OVERLAP_COST_NOTE * cost["voxel_ratio"]:
        shape = "x".join(map(str, cost["sub_shape"]))
        lines.append(
            f"  overlap {max(cost['overlap'])}: a local step on {shape} costs {cost['flops_ratio']:.2f}x the FLOPs of "
            f"the overlap-free {'x'.join(map(str, cost['overlap_free_shape']))} for {cost['voxel_ratio']:.2f}x its "
            "voxels (strided stages round a side up to a multiple of their stride; an overlap giving such sides costs "
            "what its voxels cost: docs/cost.md)"
        )
    return "\n".join(lines)


def _does_not_fit(ctx: Context, role: str, plan: NetPlan, available: int, device: str) -> str:
    s = ctx.settings
    fixes = [f"a smaller data.batch_size (now {s.data.batch_size}; the saved activations scale with it)"]
    if role == "coarse":
        fixes = [f"a smaller coarse.batch_size (now {s.coarse.batch_size})"]
    if s.loop.precision in ("32-true", "64-true") and role != "coarse":
        fixes.append("trainer.precision=bf16-mixed (half the activations; on a GPU with bf16)")
    if not plan.checkpointing and role != "coarse":
        fixes.append(
            f"engine.activation_checkpointing={'all' if role == 'local' else 'global'} (each stage keeps only its "
            f"input for backward)"
        )
    if role == "local":
        fixes.append("more sub-domains (decomposition.grid): smaller inputs for every local net")
    else:
        fixes.append("smaller images (data.image_size) or a smaller global_model")
    if device == "cpu":
        fixes.append("a GPU with more memory (device=cuda) or a machine with more")
    what = {"local": "sub-domains", "global": "full images", "coarse": "local outputs"}[role]
    baseline = (
        " The global CNN is the baseline every result is compared with, so the run is refused rather than reported "
        "without it."
        if role == "global"
        else ""
    )
    parts = {
        "parameters": plan.params_bytes,
        "gradients": plan.grads_bytes,
        "optimizer state": plan.optimizer_bytes,
        "activations saved for backward": plan.activation_bytes,
        "batch": plan.batch_bytes,
    }
    numbers = ", ".join(f"{name} {nbytes / MIB:.1f} MiB" for name, nbytes in parts.items())
    return (
        f"{_PLANNED[role]} does not fit the memory of {device}: one training step on {what} needs "
        f"{_gib(plan.peak_bytes)} ({numbers}; planned on {plan.method} tensors), and {_gib(available)} are "
        f"available.{baseline} Fixes: {'; '.join(fixes)}."
    )


def _built(ctx: Context, key: str, build) -> nn.Module:
    """``build()``, or an error naming the setting ``key``, its ``_target_`` and where the available ones are."""
    try:
        return build()
    except (FileNotFoundError, external.MissingLibrary, pretrained.WeightsError):
        raise  # they name the setting and the fix already
    except Exception as err:
        target = _spec_of(ctx, key).get("_target_", "?")
        raise ValueError(
            f"cannot build the network of {key} (_target_={target}): {' '.join(str(err).split())}. Check the name "
            f"and arguments under {key} in the configuration (conf/{key.split('.')[0]}/ lists the available ones)."
        ) from err


def _spec_of(ctx: Context, key: str) -> dict:
    """The settings of the network of ``key`` (``model``, ``global_model``, ``coarse.net``) as plain data."""
    specs = {
        "model": ctx.settings.model,
        "global_model": ctx.settings.global_model,
        "coarse.net": ctx.settings.coarse.net,
    }
    return specs[key] or {}


def _check_output(key: str, out, num_classes: int) -> None:
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"the network of {key} returns {type(out).__name__}, not a tensor of logits (2, {num_classes}); use a "
            f"classification network that returns one tensor (for MONAI's ViT, classification heads return a tuple)."
        )
    if tuple(out.shape) != (2, num_classes):
        raise ValueError(f"the network of {key} returns shape {tuple(out.shape)}, expected (2, {num_classes}).")


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape)


def _sub_length(n: int, g: int, d: int) -> int:
    """A sub-domain's length along an axis of ``n`` pixels cut into ``g`` parts with overlap ``d`` (as
    :class:`~ddcnn.decomposition.Decomposition` cuts it)."""
    return n if g == 1 else -(-(n + (g - 1) * d) // g)


def _size_fixes(ctx: Context, key: str, smallest: int, local: bool) -> list[str]:
    """Settings that give the network of ``key`` inputs of at least ``smallest`` pixels per side."""
    dec, shape = ctx.decomposition, tuple(ctx.data.image_shape)
    grid, overlap = tuple(dec.grid), tuple(dec.overlap)
    fixes = []
    if local:
        fewer, more = [], []
        for n, g, d in zip(shape, grid, overlap, strict=True):
            fewer.append(max((k for k in range(1, g + 1) if _sub_length(n, k, d) >= smallest), default=None))
            more.append(
                g
                if _sub_length(n, g, d) >= smallest
                else next((e for e in range(d, n + 1) if smallest <= _sub_length(n, g, e) <= n), None)
            )
        if None not in fewer and tuple(fewer) != grid:
            fixes.append(f"fewer sub-domains: decomposition.grid=[{','.join(map(str, fewer))}]")
        if None not in more and grid != (1,) * len(grid):
            more = [
                d if _sub_length(n, g, d) >= smallest else e
                for n, g, d, e in zip(shape, grid, overlap, more, strict=True)
            ]
            fixes.append(f"more overlap: decomposition.overlap=[{','.join(map(str, more))}]")
    sizes = []
    for n, g, d in zip(shape, grid if local else (1,) * len(shape), overlap, strict=True):
        sizes.append(next(m for m in range(n, n + smallest * g + 1) if _sub_length(m, g, d) >= smallest))
    fixes.append(f"larger images: data.image_size=[{','.join(map(str, sizes))}]")
    target = str(_spec_of(ctx, key).get("_target_", ""))
    if target.startswith("ddcnn.") and not target.startswith(external.__name__):  # ddcnn's own VGG, ResNet
        fixes.append(f"another {key}.norm (batch takes single pixels) or a network with fewer stages")
    else:
        fixes.append(
            "a network with a small-input stem (ddcnn's own model=resnet18, whose stem: small keeps the resolution, "
            "or model=vgg_small, which take any size)"
        )
    return fixes


def _forward_shapes(net: nn.Module, state: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """``net`` (eval mode, no gradients) on zeros of ``shape`` with its parameters and buffers as meta tensors
    (``state``): shapes only, whatever the size. A network that cannot run on meta tensors (an operation without a
    meta kernel, Python that reads a value) runs for real, as ddcnn checked every network before it planned memory;
    an input too small fails on meta tensors as it does for real."""
    from torch.func import functional_call

    with torch.no_grad():
        try:
            return functional_call(net.eval(), state, (torch.zeros(shape, device="meta"),))
        except Exception as err:
            meta_error = err
        try:
            out = net.eval()(torch.zeros(shape))
        except Exception:
            raise meta_error from None
    log.info("%s runs on no meta tensors (%s): checked with a real forward", type(net).__name__, meta_error)
    return out


def _check_input_size(ctx: Context, key: str, what: str, net: nn.Module, spatial: tuple[int, ...]) -> None:
    """Run ``net`` on two zero samples of ``spatial``; refuse an input too small with the smallest size it takes and
    the settings that give it; warn when its feature maps collapse to one pixel before its last stages."""
    data = ctx.data
    channels, dims = data.in_channels, data.spatial_dims
    arch = external.describe_arch(_network_spec(_spec_of(ctx, key))[0])
    state = meta_state(net)
    try:
        out = _forward_shapes(net, state, (2, channels, *spatial))
    except Exception as err:
        size_key = (json.dumps(_network_spec(_spec_of(ctx, key))[0], sort_keys=True, default=str), dims, channels)
        smallest = external.smallest_input(net, dims, channels, key=size_key)
        if smallest is not None and min(spatial) < smallest:
            fixes = _size_fixes(ctx, key, smallest, local=what == "sub-domains")
            raise ValueError(
                f"the network of {key} ({arch}) fails on inputs of shape {(channels, *spatial)} ({what} of "
                f"{_shape_text(spatial)}): it needs at least {smallest} pixels per side (the smallest input it runs "
                f"on). Settings that give it {smallest}: {'; '.join(fixes)}."
            ) from err
        raise ValueError(
            f"the network of {key} ({arch}) fails on inputs of shape {(channels, *spatial)}: "
            f"{' '.join(str(err).split())}. Use larger {what} (fewer sub-domains, more overlap or a larger "
            f"data.image_size) or another model/norm."
        ) from err
    _check_output(key, out, data.num_classes)
    report = external.downsampling(net, (channels, *spatial), state=state if out.is_meta else None)
    if report.collapsed:
        log.warning(
            "%s (%s): on %s of %s its feature maps shrink to one pixel before %d of its %d downsampling stages, which "
            "then see a single pixel; it runs, but was designed for inputs of at least %d per side (%s give larger "
            "inputs)",
            key,
            arch,
            what,
            _shape_text(spatial),
            report.collapsed,
            report.stages,
            report.design_size,
            "fewer sub-domains, more overlap or data.image_size" if what == "sub-domains" else "data.image_size",
        )


def build_augment(settings: RunSettings) -> Augment | None:
    """The configured augmentation of whole images (``data.augment``, drawn from the run's ``seed``), or ``None``."""
    spec = settings.data.augment
    if not spec:
        return None
    aug = Augment(spec.get("flip_axes") or (), float(spec.get("rotate_deg") or 0.0), seed=settings.seed)
    return aug if aug.active else None


def subdomain_seed(seed: int, subdomain: int) -> int:
    """Seed of local net ``subdomain``: fixed by the run seed and the index, whatever the worker or order."""
    return (int(seed) * 1_000_003 + 7919 * (int(subdomain) + 1)) % (2**31 - 1)


def instantiate(node, **kwargs):
    """``hydra.utils.instantiate`` that lets our own errors through unwrapped (they already say what to do)."""
    from hydra.errors import InstantiationException

    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError | OSError | ImportError):
            raise cause from None
        raise ValueError(" ".join(str(err).split())) from err


# --- networks ------------------------------------------------------------------------------------
# The pretrained weights file last read in this process (one file per run; N local nets read it once).
_WEIGHTS: dict[tuple, dict[str, torch.Tensor]] = {}
# What loading the weights did to each network built with them (meta.json records it: weights_meta).
_RECORDS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
_LOGGED: set[tuple] = set()


def _network_spec(model_spec: dict) -> tuple[dict, str | None]:
    """The constructor settings of a ``model``/``global_model`` node and its pretrained weights file (or ``None``).

    ``name`` is a label for run directories and reports and ``weights`` is loaded after building, so neither goes to
    the constructor. A ``_target_`` that names a library's constructor (``torchvision.models.mobilenet_v2``) goes
    through that library's adapter, as ``model=torchvision model.arch=mobilenet_v2`` does.
    """
    spec = copy.deepcopy(dict(model_spec))
    spec.pop("name", None)
    path = spec.pop("weights", None)
    spec, dropped = external.adapter_spec(spec)
    if dropped and (key := ("dropped", spec.get("_target_"), tuple(dropped))) not in _LOGGED:
        _LOGGED.add(key)
        log.info(
            "model: %s take no %s (settings of ddcnn's own networks); they are left out. model=%s model.arch=%s "
            "states it without them",
            spec["arch"],
            ", ".join(dropped),
            spec["_target_"].rsplit(".", 1)[1].removesuffix("_net"),
            spec["arch"],
        )
    return spec, (None if path is None else str(path))


def _read_weights(path: str, setting: str) -> tuple[dict[str, torch.Tensor], str]:
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        pretrained.read_weights(path, setting)  # raises the FileNotFoundError that names the setting
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        _WEIGHTS[key] = pretrained.read_weights(resolved, setting)
    return _WEIGHTS[key], str(resolved)


def _build(model_spec: dict, data: Prepared, key: str, weights: bool) -> nn.Module:
    spec, path = _network_spec(model_spec)
    net = instantiate(spec, spatial_dims=data.spatial_dims, in_channels=data.in_channels, num_classes=data.num_classes)
    if weights and path is not None:
        state, resolved = _read_weights(path, f"{key}.weights")
        record = pretrained.load_weights(net, state, data.in_channels, data.num_classes, source=f"{key}.weights")
        _RECORDS[net] = {"setting": f"{key}.weights", "path": resolved, "sha256": file_sha256(resolved), **record}
    return net


def build_local_net(settings: RunSettings, data: Prepared, weights: bool = True) -> nn.Module:
    """A local net as ``model`` says, with the pretrained weights of ``model.weights`` unless ``weights=False``."""
    return _build(settings.model, data, "model", weights)


def build_global_net(settings: RunSettings, data: Prepared, weights: bool = True) -> nn.Module:
    """The global CNN as ``global_model`` says (``null``: as ``model``), with its pretrained weights unless
    ``weights=False``."""
    if settings.global_model:
        return _build(settings.global_model, data, "global_model", weights)
    return _build(settings.model, data, "model", weights)


def weights_meta(net: nn.Module) -> dict:
    """``{"pretrained_weights": ...}`` for a network built here with pretrained weights (for a CNN-DNN, those of its
    local nets): the file, its SHA-256 and what loading adapted; ``{}`` otherwise. Stages add it to ``meta.json``."""
    for module in net.modules():
        if module in _RECORDS:
            return {"pretrained_weights": dict(_RECORDS[module])}
    return {}


def _log_weights(key: str, net: nn.Module) -> None:
    record = _RECORDS.get(net)
    if record is None or (key, record["sha256"]) in _LOGGED:
        return
    _LOGGED.add((key, record["sha256"]))
    parts = [f"loaded {record['loaded']} tensors from {record['path']} (sha256 {record['sha256'][:12]})"]
    if record["prefix"]:
        parts.append(f"without the prefix {record['prefix']!r} of its keys")
    if record["first_conv"]:
        conv = record["first_conv"]
        parts.append(f"first convolution {conv['tensor']} adapted to {conv['channels']} channel(s): {conv['rule']}")
    if record["classifier"]:
        head = record["classifier"]
        had = "none" if head["file_classes"] is None else head["file_classes"]
        parts.append(
            f"classifier {', '.join(head['tensors'])} re-initialised (the file's class count: {had}; the data's: "
            f"{head['classes']})"
        )
    if record["ignored"]:
        parts.append(
            f"{len(record['ignored'])} tensors of the file have no place in the network, e.g. {record['ignored'][:3]}"
        )
    log.info("%s.weights: %s", key, "; ".join(parts))


def coarse_net_spec(coarse: CoarseSettings, kind: str | None = None) -> dict:
    """The coarse DNN's constructor settings (``coarse.net``) for local outputs of ``kind`` (default
    ``coarse.input``), as plain data: the coarse stage records them in its ``meta.json``, and a finished coarse DNN is
    rebuilt from that record (:func:`finished_coarse_spec`), whatever the configuration says today."""
    spec = copy.deepcopy(coarse.net)
    target = str(spec.get("_target_", ""))
    if target.endswith("CoarseMLP"):
        spec["inputs"] = str(kind or coarse.input)
    return spec


def finished_coarse_spec(ctx: Context, stage: str = "coarse") -> dict:
    """The settings a finished coarse stage was built with: those recorded in its ``meta.json``; for a stage
    finished before ddcnn recorded them, the configuration's ``coarse.net`` without the settings added since (input
    scaling, skips), whose defaults are the plain MLP that such a stage trained."""
    meta = ctx.run.meta(stage)
    if isinstance(meta.get("coarse_net"), dict):
        return dict(meta["coarse_net"])
    spec = copy.deepcopy(ctx.settings.coarse.net)
    for key in ("inputs", "input_norm", "skip", "linear"):
        spec.pop(key, None)
    return spec


def finished_coarse_input(ctx: Context) -> str:
    """The local output (``probs`` or ``logits``) the finished coarse DNN of the run was trained on, as its
    ``meta.json`` records it (every coarse stage has since the setting existed, whose default was then ``probs``); it
    may differ from ``coarse.input`` in a run directory of an older default."""
    return str(ctx.run.meta("coarse").get("input", "probs"))


def build_coarse_net(
    coarse: CoarseSettings, num_subdomains: int, num_classes: int, kind: str | None = None, spec: dict | None = None
) -> nn.Module:
    """The coarse DNN of ``spec`` (default: :func:`coarse_net_spec` of the ``coarse`` settings for local outputs of
    ``kind``)."""
    spec = coarse_net_spec(coarse, kind) if spec is None else spec
    return instantiate(spec, num_subdomains=num_subdomains, num_classes=num_classes)


def count_parameters(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def assemble_cnn_dnn(ctx: Context) -> CNNDNN:
    """The CNN-DNN of a finished run as one module, from the saved local nets and coarse DNN."""
    n = ctx.decomposition.num_subdomains
    missing = ctx.run.missing_local(n) + ([] if ctx.run.is_done("coarse") else ["coarse"])
    if missing:
        raise FileNotFoundError(f"cannot assemble the CNN-DNN of {ctx.run.root}: stages {missing} have not finished.")
    nets = []
    for i in range(n):
        net = build_local_net(ctx.settings, ctx.data, weights=False)  # its trained weights follow
        net.load_state_dict(load_run_file(ctx.run.stage_dir("local", i) / "net.pt"))
        nets.append(net)
    coarse = build_coarse_net(ctx.settings.coarse, n, ctx.data.num_classes, spec=finished_coarse_spec(ctx))
    coarse.load_state_dict(load_run_file(ctx.run.stage_dir("coarse") / "net.pt"))
    model = CNNDNN(ctx.decomposition, nets, coarse, finished_coarse_input(ctx))
    return model.eval()
