"""What every stage of a run shares: the configuration, the data, the decomposition and the networks.

:func:`build_context` loads and checks everything a stage needs before anything is written; the network
builders turn the ``model``, ``global_model`` and ``coarse.net`` settings into modules. Nothing here imports
Lightning, so a process that only coordinates (the parent of ``parallel.workers`` processes, the rank-0 check
of a launcher) starts in a fraction of the time a training process needs; the stages that train live in
the modules of :mod:`ddcnn.stages`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddcnn import registry
from ddcnn.data.augment import Augment
from ddcnn.data.prepare import Prepared, PrepareSettings, load_prepared
from ddcnn.data.sources import NOT_IDENTITY
from ddcnn.decomposition import Decomposition
from ddcnn.models.cnn_dnn import CNNDNN
from ddcnn.rundir import RunDir
from ddcnn.store import Store, default_root

__all__ = [
    "Context",
    "load_data",
    "data_store",
    "build_context",
    "check_settings",
    "resolve_data_counts",
    "check_networks",
    "check_methods",
    "tuple_or_int",
    "build_augment",
    "subdomain_seed",
    "instantiate",
    "build_local_net",
    "build_global_net",
    "build_coarse_net",
    "coarse_net_spec",
    "finished_coarse_spec",
    "count_parameters",
    "ddp_devices",
    "assemble_cnn_dnn",
]


@dataclass
class Context:
    """What every stage of one run shares: the configuration, the data and the decomposition."""

    cfg: DictConfig
    run: RunDir
    data: Prepared
    decomposition: Decomposition


def data_store(cfg: DictConfig) -> Store:
    """The store of prepared data (``store.root``, else ``$DDCNN_STORE``, else ``~/.cache/ddcnn``)."""
    node = cfg.get("store") or {}
    return Store(default_root(node.get("root")), stale_after_s=float(node.get("stale_after_s", 120) or 120))


def _accepts(target: str, name: str) -> bool:
    import inspect

    from hydra.utils import get_method

    try:
        return name in inspect.signature(get_method(target)).parameters
    except (ValueError, TypeError, ImportError, AttributeError):
        return False


def _count(value) -> int | str:
    """A data-derived count as set: ``auto`` (the data decide) or a whole number."""
    return "auto" if value == "auto" else int(value)


def load_data(cfg: DictConfig) -> Prepared:
    """The configured source's prepared splits, in memory or memory-mapped from the store as ``data.memory`` says
    (same numbers in every stage and process; see :mod:`ddcnn.data.prepare`)."""
    d = cfg.data
    spec = OmegaConf.to_container(d.source, resolve=True)
    target = str(spec.get("_target_", ""))
    extra = {"lazy": True} if _accepts(target, "lazy") else {}
    if _accepts(target, "in_channels"):  # a source that can read 1 or 3 channels (image files) reads data.in_channels
        extra["in_channels"] = _count(d.in_channels)
    image_size, window = d.get("image_size"), d.get("window")
    settings = PrepareSettings(
        num_classes=_count(d.num_classes),
        in_channels=_count(d.in_channels),
        spatial_dims=int(d.spatial_dims),
        image_size=tuple(image_size) if image_size is not None else None,
        val_fraction=float(d.get("val_fraction", 0.1)),
        split_seed=int(d.get("split_seed", 0)),
        train_subset=d.get("train_subset"),
        test_subset=d.get("test_subset"),
        normalize=bool(d.get("normalize", True)),
        float_storage=d.get("float_storage"),
        window=tuple(window) if window is not None else None,
    )
    memory = d.get("memory") or {}
    store = cfg.get("store") or {}
    return load_prepared(
        lambda: instantiate(d.source, **extra),
        {k: v for k, v in spec.items() if k not in NOT_IDENTITY},
        settings,
        mode=str(memory.get("mode", "auto")),
        auto_max_mb=float(memory.get("auto_max_mb", 256)),
        limit_gb=memory.get("limit_gb"),
        store=data_store(cfg),
        stage_to=store.get("stage_to"),
    )


def build_context(
    cfg: DictConfig, run_dir: str | Path | None = None, claim: bool = True, data: Prepared | None = None
) -> Context:
    """Load the data, build the decomposition, check the networks and (``claim``) the run directory.

    With ``claim=False`` the caller checks further settings first and then calls
    ``ctx.run.check_fingerprint(ctx.cfg)`` itself. ``ctx.cfg`` is ``cfg`` with ``data.num_classes`` and
    ``data.in_channels`` set to the data's where they were ``auto`` (:func:`resolve_data_counts`). ``data`` skips
    loading: the parent of the parallel workers hands them the data it prepared (the tensors in shared memory, or the
    store entry that each worker maps) instead of each worker reading and preparing them again.
    """
    run = RunDir(run_dir if run_dir is not None else cfg.paths.run_dir)
    check_settings(cfg)
    if data is None:
        data = load_data(cfg)
    cfg = resolve_data_counts(cfg, data)
    dec = Decomposition(tuple(cfg.decomposition.grid), data.image_shape, tuple_or_int(cfg.decomposition.overlap))
    ctx = Context(cfg, run, data, dec)
    check_networks(ctx)
    if claim:  # only a configuration that can run claims the run directory
        run.check_fingerprint(cfg)
    return ctx


def _positive_int(cfg: DictConfig, key: str, auto: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        also = " or auto (taken from the data)" if auto else ""
        raise ValueError(
            f"{key} must be a positive whole number{also}, got {value!r}; set {key}=<n> with n >= 1{also}."
        )


def resolve_data_counts(cfg: DictConfig, data: Prepared) -> DictConfig:
    """``cfg``, or a copy with ``data.num_classes`` / ``data.in_channels`` that were ``auto`` set to the data's: what
    the stages read, and what the run directory's fingerprint records (a run of 4 classes is not a run of 5)."""
    auto = [key for key in ("num_classes", "in_channels") if cfg.data.get(key) == "auto"]
    if not auto:
        return cfg
    import copy

    from omegaconf import open_dict

    out = copy.deepcopy(cfg)
    with open_dict(out):
        for key in auto:
            out.data[key] = int(getattr(data, key))
    return out


def check_settings(cfg: DictConfig) -> None:
    """Settings that would only fail deep inside a stage, checked before anything is read or written."""
    for key in ("data.batch_size", "trainer.max_epochs"):
        _positive_int(cfg, key)
    for key in ("coarse.batch_size", "coarse.max_epochs", "coarse.steps"):
        if OmegaConf.select(cfg, key) not in ("auto", None):
            _positive_int(cfg, key)
    kind = cfg.coarse.get("input", "probs")
    if kind not in ("probs", "logits"):
        raise ValueError(f"coarse.input must be 'probs' or 'logits', got {kind!r}.")
    monitor = cfg.coarse.get("monitor", "val_acc")
    if monitor not in ("val_loss", "val_acc"):
        raise ValueError(f"coarse.monitor must be val_loss or val_acc (the validation split selects), got {monitor!r}.")
    frac = cfg.data.get("val_fraction", 0.1)
    if not isinstance(frac, int | float) or not 0 < frac < 1:
        raise ValueError(f"data.val_fraction must lie strictly between 0 and 1, got {frac!r}.")
    for key in ("data.num_classes", "data.in_channels"):
        _positive_int(cfg, key, auto=True)
    if cfg.data.spatial_dims not in (2, 3):
        raise ValueError(f"data.spatial_dims must be 2 (images) or 3 (volumes), got {cfg.data.spatial_dims!r}.")
    reuse = (cfg.get("store") or {}).get("reuse", True)
    if not isinstance(reuse, bool):
        raise ValueError(f"store.reuse must be true or false (reuse the global CNN of an earlier run), got {reuse!r}.")
    check_methods(cfg)
    enabled = (cfg.get("methods") or {}).get("enabled") or {}
    if enabled.get("global_ddp") or cfg.get("stage") == "global_ddp":
        ddp_devices(cfg)


def check_methods(cfg: DictConfig) -> None:
    """``methods``: ``enabled.<stage>`` and ``<stage>: {settings}`` only for optional stages of the registry."""
    methods = cfg.get("methods") or {}
    known = set(registry.OPTIONAL_STAGES)
    unknown = sorted(set(methods.get("enabled") or {}) - known)
    if unknown:
        raise ValueError(f"methods.enabled has unknown stages {unknown}; the optional stages are {sorted(known)}.")
    unknown = sorted(set(methods) - known - {"enabled"})
    if unknown:
        raise ValueError(
            f"methods has settings for unknown stages {unknown}; the optional stages are {sorted(known)} "
            f"(ddcnn/registry.py)."
        )


def ddp_devices(cfg: DictConfig) -> int:
    """The number of DDP processes of the ``global_ddp`` stage, checked against the batch size."""
    value = ((cfg.get("methods") or {}).get("global_ddp") or {}).get("num_devices", 2)
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(
            f"methods.global_ddp.num_devices must be a whole number >= 2 (one device is the global CNN itself), "
            f"got {value!r}."
        )
    batch = int(cfg.data.batch_size)
    if batch % value:
        raise ValueError(
            f"methods.global_ddp.num_devices={value} does not divide data.batch_size={batch}: the DDP run keeps the "
            f"global batch, {batch / value:g} samples per device. Choose a divisor of {batch}."
        )
    return value


def check_networks(ctx: Context) -> None:
    """Build the local, global and coarse networks once and run two samples through them.

    Catches a wrong model name, argument or an input too small for the network before any stage writes
    anything, with a message that names the setting.
    """
    cfg, data, dec = ctx.cfg, ctx.data, ctx.decomposition
    checks = [
        ("model", lambda: build_local_net(cfg, data), (2, data.in_channels, *dec.sub_shape)),
        (
            "global_model" if cfg.get("global_model") else "model",
            lambda: build_global_net(cfg, data),
            (2, data.in_channels, *data.image_shape),
        ),
        (
            "coarse.net",
            lambda: build_coarse_net(cfg, dec.num_subdomains, data.num_classes),
            (2, dec.num_subdomains, data.num_classes),
        ),
    ]
    for key, build, shape in checks:
        try:
            net = build()
        except Exception as err:
            target = OmegaConf.select(cfg, f"{key}._target_", default="?")
            raise ValueError(
                f"cannot build the network of {key} (_target_={target}): {' '.join(str(err).split())}. Check the "
                f"name and arguments under {key} in the configuration (conf/{key.split('.')[0]}/ lists the available "
                "ones)."
            ) from err
        try:
            with torch.no_grad():
                out = net.eval()(torch.zeros(shape))
        except Exception as err:
            raise ValueError(
                f"the network of {key} fails on inputs of shape {tuple(shape[1:])}: {err}. Use larger sub-domains "
                f"(fewer sub-domains, more overlap or a larger data.image_size) or another model/norm."
            ) from err
        if tuple(out.shape) != (2, data.num_classes):
            raise ValueError(
                f"the network of {key} returns shape {tuple(out.shape)}, expected (2, {data.num_classes})."
            )


def tuple_or_int(value) -> int | float | tuple:
    """A config scalar or list as the Decomposition takes it (it validates the values itself)."""
    return value if isinstance(value, int | float) else tuple(value)


def build_augment(cfg: DictConfig) -> Augment | None:
    """The configured augmentation of whole images (``data.augment``), or ``None``."""
    spec = cfg.data.get("augment")
    if not spec:
        return None
    aug = Augment(spec.get("flip_axes", ()) or (), float(spec.get("rotate_deg", 0.0) or 0.0), seed=int(cfg.seed))
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
        if isinstance(cause, ValueError | OSError):
            raise cause from None
        raise ValueError(" ".join(str(err).split())) from err


# --- networks ------------------------------------------------------------------------------------
def _build(model_cfg: DictConfig, data: Prepared) -> nn.Module:
    spec = OmegaConf.to_container(model_cfg, resolve=True)
    spec.pop("name", None)  # a label for run directories and reports, not a constructor argument
    return instantiate(spec, spatial_dims=data.spatial_dims, in_channels=data.in_channels, num_classes=data.num_classes)


def build_local_net(cfg: DictConfig, data: Prepared) -> nn.Module:
    return _build(cfg.model, data)


def build_global_net(cfg: DictConfig, data: Prepared) -> nn.Module:
    return _build(cfg.get("global_model") or cfg.model, data)


def coarse_net_spec(cfg: DictConfig, kind: str | None = None) -> dict:
    """The coarse DNN's constructor settings (``coarse.net``) for local outputs of ``kind`` (default
    ``coarse.input``), as plain data: the coarse stage records them in its ``meta.json``, and a finished coarse DNN is
    rebuilt from that record (:func:`finished_coarse_spec`), whatever the configuration says today."""
    spec = OmegaConf.to_container(cfg.coarse.net, resolve=True)
    target = str(spec.get("_target_", ""))
    if target.endswith("CoarseMLP"):
        spec["inputs"] = str(kind or cfg.coarse.get("input", "probs"))
    return spec


def finished_coarse_spec(ctx: Context, stage: str = "coarse") -> dict:
    """The settings a finished coarse stage was built with: those recorded in its ``meta.json``; for a stage
    finished before ddcnn recorded them, the configuration's ``coarse.net`` without the settings added since (input
    scaling, skips), whose defaults are the plain MLP that such a stage trained."""
    meta = ctx.run.meta(stage)
    if isinstance(meta.get("coarse_net"), dict):
        return dict(meta["coarse_net"])
    spec = OmegaConf.to_container(ctx.cfg.coarse.net, resolve=True)
    for key in ("inputs", "input_norm", "skip", "linear"):
        spec.pop(key, None)
    return spec


def build_coarse_net(
    cfg: DictConfig, num_subdomains: int, num_classes: int, kind: str | None = None, spec: dict | None = None
) -> nn.Module:
    """The coarse DNN of ``spec`` (default: :func:`coarse_net_spec` of ``cfg`` for local outputs of ``kind``)."""
    spec = coarse_net_spec(cfg, kind) if spec is None else spec
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
        net = build_local_net(ctx.cfg, ctx.data)
        net.load_state_dict(torch.load(ctx.run.stage_dir("local", i) / "net.pt", weights_only=True))
        nets.append(net)
    kind = str(ctx.run.meta("coarse").get("input") or ctx.cfg.coarse.get("input", "probs"))
    coarse = build_coarse_net(ctx.cfg, n, ctx.data.num_classes, kind=kind, spec=finished_coarse_spec(ctx))
    coarse.load_state_dict(torch.load(ctx.run.stage_dir("coarse") / "net.pt", weights_only=True))
    model = CNNDNN(ctx.decomposition, nets, coarse, kind)
    return model.eval()
