"""``RunSettings``: the composed Hydra configuration as frozen, typed sections, checked once at the entry.

:meth:`RunSettings.from_config` reads the composed configuration (``conf/config.yaml`` with its groups and the
command line), refuses unknown keys with the known ones listed and checks every setting with a message that names
the setting, the value and the fix. What it builds holds plain Python data only (no OmegaConf object), so it pickles
to worker processes, which take it as checked. The networks' (``model``, ``global_model``, ``coarse.net``), the
optimizers' (``optimizer``, ``coarse.optimizer``), the schedulers' and the data source's settings stay ``_target_``
specs, as plain dicts.

Defaults live in YAML only: a key missing from the configuration (a ``config.yaml`` written by an older ddcnn into a
run directory) takes the value of the YAML file that holds its default (:func:`yaml_default`), never a value written
here. The setting names are those of the YAML (``settings.store.reuse`` is ``store.reuse``); ``trainer``,
``engine``, ``optimizer`` and ``scheduler`` are the loop's :class:`~ddcnn.settings.loop.LoopSettings`
(``settings.loop.max_epochs`` is ``trainer.max_epochs``).

The settings keep the configuration they were read from as plain data (:attr:`RunSettings.recorded`): the run
directory's fingerprint and ``config.yaml`` are computed from it (:meth:`RunSettings.identity`), as they were from the
configuration before these settings existed, so run directories written then stay valid.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddcnn import registry
from ddcnn.data.prepare import PrepareSettings
from ddcnn.rundir import (
    CHANGED_DEFAULTS,
    INERT_WITHOUT,
    RECORD_ABSENT_MEANS,
    RunDir,
    RunIdentity,
    flatten,
    flatten_recorded,
)
from ddcnn.settings.loop import LoopSettings, check_srun_ddp, resolve_precise_bn
from ddcnn.settings.read import AUTO, Section, positive_int, yaml_default

__all__ = [
    "RunSettings",
    "DataSettings",
    "MemorySettings",
    "DecompositionSettings",
    "CoarseSettings",
    "CoarseLinearSettings",
    "MethodsSettings",
    "StackerSettings",
    "LocalOofSettings",
    "FineTuneSettings",
    "GlobalTransferSettings",
    "GlobalDdpSettings",
    "GlobalEnsembleSettings",
    "ParallelSettings",
    "CurveSettings",
    "ReportSettings",
    "StoreSettings",
    "STAGES",
    "yaml_default",
]

log = logging.getLogger(__name__)

# What ``stage`` may say besides ``all``: every stage of the registry, in run order, then the evaluation.
STAGES = (*registry.STAGE_NAMES, "evaluate")


def _bool(value: Any, key: str, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false ({what}), got {value!r}.")
    return value


def _number(value: Any, key: str, none: bool = False) -> float | None:
    if none and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{key} must be a number >= 0{' or null' if none else ''}, got {value!r}.")
    return float(value)


def _seconds(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{key} must be a positive number of seconds, got {value!r}.")
    return float(value)


def _spec(value: Any) -> dict | None:
    """A ``_target_`` spec (or any nested setting) as a plain dict; ``None`` stays ``None``."""
    return None if value is None else dict(value)


def _tuple(value: Any) -> tuple | None:
    return None if value is None else tuple(value)


def _image_size(value: Any, dims: int) -> tuple[int, ...] | None:
    """``data.image_size``: null, one size per axis, or one whole number for every axis (``data.image_size=64``, as
    the image-folder source reads it)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (int(value),) * dims
    return _tuple(value)


# --- data ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemorySettings:
    """``data.memory``: how a process holds the prepared data (none of it changes results)."""

    mode: str
    auto_max_mb: float
    limit_gb: float | None


# Where data.val_target_fraction carves the target split from.
VAL_TARGET_FROM = ("val", "train")


@dataclass(frozen=True, kw_only=True)
class DataSettings(PrepareSettings):
    """``data``: the source and its preparation. The preparation's fields and their checks are
    :class:`~ddcnn.data.prepare.PrepareSettings`' (which a preparation reads from these settings); ``num_classes`` /
    ``in_channels`` may be ``auto`` until the data are read (:meth:`RunSettings.with_data_counts`). ``extra`` holds the
    dataset's own keys (``path``, ``root``, ``resize_mode``, ...), which its ``source`` spec reads and checks."""

    name: str
    source: dict
    val_target_fraction: float
    val_target_from: str
    batch_size: int
    memory: MemorySettings
    augment: dict | None
    extra: dict = field(default_factory=dict)
    # data.split_seed was null: the run's seed, unless the run directory holds the old default (RunSettings.in_run_dir)
    split_seed_from_seed: bool = False

    @classmethod
    def read(cls, d: Section, seed: int = 0) -> DataSettings:
        """The ``data`` section; ``seed`` (the run's) is the split seed where ``data.split_seed`` is null."""
        batch = positive_int(d("batch_size"), "data.batch_size")
        frac = d("val_fraction")
        if not isinstance(frac, int | float) or not 0 < frac < 1:
            raise ValueError(f"data.val_fraction must lie strictly between 0 and 1, got {frac!r}.")
        target = d("val_target_fraction")
        if target is None:
            target = 0.0
        if isinstance(target, bool) or not isinstance(target, int | float) or not 0 <= target < 1:
            raise ValueError(
                f"data.val_target_fraction must lie in [0, 1) (the share of the split named by "
                f"data.val_target_from, validation by default, kept for the fixed targets of docs/protocol.md; 0 = "
                f"none), got {target!r}."
            )
        target_from = d("val_target_from")
        if target_from not in VAL_TARGET_FROM:
            raise ValueError(
                f"data.val_target_from must be one of {', '.join(VAL_TARGET_FROM)} (the split the target split of "
                f"data.val_target_fraction is carved from), got {target_from!r}."
            )
        num_classes = positive_int(d("num_classes"), "data.num_classes", auto=True)
        in_channels = positive_int(d("in_channels"), "data.in_channels", auto=True)
        dims = d("spatial_dims")
        if dims not in (2, 3):
            raise ValueError(f"data.spatial_dims must be 2 (images) or 3 (volumes), got {dims!r}.")
        split_seed = d("split_seed")
        if split_seed is not None and (isinstance(split_seed, bool) or not isinstance(split_seed, int)):
            raise ValueError(
                f"data.split_seed must be a whole number or null (null: the run's seed, a data draw per seed), got "
                f"{split_seed!r}."
            )
        m = d.sub("memory")
        memory = m.done(MemorySettings(str(m("mode")), float(m("auto_max_mb")), m("limit_gb")))
        out = cls(
            name=str(d("name")),
            source=_spec(d("source")),
            spatial_dims=int(dims),
            in_channels=in_channels,
            num_classes=num_classes,
            image_size=_image_size(d("image_size"), int(dims)),
            val_fraction=float(frac),
            val_target_fraction=float(target),
            val_target_from=str(target_from),
            split_seed=int(seed if split_seed is None else split_seed),
            split_seed_from_seed=split_seed is None,
            train_subset=d("train_subset"),
            test_subset=d("test_subset"),
            normalize=bool(d("normalize")),
            batch_size=batch,
            float_storage=d("float_storage"),
            window=_tuple(d("window")),
            memory=memory,
            augment=_spec(d("augment")),
        )
        # The dataset's own keys (path, root, resize_mode, ...): its source spec interpolates and checks them.
        return dataclasses.replace(out, extra={k: v for k, v in d.given.items() if k not in d.read})


@dataclass(frozen=True)
class DecompositionSettings:
    """``decomposition``: the grid of sub-domains (row-major, last axis fastest) and the overlap in pixels; the
    :class:`~ddcnn.decomposition.Decomposition` checks them against the image shape."""

    name: str
    grid: tuple[int, ...]
    overlap: int | float | tuple

    @classmethod
    def read(cls, d: Section) -> DecompositionSettings:
        overlap = d("overlap")
        out = cls(str(d("name")), tuple(d("grid")), overlap if isinstance(overlap, int | float) else tuple(overlap))
        return d.done(out)


# --- the coarse DNN ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CoarseLinearSettings:
    """``coarse.linear``: the exact linear path fit first (multinomial logistic regression by L-BFGS)."""

    enabled: bool
    l2_grid: tuple[float, ...]
    max_rows: int
    max_iter: int


@dataclass(frozen=True)
class CoarseSettings:
    """``coarse``: the coarse DNN on the local nets' outputs and its fit (:func:`ddcnn.stages.coarse.fit_coarse`).

    ``batch_size`` / ``max_epochs`` may be ``auto`` (:func:`ddcnn.stages.coarse.coarse_plan`); ``patience: null``
    trains ``max_epochs``; ``checkpoint_every: null`` writes ``last.ckpt`` after the last epoch only. Any other key
    set to ``null`` takes its YAML default."""

    input: str
    max_epochs: int | str
    batch_size: int | str
    steps: int
    monitor: str
    patience: int | None
    divergence_restarts: int
    checkpoint_every: int | None
    num_threads: int | None
    linear: CoarseLinearSettings
    net: dict
    optimizer: dict
    scheduler: dict | None

    @classmethod
    def read(cls, c: Section) -> CoarseSettings:
        for key in ("batch_size", "max_epochs"):
            if c.default(key) != AUTO:
                positive_int(c.default(key), f"coarse.{key}")
        steps = positive_int(c.default("steps"), "coarse.steps")
        kind = c("input")
        if kind not in ("probs", "logits"):
            raise ValueError(f"coarse.input must be 'probs' or 'logits', got {kind!r}.")
        monitor = c.default("monitor")
        if monitor not in ("val_loss", "val_acc"):
            raise ValueError(
                f"coarse.monitor must be val_loss or val_acc (the validation split selects), got {monitor!r}."
            )
        restarts = c.default("divergence_restarts")
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ValueError(f"coarse.divergence_restarts must be >= 0, got {restarts!r}.")
        lin = c.sub("linear")
        linear = CoarseLinearSettings(
            bool(lin.default("enabled")),
            tuple(float(v) for v in lin.default("l2_grid")),
            int(lin.default("max_rows")),
            int(lin.default("max_iter")),
        )
        lin.done()
        every = c("checkpoint_every")
        out = cls(
            input=str(kind),
            max_epochs=c.default("max_epochs"),
            batch_size=c.default("batch_size"),
            steps=steps,
            monitor=str(monitor),
            patience=c("patience"),
            divergence_restarts=int(restarts),
            checkpoint_every=None if every is None else int(every),
            num_threads=c("num_threads"),
            linear=linear,
            net=_spec(c("net")),
            optimizer=_spec(c("optimizer")),
            scheduler=_spec(c("scheduler")),
        )
        return c.done(out)


# --- the optional methods (one class per method with settings) -----------------------------------
def _method_epochs(m: Section, stage: str) -> int | None:
    return positive_int(m("max_epochs"), f"methods.{stage}.max_epochs", none=True)


def _positive_scale(scale: Any, name: str) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < math.inf:
        raise ValueError(f"{name} must be a positive number (a factor on optimizer.lr), got {scale!r}.")
    return float(scale)


def _lr_scale(m: Section, stage: str) -> float:
    return _positive_scale(m("lr_scale"), f"methods.{stage}.lr_scale")


@dataclass(frozen=True)
class StackerSettings:
    """``methods.stacker``: the convex stacker's L2 strengths (strongest first) and L-BFGS evaluations."""

    l2_grid: tuple[float, ...]
    max_iter: int

    @classmethod
    def read(cls, m: Section) -> StackerSettings:
        return cls(tuple(float(v) for v in m("l2_grid")), int(m("max_iter")))


@dataclass(frozen=True)
class LocalOofSettings:
    """``methods.local_oof``: k of the k-fold cross-fitting."""

    folds: int

    @classmethod
    def read(cls, m: Section) -> LocalOofSettings:
        return cls(int(m("folds")))


@dataclass(frozen=True)
class FineTuneSettings:
    """``methods.e2e`` / ``methods.transfer``: epochs (``None``: ``trainer.max_epochs``) and learning-rate scale."""

    max_epochs: int | None
    lr_scale: float

    @classmethod
    def read(cls, m: Section) -> FineTuneSettings:
        stage = m.name.rsplit(".", 1)[1]
        return cls(_method_epochs(m, stage), _lr_scale(m, stage))


@dataclass(frozen=True)
class GlobalTransferSettings:
    """``methods.global_transfer``: which local net initialises the global CNN, epochs and learning-rate scale."""

    init: str | int
    max_epochs: int | None
    lr_scale: float

    @classmethod
    def read(cls, m: Section) -> GlobalTransferSettings:
        return cls(m("init"), _method_epochs(m, "global_transfer"), _lr_scale(m, "global_transfer"))


@dataclass(frozen=True)
class GlobalDdpSettings:
    """``methods.global_ddp``: the DDP processes of the global CNN (checked against ``data.batch_size`` when the
    stage runs)."""

    num_devices: int

    @classmethod
    def read(cls, m: Section) -> GlobalDdpSettings:
        return cls(m("num_devices"))


@dataclass(frozen=True)
class GlobalEnsembleSettings:
    """``methods.global_ensemble``: the number of global CNNs, ``k >= 2`` or ``auto`` (the CNN-DNN's one-device
    training time over the global CNN's, rounded, at least 2: :func:`ddcnn.stages.global_ensemble.ensemble_size`)."""

    k: int | str

    @classmethod
    def read(cls, m: Section) -> GlobalEnsembleSettings:
        k = m("k")
        if k != AUTO and (isinstance(k, bool) or not isinstance(k, int) or k < 2):
            raise ValueError(
                f"methods.global_ensemble.k must be a whole number >= 2 (an ensemble of one is the global CNN) or auto "
                f"(the CNN-DNN's one-device training time over the global CNN's), got {k!r}."
            )
        return cls(k)


_METHOD_CLASSES = {
    "stacker": StackerSettings,
    "local_oof": LocalOofSettings,
    "e2e": FineTuneSettings,
    "transfer": FineTuneSettings,
    "global_transfer": GlobalTransferSettings,
    "global_ddp": GlobalDdpSettings,
    "global_ensemble": GlobalEnsembleSettings,
}


@dataclass(frozen=True)
class MethodsSettings:
    """``methods``: which optional stages ``stage=all`` runs (``enabled``) and each method's own settings."""

    enabled: dict[str, bool]
    stacker: StackerSettings
    local_oof: LocalOofSettings
    e2e: FineTuneSettings
    transfer: FineTuneSettings
    global_transfer: GlobalTransferSettings
    global_ddp: GlobalDdpSettings
    global_ensemble: GlobalEnsembleSettings

    @classmethod
    def read(cls, m: Section) -> MethodsSettings:
        known = set(registry.OPTIONAL_STAGES)
        enabled = dict(m("enabled") or {})
        unknown = sorted(set(enabled) - known)
        if unknown:
            optional = list(registry.OPTIONAL_STAGES)
            raise ValueError(f"methods.enabled has unknown stages {unknown}; the optional stages are {optional}.")
        unknown = sorted(set(m.given) - known - {"enabled"})
        if unknown:
            raise ValueError(
                f"methods has settings for unknown stages {unknown}; the optional stages are {sorted(known)} "
                f"(ddcnn/registry.py)."
            )
        sections = {}
        for stage, kind in _METHOD_CLASSES.items():
            sub = m.sub(stage)
            sections[stage] = sub.done(kind.read(sub))
        for stage in known - set(_METHOD_CLASSES):
            if m.given.get(stage):
                Section(f"methods.{stage}", m.given[stage]).done()  # it has none: each key is refused
        return cls(enabled={name: bool(enabled.get(name, False)) for name in registry.OPTIONAL_STAGES}, **sections)

    def settings_of(self, stage: str) -> Any:
        """The settings of optional stage ``stage`` (``None`` for a method without settings)."""
        return getattr(self, stage, None) if stage in _METHOD_CLASSES else None


# --- where the local stage runs, what the evaluation writes, the store ---------------------------
@dataclass(frozen=True)
class ParallelSettings:
    """``parallel``: where the local stage runs (none of it changes results; :mod:`ddcnn.parallel`)."""

    workers: int
    accelerator: str
    threads_per_worker: int | None
    calibration_steps: int
    mode: str
    heartbeat_timeout_s: float
    startup_timeout_s: float

    @classmethod
    def read(cls, p: Section) -> ParallelSettings:
        mode = p("mode")
        if mode not in ("auto", "srun", "single"):
            raise ValueError(
                f"parallel.mode must be auto (shard under srun -n G), srun (require it) or single (never shard), "
                f"got {mode!r}."
            )
        out = cls(
            workers=positive_int(p("workers"), "parallel.workers"),
            accelerator=str(p("accelerator")),
            threads_per_worker=positive_int(p("threads_per_worker"), "parallel.threads_per_worker", none=True),
            calibration_steps=int(_number(p("calibration_steps"), "parallel.calibration_steps", none=True) or 0),
            mode=str(mode),
            heartbeat_timeout_s=_seconds(p("heartbeat_timeout_s"), "parallel.heartbeat_timeout_s"),
            startup_timeout_s=_seconds(p("startup_timeout_s"), "parallel.startup_timeout_s"),
        )
        return p.done(out)


# ``report.curves.points: all``: a point at every epoch, the test split evaluated at as many epochs as the default
# count gives (spread geometrically over trainer.max_epochs, its last always: a training early stopping ends sooner
# has fewer), so a time to a target is read at every epoch while the test split, which only reports, costs what it
# costs at the default.
ALL_EPOCHS = "all"
TEST_POINTS_WITH_ALL = 6


@dataclass(frozen=True)
class CurveSettings:
    """``report.curves``: accuracy-versus-training-time curves (snapshot ``points`` per training, or ``all``: every
    epoch on the target split, the test split at :data:`TEST_POINTS_WITH_ALL` of them)."""

    enabled: bool
    points: int | str
    max_train_rows: int

    @property
    def every_epoch(self) -> bool:
        return self.points == ALL_EPOCHS

    @property
    def test_points(self) -> int:
        """How many epochs the test split is evaluated at (spread as the points are)."""
        return TEST_POINTS_WITH_ALL if self.every_epoch else int(self.points)

    @classmethod
    def read(cls, c: Section) -> CurveSettings:
        enabled, points, rows = bool(c("enabled")), c("points"), c("max_train_rows")
        if isinstance(points, str) and points.strip().lower() == ALL_EPOCHS:
            points = ALL_EPOCHS
        elif isinstance(points, bool) or not isinstance(points, int | type(None)) or (points or 0) < 0:
            raise ValueError(
                f"report.curves.points must be a whole number >= 0 (the epochs with a point) or '{ALL_EPOCHS}' (every "
                f"epoch on the target split, the test split at {TEST_POINTS_WITH_ALL} of them), got {points!r}."
            )
        rows = int(rows or 0)
        if rows < 0:
            raise ValueError(f"report.curves.max_train_rows must be >= 0, got {rows}.")
        return c.done(cls(enabled, points if points == ALL_EPOCHS else int(points or 0), rows))


@dataclass(frozen=True)
class ReportSettings:
    """``report``: what the evaluate stage writes besides ``results.json`` / ``results.md``."""

    plots: bool
    export: bool
    curves: CurveSettings

    @classmethod
    def read(cls, r: Section) -> ReportSettings:
        plots = _bool(r("plots"), "report.plots", "the PNG figures in RUN_DIR/plots/")
        export = _bool(r("export"), "report.export", "the TorchScript export in RUN_DIR/export/")
        return r.done(cls(plots, export, CurveSettings.read(r.sub("curves"))))


@dataclass(frozen=True)
class StoreSettings:
    """``store``: prepared datasets and reusable global CNNs (none of it changes results; :mod:`ddcnn.store`)."""

    root: str | None
    stage_to: str | None
    stale_after_s: float
    reuse: bool

    @classmethod
    def read(cls, s: Section) -> StoreSettings:
        reuse = s("reuse")
        if not isinstance(reuse, bool):
            raise ValueError(
                f"store.reuse must be true or false (reuse the global CNN of an earlier run), got {reuse!r}."
            )
        stale = s("stale_after_s")
        if isinstance(stale, bool) or not isinstance(stale, int | float) or stale <= 0:
            raise ValueError(
                f"store.stale_after_s must be a positive number of seconds (a claim silent this long is taken for "
                f"dead), got {stale!r}."
            )
        root, stage_to = s("root"), s("stage_to")
        out = cls(None if root is None else str(root), None if stage_to is None else str(stage_to), float(stale), reuse)
        return s.done(out)


# --- the run -------------------------------------------------------------------------------------
# The default training recipe before issue #45 (a constant rate, every epoch of a 15-epoch budget, the kept epoch by
# validation accuracy; engine.min_steps did not exist): a run directory recorded with it resumes with it
# (RunSettings.in_run_dir), so that its unfinished stages train as its finished ones did; a new one gets today's.
OLD_RECIPE: dict[str, Any] = {
    "trainer.max_epochs": 15,
    "engine.monitor": "val_acc",
    "engine.monitor_mode": "max",
    "engine.patience": None,
    "engine.min_epochs": None,
    "engine.min_steps": 0,
    "scheduler": None,
    # before it existed (and its default auto), batch norm kept its running statistics on volumes too
    "engine.precise_bn": 0,
}


def _nested(plain: Mapping, dotted: str) -> Any:
    node: Any = plain
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


@dataclass(frozen=True)
class RunSettings:
    """One run's settings, checked: built once from the composed configuration at the entry
    (:func:`ddcnn.pipeline.train`, :func:`ddcnn.context.build_context`) and handed down."""

    stage: str
    subdomain: tuple[int, ...] | None
    seed: int
    optimized_metric: str
    force: bool
    run_generation: str | None
    device: str
    run_dir: str | None
    data: DataSettings
    decomposition: DecompositionSettings
    loop: LoopSettings
    logger: dict
    coarse: CoarseSettings
    methods: MethodsSettings
    parallel: ParallelSettings
    report: ReportSettings
    store: StoreSettings
    model: dict
    global_model: dict | None
    global_lr_scale: float
    # The configuration these settings were read from, as plain data, interpolations resolved (Hydra's own ``hydra``
    # node left out; ``paths.run_dir`` null where it cannot be resolved): what the run directory records.
    recorded: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: Any) -> RunSettings:
        """The settings of the composed configuration ``cfg`` (a ``DictConfig`` or a plain mapping), checked.

        Raises:
            ValueError: For an unknown key (with the known ones listed) or a bad value, naming the setting, the value
                and the fix.
        """
        from omegaconf import DictConfig, OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        if not isinstance(cfg, DictConfig):
            cfg = OmegaConf.create(dict(cfg or {}))
        plain = {}
        for key in cfg:
            if key == "hydra":  # Hydra's own node (compose(..., return_hydra_config=True)): not a setting of ddcnn
                continue
            try:
                node = cfg[key]
                plain[key] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
            except OmegaConfBaseException:  # ${hydra:runtime.output_dir} outside a Hydra app: the caller passes it
                if key != "paths":
                    raise
                plain[key] = {"run_dir": None}
        stage = str(plain.get("stage", yaml_default("stage")))
        if stage not in ("all", *STAGES):
            raise ValueError(f"unknown stage {stage!r}; choose one of: all, {', '.join(STAGES)}.")
        top = Section("", plain)
        loop = LoopSettings.read(plain)
        top.read += ["trainer", "engine", "optimizer", "scheduler"]
        seed = top("seed")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be a whole number, got {seed!r}.")
        data = DataSettings.read(top.sub("data"), seed=int(seed))
        if isinstance(plain.get("data"), dict):  # config.yaml and the fingerprint record the split seed resolved
            plain["data"] = {**plain["data"], "split_seed": data.split_seed}
        if isinstance(plain.get("engine"), dict):  # and engine.precise_bn (auto: by the data's dimensions)
            plain["engine"] = {**plain["engine"], "precise_bn": loop.precise_bn}
        methods = MethodsSettings.read(top.sub("methods"))
        if stage == "global_ddp" or methods.enabled["global_ddp"]:
            _check_ddp_devices(methods.global_ddp.num_devices, data.batch_size)
        if stage == "global_ddp" or (stage == "all" and methods.enabled["global_ddp"]):  # the srun step it spans
            check_srun_ddp(int(methods.global_ddp.num_devices), "methods.global_ddp.num_devices")
        paths = top.sub("paths")
        run_dir = paths("run_dir")
        if isinstance(run_dir, str) and "${" in run_dir:  # the YAML's Hydra interpolation, given no run directory
            run_dir = None
        paths.done()
        generation = top("run_generation")
        out = cls(
            stage=stage,
            subdomain=_subdomain(top("subdomain")),
            seed=int(seed),
            optimized_metric=str(top("optimized_metric")),
            force=bool(top("force")),
            run_generation=None if generation is None else str(generation),
            device=str(top("device")),
            run_dir=None if run_dir is None else str(run_dir),
            data=data,
            decomposition=DecompositionSettings.read(top.sub("decomposition")),
            loop=loop,
            logger=dict(top("logger") or {}),
            coarse=CoarseSettings.read(top.sub("coarse")),
            methods=methods,
            parallel=ParallelSettings.read(top.sub("parallel")),
            report=ReportSettings.read(top.sub("report")),
            store=StoreSettings.read(top.sub("store")),
            model=_spec(top("model")),
            global_model=_spec(top("global_model")),
            global_lr_scale=_positive_scale(top("global_lr_scale"), "global_lr_scale"),
            recorded=plain,
        )
        return top.done(out, extra_known=("stage",))

    def with_data_counts(self, num_classes: int, in_channels: int) -> RunSettings:
        """These settings with ``data.num_classes`` / ``data.in_channels`` that were ``auto`` set to the data's."""
        data = self.data
        if data.num_classes == AUTO:
            data = dataclasses.replace(data, num_classes=int(num_classes))
        if data.in_channels == AUTO:
            data = dataclasses.replace(data, in_channels=int(in_channels))
        return self if data is self.data else dataclasses.replace(self, data=data)

    def in_run_dir(self, run_dir: str | Path | None) -> RunSettings:
        """These settings for resuming run directory ``run_dir``: each setting of the training recipe at today's
        default where the directory recorded the default before it (:data:`OLD_RECIPE`) takes the recorded one, and
        where ``data.split_seed`` was null (the run's seed) and the directory recorded the old default split seed
        (:data:`ddcnn.rundir.CHANGED_DEFAULTS`: 0, from before the seed drew the data), the split seed that
        directory's stages trained on: so that it resumes as its finished stages trained, on their data. Otherwise
        these settings unchanged."""
        settings = self._with_old_recipe(run_dir)
        return settings._with_old_split_seed(run_dir)

    def _with_old_recipe(self, run_dir: str | Path | None) -> RunSettings:
        """:meth:`in_run_dir`'s recipe part: the settings of :data:`OLD_RECIPE` that are at today's YAML default here
        and at the old default in ``run_dir``'s record take the old value (logged once)."""
        record = RunDir(run_dir).recorded_settings() if run_dir is not None else None
        if not record:
            return self
        then, now = flatten_recorded(record), flatten(self.recorded)
        older = {}
        for key, old in OLD_RECIPE.items():
            new = yaml_default(key)
            if key == "engine.precise_bn":  # the default as this run resolves it
                new = resolve_precise_bn(new, self.data.spatial_dims)
            current = _nested(self.recorded, key) if key == "scheduler" else now.get(key)
            recorded = _nested(record, key) if key == "scheduler" else then.get(key, RECORD_ABSENT_MEANS.get(key))
            if current == new != old and recorded == old:
                older[key] = old
        if then.get("engine.patience") is None and "engine.patience" not in older:
            for key in INERT_WITHOUT:  # left out of a record without early stopping as inert, not as the old
                if key not in then:  # defaults: today's stay (the run trains without early stopping either way)
                    older.pop(key, None)
        if not older:
            return self
        log.info(
            "run directory %s was recorded with the default training recipe before issue #45 (%s): it resumes with "
            "it; a new run directory trains with today's (conf/engine/default.yaml)",
            run_dir,
            ", ".join(f"{k}={v}" for k, v in older.items()),
        )
        plain = copy.deepcopy(self.recorded)
        if self.data.split_seed_from_seed:  # recorded resolved; read again as given (null: the run's seed)
            plain["data"]["split_seed"] = None
        for key, value in older.items():
            *parents, leaf = key.split(".")
            node = plain
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return RunSettings.from_config(plain)

    def _with_old_split_seed(self, run_dir: str | Path | None) -> RunSettings:
        """:meth:`in_run_dir`'s split-seed part."""
        old = CHANGED_DEFAULTS["data.split_seed"][0]
        if run_dir is None or not self.data.split_seed_from_seed or self.data.split_seed == old:
            return self
        if RunDir(run_dir).recorded_setting("data.split_seed") != old:
            return self
        log.info(
            "run directory %s was recorded with data.split_seed=%s (the default before it followed the seed): it "
            "resumes with that draw; a new run directory draws the data of seed %s",
            run_dir,
            old,
            self.seed,
        )
        data = dataclasses.replace(self.data, split_seed=int(old))
        recorded = {**self.recorded, "data": {**(self.recorded.get("data") or {}), "split_seed": int(old)}}
        return dataclasses.replace(self, data=data, recorded=recorded)

    def identity(self) -> RunIdentity:
        """What the run directory records of these settings (:meth:`ddcnn.rundir.RunDir.claim`): the configuration
        they were read from as ``config.yaml``, the part of it that changes results and its fingerprint, with
        ``data.num_classes`` / ``data.in_channels`` that were ``auto`` set to the data's once
        :meth:`with_data_counts` has set them."""
        counts = [None if n == AUTO else int(n) for n in (self.data.num_classes, self.data.in_channels)]
        return RunIdentity.of(self.recorded, *counts)


def _check_ddp_devices(value: Any, batch: int) -> int:
    """``methods.global_ddp.num_devices``: at least 2, and a divisor of ``data.batch_size``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(
            f"methods.global_ddp.num_devices must be a whole number >= 2 (one device is the global CNN itself), "
            f"got {value!r}."
        )
    if batch % value:
        raise ValueError(
            f"methods.global_ddp.num_devices={value} does not divide data.batch_size={batch}: the DDP run keeps the "
            f"global batch, {batch / value:g} samples per device. Choose a divisor of {batch}."
        )
    return value


def _subdomain(sel: Any) -> tuple[int, ...] | None:
    """``subdomain``: ``None`` (all), one index or a list of them; whether they exist is checked against the
    decomposition (:func:`ddcnn.pipeline.train`)."""
    if sel is None:
        return None
    values = list(sel) if isinstance(sel, list | tuple) else [sel]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"subdomain must be an integer index or a list of them, got {sel!r}.")
    return tuple(int(v) for v in values)
