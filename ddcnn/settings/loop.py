"""The settings of the training loop: one frozen :class:`LoopSettings`, each field declared once with its check and
whether a resume must agree on it (field metadata), read from the ``trainer`` and ``engine`` groups, ``optimizer`` and
``scheduler`` as they are in YAML (:meth:`LoopSettings.read`), or given in Python (tests, benchmarks, the coarse
DNN's fit: the run's with its ``coarse.*`` fields replaced, :func:`dataclasses.replace`).

Light on purpose (no Lightning Fabric, no torch import): a coordinating process that never trains checks a run's
settings with it. :func:`ddcnn.engine.loop.fit_batches` takes the same object, so what is checked is what is used.

Adding a loop option is three places: its YAML key (``conf/trainer/default.yaml`` or ``conf/engine/default.yaml``),
its field here (``_setting(key, check, resume=...)``) and its use in the loop.

Every key of ``conf/trainer`` and ``conf/engine`` changes what the loop does, or is refused with what to use instead:

- ``trainer.max_epochs``, ``precision`` (``32-true``, ``bf16-mixed``, ``16-mixed``, ``64-true``), ``deterministic``,
  ``enable_progress_bar``, ``log_every_n_steps`` (the training loss every n steps to TensorBoard/MLflow),
  ``gradient_clip_val`` (+ ``gradient_clip_algorithm``: ``norm`` or ``value``), ``limit_train_batches``,
  ``limit_val_batches`` and ``accumulate_grad_batches`` (given with ``+trainer.accumulate_grad_batches=2``);
- ``engine.monitor``, ``monitor_mode``, ``min_delta`` (the one improvement rule of selection, early stopping and the
  plateau scheduler), ``patience`` and ``min_epochs`` (early stopping of every training but the coarse DNN's, which
  has ``coarse.patience``), ``num_devices``, ``checkpoint_every_s``;
- the run's ``scheduler`` against early stopping (:func:`check_schedule`): with ``engine.patience`` only a constant
  rate or ``ReduceLROnPlateau`` (a fixed-length schedule such as cosine annealing is never cut short), and the plateau
  scheduler's patience at least 2 below ``engine.patience``;
- the GPU policy (:mod:`ddcnn.engine.gpu`): ``engine.channels_last``, ``tf32``, ``cudnn_benchmark``,
  ``data_on_device`` (each ``auto``, ``true`` or ``false``), ``device_data_fraction``, and the opt-ins ``compile`` and
  ``profile_steps``; ``engine.activation_checkpointing`` (``none``, ``global``, ``all``); ``engine.precise_bn``
  (batch-norm statistics recomputed before each validation);
- keys ddcnn does not read are refused with what to do: ``engine.loop`` (ddcnn has one loop: remove it),
  ``trainer.monitor`` and the other keys that live elsewhere (the key to use), any other Lightning ``Trainer``
  argument (the list of those implemented).
"""

from __future__ import annotations

import contextvars
import dataclasses
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddcnn.settings.read import Section, positive_int

__all__ = [
    "LoopSettings",
    "PRECISIONS",
    "MONITORS",
    "LAUNCHERS",
    "GPU_POLICY",
    "CHECKPOINTING",
    "check_schedule",
    "schedule_kind",
    "default_min_epochs",
    "check_srun_ddp",
    "num_batches",
    "plain_spec",
    "resolve_precise_bn",
]

# What trainer.precision may say (Lightning's spellings, old aliases included) -> the precision the loop runs.
PRECISIONS = {
    "32-true": "32-true",
    "32": "32-true",
    "bf16-mixed": "bf16-mixed",
    "bf16": "bf16-mixed",
    "16-mixed": "16-mixed",
    "16": "16-mixed",
    "64-true": "64-true",
    "64": "64-true",
}
# The metrics a training can select its weights on.
MONITORS = ("train_loss", "train_acc", "val_loss", "val_acc")
# How a training is launched: one device in this process, DDP ranks spawned by it, DDP across the tasks of srun.
LAUNCHERS = ("local", "spawn", "srun")
# The engine settings of the GPU policy (ddcnn.engine.gpu), in the order FitResult.engine records them.
GPU_POLICY = (
    "channels_last",
    "tf32",
    "cudnn_benchmark",
    "data_on_device",
    "device_data_fraction",
    "compile",
    "profile_steps",
)
# Keys ddcnn reads elsewhere, or Lightning Trainer arguments whose job another setting does: what to use instead.
_INSTEAD = {
    "trainer.monitor": "engine.monitor",
    "trainer.monitor_mode": "engine.monitor_mode",
    "trainer.num_devices": "engine.num_devices",
    "trainer.checkpoint_every_s": "engine.checkpoint_every_s",
    "trainer.accelerator": "device=cpu|cuda|cuda:1 (and parallel.accelerator for the local-stage workers)",
    "trainer.devices": "engine.num_devices=P (DDP over P devices from `device` on) or device=cuda:1",
    "trainer.strategy": "engine.num_devices=P (DDP), or srun with methods.global_ddp (DDP across the srun tasks)",
    "trainer.num_nodes": "srun -N <nodes> -n <tasks> ddcnn-train ... methods.enabled.global_ddp=true (docs/slurm.md)",
    "trainer.plugins": "device, trainer.precision and engine.num_devices",
    "trainer.callbacks": "the loop's callbacks (ddcnn.engine.callbacks; fit_batches(..., callbacks=[...]))",
    "trainer.logger": "logger=csv|tensorboard|mlflow|many",
    "trainer.enable_checkpointing": "engine.checkpoint_every_s (last.ckpt is always written: stages resume from it)",
    "trainer.default_root_dir": "hydra.run.dir (the run directory)",
    "trainer.profiler": "engine.profile_steps=N (a Chrome trace of N training steps in each stage's profile/)",
    "trainer.check_val_every_n_epoch": "trainer.limit_val_batches (validation selects the weights after every epoch)",
    "trainer.val_check_interval": "trainer.limit_val_batches (validation selects the weights after every epoch)",
    "trainer.num_sanity_val_steps": "nothing: the loop runs no sanity check",
    "trainer.max_steps": "trainer.max_epochs with trainer.limit_train_batches",
    "engine.ddp_launcher": "engine.num_devices (spawned DDP) or srun with methods.global_ddp (DDP across srun tasks)",
}
_LOOP_GONE = (
    "engine.loop is gone: every training (local nets, coarse DNN, global CNN, optional methods, DDP) runs in ddcnn's "
    "one loop on Lightning Fabric (ddcnn/engine/loop.py). Remove engine.loop={value!r} from the command line or your "
    "configuration."
)
# The defaults of trainer keys given with `+trainer.<key>=` (documented in conf/trainer/default.yaml, which cannot hold
# them: Hydra refuses `+` for a key it has).
ADDED_TRAINER_DEFAULTS = {"accumulate_grad_batches": 1, "gradient_clip_algorithm": "norm"}

# How the messages name the settings: by field name (a Python caller) or by YAML key (a run's configuration, while
# LoopSettings.read builds them).
_FROM_YAML: contextvars.ContextVar[bool] = contextvars.ContextVar("loop_settings_from_yaml", default=False)


def plain_spec(node: Any) -> Any:
    """A ``_target_`` spec (a mapping, an OmegaConf node included: its items resolve) as plain dicts and lists; any
    other value (a callable, ``None``) as it is."""
    if isinstance(node, Mapping):
        return {key: plain_spec(value) for key, value in node.items()}
    if isinstance(node, Sequence) and not isinstance(node, str | bytes):
        return [plain_spec(value) for value in node]
    return node


def num_batches(n_batches: int, limit: int | float | None, what: str) -> int:
    """The batches an epoch runs under a Lightning-style ``limit`` (``trainer.limit_train_batches``): a whole number
    caps them, a fraction in (0, 1] keeps that share (at least one), ``None`` keeps all, ``0`` none."""
    if limit is None:
        return n_batches
    if isinstance(limit, bool) or not isinstance(limit, int | float) or limit < 0:
        raise ValueError(f"{what} must be a number of batches or a fraction in (0, 1], or null for all, got {limit!r}.")
    if isinstance(limit, float):
        if limit > 1.0:
            raise ValueError(f"{what} as a fraction must be in (0, 1], got {limit!r}; a whole number caps batches.")
        return 0 if limit == 0 else max(1, int(n_batches * limit))
    return min(n_batches, int(limit))


def default_min_epochs(min_epochs: int | None, max_epochs: int) -> int:
    """The epochs a training runs before early stopping may end it: ``min_epochs``, or half of its ``max_epochs``
    rounded up when that is ``None``; never more than ``max_epochs``."""
    return min(int(max_epochs), -(-int(max_epochs) // 2) if min_epochs is None else int(min_epochs))


# --- the checks: (value, name, names) -> the normalised value; `names` maps fields to how messages name them --------
def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_whole(value: Any, least: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least


def _rule(
    ok: Callable[[Any], bool], message: str, convert: Callable[[Any], Any] = lambda v: v
) -> Callable[[Any, str, Mapping[str, str]], Any]:
    """A check: ``convert(value)`` where ``ok(value)``, else a ``ValueError`` of ``message`` formatted with the
    setting's ``name``, its ``value`` and how the messages name the other fields (``{monitor}``)."""

    def check(value: Any, name: str, names: Mapping[str, str]) -> Any:
        if not ok(value):
            raise ValueError(message.format(name=name, value=value, **names))
        return convert(value)

    return check


def _or_none(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else convert(v)


def _positive(value: Any, name: str, names: Mapping[str, str]) -> int:
    return positive_int(value, name)


def _positive_or_none(value: Any, name: str, names: Mapping[str, str]) -> int | None:
    return positive_int(value, name, none=True)


def _limit(value: Any, name: str, names: Mapping[str, str]) -> int | float | None:
    num_batches(1, value, name)  # checks the value
    if name.endswith("limit_train_batches") and value is not None and value in (0, 0.0):
        raise ValueError(f"{name}=0 trains nothing; use a positive number of batches or null.")
    return value


def _switch(value: Any, name: str, names: Mapping[str, str]) -> str | bool:
    """An ``auto | true | false`` setting."""
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, str) and value.lower() in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[value.lower()]
    raise ValueError(f"{name} must be auto, true or false, got {value!r}.")


_precision = _rule(
    lambda v: str(v).lower() in PRECISIONS,
    "{name}={value!r} is not one the loop runs: use 32-true, bf16-mixed (bf16 autocast), 16-mixed (float16 autocast "
    "with a loss scaler) or 64-true (float64 weights and arithmetic).",
    lambda v: PRECISIONS[str(v).lower()],
)
_flag = _rule(lambda v: True, "", lambda v: bool(v or False))
_bar = _rule(
    lambda v: v in (None, True, False),
    "{name} must be true, false or null (bars on a terminal, one line per epoch otherwise), got {value!r}.",
)
_clip = _rule(
    lambda v: v is None or (_is_real(v) and v > 0),
    "{name} must be > 0 (or null: no clipping), got {value!r}.",
    _or_none(float),
)
_clip_algorithm = _rule(
    lambda v: v in ("norm", "value"),
    "{name} must be 'norm' (the gradients' global 2-norm, the default) or 'value' (each gradient entry), got "
    "{value!r}.",
)
_monitor = _rule(lambda v: v in MONITORS, "{name} must be one of " + ", ".join(MONITORS) + ", got {value!r}.", str)
_mode = _rule(lambda v: v in ("max", "min"), "{name} must be 'max' or 'min', got {value!r}.", str)
_patience = _rule(
    lambda v: v is None or _is_whole(v, 1),
    "{name} must be a whole number of epochs >= 1 (stop a training once {monitor} has not improved for that many "
    "epochs) or null (train {max_epochs} epochs), got {value!r}.",
    _or_none(int),
)
_min_delta = _rule(
    lambda v: v is None or (_is_real(v) and v >= 0),
    "{name} must be >= 0 (early stopping counts an epoch as an improvement only when it beats the best one by more "
    "than this, in {monitor}'s units; 0 = any improvement), got {value!r}.",
    lambda v: 0.0 if v is None else float(v),
)
_min_epochs = _rule(
    lambda v: v is None or _is_whole(v, 0),
    "{name} must be a whole number of epochs >= 0 (early stopping never ends a training before it) or null (half of "
    "the training's epochs, rounded up), got {value!r}.",
    _or_none(int),
)
_min_steps = _rule(
    lambda v: v is None or _is_whole(v, 0),
    "{name} must be a whole number of optimizer steps >= 0 (early stopping never ends a training before it; 0 = no "
    "such floor), got {value!r}.",
    lambda v: 0 if v is None else int(v),
)
_seconds = _rule(
    lambda v: v is None or (_is_real(v) and v >= 0),
    "{name} must be >= 0 (0: after every epoch), got {value!r}.",
    _or_none(float),
)
_fraction = _rule(
    lambda v: _is_real(v) and 0 < v <= 1,
    "{name} must be a fraction in (0, 1] of the free device memory that a split held on the device may take, got "
    "{value!r}.",
    float,
)
_bool = _rule(lambda v: isinstance(v, bool), "{name} must be true or false, got {value!r}.")
# engine.precise_bn: auto: the training batches batch norm's statistics are recomputed from before each validation on
# volumes (spatial_dims 3), where batches are small and a training has few steps an epoch (AdrenalMNIST3D's nets: a
# validation loss spiking on a smoothly falling training loss, issue #45; nnU-Net avoids batch norm in 3D for the same
# reason); 0 on images, where the running averages of many steps of larger batches follow the weights. 10 batches:
# on AdrenalMNIST3D 28³ (vgg_small 3D at width 0.5, batch 32) statistics from 10 batches gave the validation loss of
# the whole training set's within 0.004 in epochs 0-3 (0.372 against 0.369 where evaluation mode gave 0.886), and 10
# batches of 8 within 0.005 (0.374); 50, the first default, recomputed the whole training set there at 1.45x the
# epoch time.
PRECISE_BN_AUTO = {3: 10}


def resolve_precise_bn(value: Any, spatial_dims: Any) -> Any:
    """``engine.precise_bn`` as the loop uses it: ``auto`` as :data:`PRECISE_BN_AUTO` gives for ``spatial_dims``
    (0 where it gives none), any other value as it is (checked by :class:`LoopSettings`)."""
    return PRECISE_BN_AUTO.get(spatial_dims, 0) if value == "auto" else value


_precise_bn = _rule(
    lambda v: v is None or _is_whole(v, 0),
    "{name} must be a whole number of training batches >= 0 (0 or null: batch norm keeps its running statistics; N: "
    "they are recomputed from N training batches before each validation) or auto (10 on volumes, 0 on images), got "
    "{value!r}.",
    lambda v: 0 if v is None else int(v),
)
_profile_steps = _rule(
    lambda v: _is_whole(v, 0),
    "{name} must be a whole number >= 0 (0: no profile; N: a Chrome trace of N training steps in the stage's "
    "profile/trace.json), got {value!r}.",
    int,
)
# What engine.activation_checkpointing may say: which trainings recompute their activations in backward.
CHECKPOINTING = ("none", "global", "all")
_checkpointing = _rule(
    lambda v: v in CHECKPOINTING,
    "{name} must be none, global (only the global CNN's trainings recompute their stages' activations in backward) "
    "or all (every CNN training: the local nets too), got {value!r}.",
    str,
)
_optimizer = _rule(
    lambda v: isinstance(v, Mapping) or callable(v),
    "the {name} setting must be a Hydra node with _partial_: true (e.g. coarse.optimizer) or a callable, got "
    "{value!r}.",
    lambda v: plain_spec(v),
)
# ``scheduler: plateau`` (the run's default, conf/config.yaml): a string, so that a node given on the command line or
# in an experiment replaces it whole (a default node would be merged with it key by key). A node without a _target_
# is the plateau scheduler with those fields changed: ``++scheduler.patience=1`` or ``++scheduler.min_lr=1e-5`` on
# the command line replaces the string by ``{patience: 1}`` (Hydra cannot set a field of a string), which reads as
# ReduceLROnPlateau(factor=0.5, patience=1).
PLATEAU_DEFAULT = {
    "_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau",
    "_partial_": True,
    "factor": 0.5,
    "patience": 2,
}


def _plateau_fields(spec: Any) -> Any:
    """A scheduler node without a ``_target_`` (fields typed over the ``plateau`` default) as the plateau scheduler
    with those fields; any other spec as it is."""
    if isinstance(spec, Mapping) and "_target_" not in spec:
        return {**PLATEAU_DEFAULT, **spec}
    return spec


def scheduler_spec(value: Any) -> Any:
    """A recorded or configured ``scheduler`` setting as the node the loop builds: ``plateau`` and a node of fields
    typed over it as the plateau scheduler's node, null as ``None``, any other node as it is (for scripts that read a
    run's ``config.yaml``)."""
    if value == "plateau":
        return dict(PLATEAU_DEFAULT)
    return _plateau_fields(dict(value)) if isinstance(value, Mapping) else (value or None)


_scheduler = _rule(
    lambda v: not isinstance(v, str) or v == "plateau",
    "{name} must be a Hydra _partial_ node of a scheduler, null (a constant rate) or plateau "
    "(ReduceLROnPlateau(factor=0.5, patience=2)), got {value!r}.",
    lambda v: dict(PLATEAU_DEFAULT) if v == "plateau" else _plateau_fields(plain_spec(v)) if v else None,
)
_seed = _rule(
    lambda v: v is None or _is_whole(v, -(2**63)),
    "{name} must be a whole number (or null: the data's seed), got {value!r}.",
    _or_none(int),
)
_restarts = _rule(
    lambda v: v is None or _is_whole(v, 0), "{name} must be >= 0 or null (no check), got {value!r}.", _or_none(int)
)
_above_one = _rule(lambda v: _is_real(v) and v > 1, "{name} must be > 1, got {value!r}.", float)
_open_unit = _rule(
    lambda v: _is_real(v) and 0 < v < 1, "{name} must lie strictly between 0 and 1, got {value!r}.", float
)
_launcher = _rule(
    lambda v: v is None or v in LAUNCHERS, "{name} must be one of " + ", ".join(LAUNCHERS) + ", got {value!r}."
)
_any = _rule(lambda v: True, "")


def _setting(
    key: str | None,
    check: Callable[[Any, str, Mapping[str, str]], Any],
    *,
    default: Any = dataclasses.MISSING,
    resume: str | None = None,
    null_is_default: bool = False,
) -> Any:
    """A field of :class:`LoopSettings`: ``key``, the YAML key it is read from (``trainer.max_epochs``; ``None``: set
    by the code that trains, not a run setting), ``check`` (value, name, names -> normalised value), ``default`` for a
    Python caller (the run's defaults are in YAML), ``resume``: whether a resumed training must agree on it
    (``always``: recorded in ``last.ckpt`` and compared; ``where_set``: recorded and compared where it is not the
    default, so that checkpoints written before it existed still resume; ``None``: may differ), ``null_is_default``:
    a YAML ``null`` means the YAML default."""
    meta = {"key": key, "check": check, "resume": resume, "null_is_default": null_is_default}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """How one training runs, checked once when built. Frozen and picklable (spawned DDP ranks receive it).

    Attributes (Python defaults; a run reads them from ``conf/trainer``, ``conf/engine``, ``optimizer`` and
    ``scheduler``): see :func:`ddcnn.engine.loop.fit_batches` for what each does in the loop.
        optimizer: A Hydra ``_partial_`` node of an optimizer, or a callable ``params -> Optimizer`` (L-BFGS, or one
            with ``needs_closure = True``, steps with a closure).
        scheduler: A Hydra ``_partial_`` node ``optimizer -> LRScheduler`` (``T_max: null`` = ``max_epochs``), a
            callable, or ``None`` (constant rate). ``ReduceLROnPlateau`` gets the loop's improvement rule.
        max_epochs: Passes over the training samples.
        precision: ``32-true``, ``bf16-mixed``, ``16-mixed`` (with a loss scaler) or ``64-true``.
        deterministic: torch's deterministic algorithms.
        enable_progress_bar: Bars (``True``), epoch lines (``False``), bars on a terminal (``None``).
        log_every_n_steps: The mean training loss of every n optimizer steps to the loggers.
        gradient_clip_val, gradient_clip_algorithm: Clip to this global 2-norm (``norm``) or each entry (``value``).
        limit_train_batches, limit_val_batches: Batches per epoch and per validation (per rank), as Lightning's.
        accumulate_grad_batches: Batches per optimizer step.
        monitor, monitor_mode: The metric that selects the kept weights, ``max`` or ``min``.
        patience: Early stopping once this many epochs passed since the kept one (``None``: all epochs).
        min_delta: An improvement is one by more than this (absolute, the monitor's units).
        min_epochs: Early stopping never ends a training before this many epochs (``None``: half of ``max_epochs``).
        min_steps: Nor before this many optimizer steps (on a few hundred images an epoch is a few steps: too few for
            the batch-norm statistics and the rate to settle; ``0``: no such floor).
        num_devices: DDP ranks (1: one device).
        checkpoint_every_s: Write ``last.ckpt`` after the first epoch that ends this many seconds after the last
            write (``0``: every epoch); ``None``: every ``checkpoint_every`` epochs.
        channels_last, tf32, cudnn_benchmark, data_on_device: The GPU policy switches (``auto``, ``True``,
            ``False``; off for a Python caller), ``device_data_fraction``, ``compile``, ``profile_steps``.
        activation_checkpointing: ``all``: the loop trains the network with its stages' activations recomputed in
            backward (:mod:`ddcnn.models.checkpointing`; same results, less memory, more time); ``none`` and
            ``global``: as it is. ``global`` is the run's setting for the global CNN alone: its stage hands its
            trainings ``all``, and every other training reads ``global`` as ``none``.
        precise_bn: ``N`` > 0: before each validation, a network's batch-norm running statistics are recomputed as
            the exact average over ``N`` training batches (``torch.optim.swa_utils.update_bn``), so that evaluation
            does not see the lagging running averages of the last steps; ``0``: as training left them.
        seed: Seeds the sample order and dropout of every epoch with the epoch (``None``: the data's seed).
        checkpoint_every: Epochs between checkpoints when ``checkpoint_every_s`` is ``None``.
        divergence_restarts: ``None``: no divergence check; ``0``: raise; ``R``: restart at most ``R`` times with the
            learning rates times ``divergence_lr_factor``; ``divergence_factor``: the loss multiple that diverged.
        write_best: Also write ``best.ckpt``.
        device: Where to train (default CPU); with spawned DDP the first device.
        launcher: ``local``, ``spawn`` or ``srun`` (default: ``local`` on one device, ``spawn`` for several).
    """

    optimizer: Any = _setting("optimizer", _optimizer)
    scheduler: Any = _setting("scheduler", _scheduler, default=None)
    max_epochs: int = _setting("trainer.max_epochs", _positive, resume="always")
    precision: str = _setting(
        "trainer.precision", _precision, default="32-true", resume="where_set", null_is_default=True
    )
    deterministic: bool = _setting("trainer.deterministic", _flag, default=False)
    enable_progress_bar: bool | None = _setting("trainer.enable_progress_bar", _bar, default=None)
    log_every_n_steps: int | None = _setting("trainer.log_every_n_steps", _positive_or_none, default=None)
    gradient_clip_val: float | None = _setting("trainer.gradient_clip_val", _clip, default=None)
    gradient_clip_algorithm: str = _setting(
        "trainer.gradient_clip_algorithm", _clip_algorithm, default="norm", null_is_default=True
    )
    limit_train_batches: int | float | None = _setting(
        "trainer.limit_train_batches", _limit, default=None, resume="where_set"
    )
    limit_val_batches: int | float | None = _setting(
        "trainer.limit_val_batches", _limit, default=None, resume="where_set"
    )
    accumulate_grad_batches: int = _setting(
        "trainer.accumulate_grad_batches", _positive, default=1, resume="where_set", null_is_default=True
    )
    monitor: str = _setting("engine.monitor", _monitor, default="val_acc", resume="always")
    monitor_mode: str = _setting("engine.monitor_mode", _mode, default="max", resume="always")
    patience: int | None = _setting("engine.patience", _patience, default=None, resume="where_set")
    min_delta: float = _setting("engine.min_delta", _min_delta, default=0.0, resume="where_set")
    min_epochs: int | None = _setting("engine.min_epochs", _min_epochs, default=0, resume="where_set")
    min_steps: int = _setting("engine.min_steps", _min_steps, default=0, resume="where_set")
    num_devices: int = _setting("engine.num_devices", _positive, default=1, null_is_default=True)
    checkpoint_every_s: float | None = _setting("engine.checkpoint_every_s", _seconds, default=None)
    channels_last: str | bool = _setting("engine.channels_last", _switch, default=False)
    tf32: str | bool = _setting("engine.tf32", _switch, default=False)
    cudnn_benchmark: str | bool = _setting("engine.cudnn_benchmark", _switch, default=False)
    data_on_device: str | bool = _setting("engine.data_on_device", _switch, default=False)
    device_data_fraction: float = _setting("engine.device_data_fraction", _fraction, default=0.5)
    compile: bool = _setting("engine.compile", _bool, default=False)
    profile_steps: int = _setting("engine.profile_steps", _profile_steps, default=0)
    activation_checkpointing: str = _setting("engine.activation_checkpointing", _checkpointing, default="none")
    precise_bn: int = _setting("engine.precise_bn", _precise_bn, default=0, resume="where_set")
    seed: int | None = _setting(None, _seed, default=None, resume="always")
    checkpoint_every: int = _setting(None, _positive, default=1)
    divergence_restarts: int | None = _setting(None, _restarts, default=None, resume="where_set")
    divergence_factor: float = _setting(None, _above_one, default=2.0)
    divergence_lr_factor: float = _setting(None, _open_unit, default=0.1)
    write_best: bool = _setting(None, _bool, default=True)
    device: Any = _setting(None, _any, default=None)
    launcher: str | None = _setting(None, _launcher, default=None)

    def __post_init__(self) -> None:
        """Check every field with its own check (the message names it as the caller gave it: the YAML key while
        :meth:`read` builds, the field's name otherwise), hold the normalised values, then the checks of several
        fields together."""
        yaml = _FROM_YAML.get()
        names = _names(type(self), yaml)
        for f in dataclasses.fields(self):
            value = f.metadata["check"](getattr(self, f.name), names[f.name], names)
            object.__setattr__(self, f.name, value)
        check_schedule(
            self.scheduler,
            patience=self.patience,
            monitor_mode=self.monitor_mode,
            min_delta=self.min_delta,
            refuse_fixed=yaml,
            names=names,
        )
        if self.patience is not None and (self.min_epochs or 0) > self.max_epochs:
            raise ValueError(
                f"{names['min_epochs']}={self.min_epochs} is more than {names['max_epochs']}={self.max_epochs}: early "
                f"stopping ({names['patience']}={self.patience}) could never end a training. Lower "
                f"{names['min_epochs']}, set it to null (half of {names['max_epochs']}), or drop {names['patience']}."
            )
        if self.deterministic and self.cudnn_benchmark is True:
            raise ValueError(
                f"{names['cudnn_benchmark']}=true picks cuDNN's algorithms by timing them, which "
                f"{names['deterministic']}=true forbids: set {names['cudnn_benchmark']}=auto (off when deterministic) "
                f"or false, or {names['deterministic']}=false."
            )
        if (
            self.limit_val_batches in (0, 0.0)
            and self.limit_val_batches is not None
            and self.monitor.startswith("val_")
        ):
            raise ValueError(
                f"{names['limit_val_batches']}=0 skips validation, so {names['monitor']}={self.monitor} has nothing to "
                f"select the weights on: set {names['monitor']}=train_loss {names['monitor_mode']}=min (or train_acc "
                f"/ max), or validate ({names['limit_val_batches']} null or > 0)."
            )

    @classmethod
    def read(cls, plain: Mapping) -> LoopSettings:
        """The run's loop settings from the composed configuration as plain data: every ``trainer`` and ``engine``
        key (a key the loop does not implement is refused with what to use instead), ``optimizer`` and ``scheduler``,
        checked; the messages name the YAML keys.

        Raises:
            ValueError: Naming the setting, its value and the fix.
        """
        groups = {"trainer": Section("trainer", plain.get("trainer"), ADDED_TRAINER_DEFAULTS)}
        groups["engine"] = Section("engine", plain.get("engine"))
        groups[""] = Section("", plain)
        if groups["engine"]("loop") is not None:
            raise ValueError(_LOOP_GONE.format(value=groups["engine"].given["loop"]))
        values = {}
        for f in dataclasses.fields(cls):
            key = f.metadata["key"]
            if key is None:
                continue
            group, _, name = key.rpartition(".")
            section = groups[group]
            values[f.name] = section.default(name) if f.metadata["null_is_default"] else section(name)
        data = plain.get("data") if isinstance(plain.get("data"), Mapping) else {}
        values["precise_bn"] = resolve_precise_bn(values["precise_bn"], data.get("spatial_dims"))
        keys = _keys(cls)
        for group in ("trainer", "engine"):
            _refuse_unknown(group, groups[group].given, tuple(keys[group]) + (("loop",) if group == "engine" else ()))
        token = _FROM_YAML.set(True)
        try:
            return cls(**values)
        finally:
            _FROM_YAML.reset(token)

    @property
    def least_epochs(self) -> int:
        """The epochs early stopping waits for in this training (``min_epochs``, ``None``: half of ``max_epochs``)."""
        return default_min_epochs(self.min_epochs, self.max_epochs)

    def resume_record(self) -> dict[str, Any]:
        """What ``last.ckpt`` records of these settings for a resume to agree on (fields with ``resume`` metadata:
        ``always``, or ``where_set`` when not the default; ``min_epochs`` as early stopping uses it, only with
        ``patience``)."""
        out = {}
        for f in dataclasses.fields(self):
            kind, value = f.metadata["resume"], getattr(self, f.name)
            if f.name == "min_epochs":
                value = self.least_epochs if self.patience is not None else 0
            if f.name == "min_steps" and self.patience is None:
                value = 0  # inert without early stopping, as min_epochs
            if kind == "always" or (kind == "where_set" and value != f.default and value is not None):
                out[f.name] = value
        return out

    @classmethod
    def resume_keys(cls) -> tuple[str, ...]:
        """The fields a resume must agree on."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["resume"])

    def gpu_policy(self) -> dict[str, Any]:
        """The GPU policy settings by name (:data:`GPU_POLICY`)."""
        return {key: getattr(self, key) for key in GPU_POLICY}


def _names(cls: type, yaml: bool) -> dict[str, str]:
    """How messages name each field: its YAML key (``trainer.max_epochs``) or its name."""
    return {f.name: f.metadata["key"] if yaml and f.metadata["key"] else f.name for f in dataclasses.fields(cls)}


def _keys(cls: type) -> dict[str, list[str]]:
    """The YAML keys of each group the loop reads."""
    out: dict[str, list[str]] = {"trainer": [], "engine": []}
    for f in dataclasses.fields(cls):
        group, _, name = (f.metadata["key"] or "").rpartition(".")
        if group in out:
            out[group].append(name)
    return out


def _refuse_unknown(section: str, given: Mapping, known: tuple[str, ...]) -> None:
    for key, value in given.items():
        if key in known:
            continue
        instead = _INSTEAD.get(f"{section}.{key}")
        if instead is not None:
            raise ValueError(f"{section}.{key}={value!r} is not a setting of ddcnn's training loop; use {instead}.")
        raise ValueError(
            f"{section}.{key}={value!r} is not a setting of ddcnn's training loop (one loop on Lightning Fabric, not "
            f"Lightning's Trainer); the {section} settings are {', '.join(k for k in known if k != 'loop')}. "
            f"Remove it."
        )


# The learning-rate schedule that adapts to the training (the one early stopping may end).
PLATEAU = "ReduceLROnPlateau"


def schedule_kind(node: Any) -> str:
    """What a ``scheduler`` setting is: ``constant`` (none), ``plateau`` (``ReduceLROnPlateau``: the rate drops when
    the monitored metric stops improving), ``fixed`` (any other Hydra node: a schedule laid out over the epochs, e.g.
    cosine annealing) or ``callable`` (a factory passed from Python; the loop checks what it builds)."""
    if not node:
        return "constant"
    if not isinstance(node, Mapping):
        return "callable"
    target = str(dict(node).get("_target_") or "")
    return "plateau" if target.rsplit(".", 1)[-1] == PLATEAU else "fixed"


def check_schedule(
    node: Any,
    *,
    patience: int | None,
    monitor_mode: str,
    min_delta: float,
    refuse_fixed: bool = True,
    names: Mapping[str, str] | None = None,
) -> str:
    """Refuse a learning-rate schedule that disagrees with early stopping and selection; returns its
    :func:`schedule_kind`.

    - ``ReduceLROnPlateau`` takes the one improvement rule of the loop (:func:`ddcnn.engine.convergence.improves`):
      ``mode`` = ``monitor_mode``, ``threshold_mode="abs"``, ``threshold`` = ``min_delta``. The loop sets them; a
      scheduler node that sets them otherwise is refused. With early stopping, ``patience`` >= the scheduler's patience
      + 2: the training sees the lowered rate for at least two epochs before it may stop (one to drop, one to improve).
    - ``refuse_fixed``: with early stopping, a fixed-length schedule (cosine annealing, steps) is refused: stopping
      would cut it short, before its rate has come down.

    ``names`` maps ``patience``, ``scheduler``, ``monitor_mode``, ``min_delta`` to the settings the messages name
    (default: the run's ``engine.*`` and ``scheduler``).
    """
    name = {
        "patience": "engine.patience",
        "scheduler": "scheduler",
        "monitor_mode": "engine.monitor_mode",
        "min_delta": "engine.min_delta",
        **(names or {}),
    }
    kind = schedule_kind(node)
    if kind == "plateau":
        spec = dict(node)
        rule = {"mode": monitor_mode, "threshold_mode": "abs", "threshold": float(min_delta)}
        for key, wanted in rule.items():
            given = spec.get(key)
            if given is not None and given != wanted:
                raise ValueError(
                    f"{name['scheduler']}.{key}={given!r}: the plateau scheduler counts an improvement as selection "
                    f"and early stopping do (mode = {name['monitor_mode']}, an absolute threshold = "
                    f"{name['min_delta']}; here {key} would be {wanted!r}). Remove {name['scheduler']}.{key}; set "
                    f"{name['monitor_mode']} / {name['min_delta']} instead."
                )
        waits = spec.get("patience", 10)  # torch's default
        if patience is not None and int(patience) < int(waits) + 2:
            raise ValueError(
                f"{name['patience']}={patience} with {name['scheduler']}.patience={waits}: early stopping would end "
                f"the training before the plateau scheduler's lower learning rate has had two epochs to improve it. "
                f"Set {name['patience']}>={int(waits) + 2} (or ++{name['scheduler']}.patience={int(patience) - 2})."
            )
    if kind == "fixed" and refuse_fixed and patience is not None:
        target = str(dict(node).get("_target_"))
        raise ValueError(
            f"{name['patience']}={patience} with {name['scheduler']} {target.rsplit('.', 1)[-1]}: early stopping "
            f"would cut a fixed-length learning-rate schedule short, before its rate has come down. Drop "
            f"{name['patience']} ({name['patience']}=null: train all epochs), or adapt the budget with the plateau "
            f"scheduler: {name['scheduler']}={{_target_:torch.optim.lr_scheduler.{PLATEAU},_partial_:true,"
            f"factor:0.1,patience:0}}."
        )
    return kind


def check_srun_ddp(num_devices: int, setting: str = "methods.global_ddp.num_devices") -> int | None:
    """The task count of this ``srun`` step when a DDP training across its tasks can run here, ``None`` outside a
    multi-task ``srun`` step (DDP then spawns its processes itself).

    Any ``srun`` form works (``-n G``, ``--ntasks=G``, ``--ntasks-per-node=G``, one node or several): ddcnn's own
    cluster environment (:class:`ddcnn.engine.launch.SrunEnvironment`) reads the step's tasks. What cannot work is a
    step whose task count is not the DDP world: refused here, with the fix, before any training.
    """
    from ddcnn.runtime import srun_task

    task = srun_task("auto")
    if task is None:
        return None
    if task.ntasks != int(num_devices):
        raise ValueError(
            f"the DDP stage trains on {setting}={num_devices} devices, one srun task each, but this srun step has "
            f"{task.ntasks} tasks (SLURM_STEP_NUM_TASKS={os.environ.get('SLURM_STEP_NUM_TASKS')}): run "
            f"srun -n {num_devices} (or --ntasks-per-node={num_devices} on one node), or set {setting}={task.ntasks}."
        )
    return task.ntasks
