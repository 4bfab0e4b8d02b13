"""The ``trainer`` and ``engine`` settings the training loop implements, checked once where the run's
:class:`~ddcnn.settings.RunSettings` is built (:class:`FitSettings`).

Light on purpose (no Lightning Fabric, no torch import): a coordinating process that never trains checks a run's
settings with it. :func:`ddcnn.engine.train.fit` reads the settings through the same functions, so what is checked is
what is used.

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
  ``profile_steps``;
- keys ddcnn does not read are refused with what to do: ``engine.loop`` (ddcnn has one loop: remove it),
  ``trainer.monitor`` and the other keys that live elsewhere (the key to use), any other Lightning ``Trainer``
  argument (the list of those implemented).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddcnn.settings.read import Section

__all__ = [
    "TrainerSettings",
    "EngineSettings",
    "FitSettings",
    "LOOP_TRAINER_KEYS",
    "ADDED_TRAINER_DEFAULTS",
    "PRECISIONS",
    "MONITORS",
    "TRAINER_KEYS",
    "ENGINE_KEYS",
    "AUTO_SWITCHES",
    "check_schedule",
    "schedule_kind",
    "default_min_epochs",
    "check_srun_ddp",
    "num_batches",
    "loop_setting",
    "LOOP_SETTINGS",
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
# trainer.* keys the loop implements.
TRAINER_KEYS = (
    "max_epochs",
    "precision",
    "deterministic",
    "enable_progress_bar",
    "log_every_n_steps",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "limit_train_batches",
    "limit_val_batches",
    "accumulate_grad_batches",
)
ENGINE_KEYS = (
    "monitor",
    "monitor_mode",
    "patience",
    "min_delta",
    "min_epochs",
    "num_devices",
    "checkpoint_every_s",
    "channels_last",
    "tf32",
    "cudnn_benchmark",
    "data_on_device",
    "device_data_fraction",
    "compile",
    "profile_steps",
    "loop",
)
# The settings loop_setting checks: the run's trainer.* and engine.* keys that fit_batches takes as keywords too.
LOOP_SETTINGS = (
    *(key for key in TRAINER_KEYS if key not in ("deterministic", "enable_progress_bar")),
    *("monitor", "monitor_mode", "patience", "min_delta", "checkpoint_every_s"),
)
# engine.* settings that are auto (decided from the device), true or false.
AUTO_SWITCHES = ("channels_last", "tf32", "cudnn_benchmark", "data_on_device")
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
    "trainer.callbacks": "the loop's hooks (ddcnn.engine.loop.fit_batches: after_epoch, on_epoch_end)",
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


def _container(node: Any) -> dict:
    return {} if node is None else dict(node)


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


def _positive_int(value: Any, what: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be a positive whole number{' or null' if allow_none else ''}, got {value!r}.")
    return int(value)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def loop_setting(key: str, value: Any, name: str | None = None) -> Any:
    """The loop setting ``key`` checked and normalised: the one check of each setting that a run's configuration
    (``trainer.<key>``, ``engine.<key>``: :class:`FitSettings`) and a caller of
    :func:`ddcnn.engine.loop.fit_batches` (the keyword ``key``) both give. The message names the setting as ``name``
    (default ``key``), its value and what works.

    Raises:
        ValueError: For a value the loop cannot honour.
    """
    name = name or key
    prefix = name[: -len(key)]  # "engine.", "trainer." or ""
    monitor, epochs = f"{prefix}monitor", "trainer.max_epochs" if prefix == "engine." else f"{prefix}max_epochs"
    if key in ("max_epochs", "accumulate_grad_batches", "log_every_n_steps"):
        return _positive_int(value, name, allow_none=key == "log_every_n_steps")
    if key == "precision":
        if str(value).lower() not in PRECISIONS:
            raise ValueError(
                f"{name}={value!r} is not one the loop runs: use 32-true, bf16-mixed (bf16 autocast), 16-mixed "
                f"(float16 autocast with a loss scaler) or 64-true (float64 weights and arithmetic)."
            )
        return PRECISIONS[str(value).lower()]
    if key == "gradient_clip_val":
        if value is not None and (not _is_real(value) or not value > 0):
            raise ValueError(f"{name} must be > 0 (or null: no clipping), got {value!r}.")
        return None if value is None else float(value)
    if key == "gradient_clip_algorithm":
        if value not in ("norm", "value"):
            raise ValueError(
                f"{name} must be 'norm' (the gradients' global 2-norm, the default) or 'value' (each gradient entry), "
                f"got {value!r}."
            )
        return value
    if key in ("limit_train_batches", "limit_val_batches"):
        num_batches(1, value, name)  # checks the value
        if key == "limit_train_batches" and value in (0, 0.0):
            raise ValueError(f"{name}=0 trains nothing; use a positive number of batches or null.")
        return value
    if key == "monitor_mode":
        if value not in ("max", "min"):
            raise ValueError(f"{name} must be 'max' or 'min', got {value!r}.")
        return str(value)
    if key == "monitor":
        if value not in MONITORS:
            raise ValueError(f"{name} must be one of {', '.join(MONITORS)}, got {value!r}.")
        return str(value)
    if key == "patience":
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            raise ValueError(
                f"{name} must be a whole number of epochs >= 1 (stop a training once {monitor} has not improved for "
                f"that many epochs) or null (train {epochs} epochs), got {value!r}."
            )
        return None if value is None else int(value)
    if key == "min_delta":
        value = 0.0 if value is None else value
        if not _is_real(value) or not value >= 0:
            raise ValueError(
                f"{name} must be >= 0 (early stopping counts an epoch as an improvement only when it beats the best "
                f"one by more than this, in {monitor}'s units; 0 = any improvement), got {value!r}."
            )
        return float(value)
    if key == "checkpoint_every_s":
        if value is not None and (not _is_real(value) or value < 0):
            raise ValueError(f"{name} must be >= 0 (0: after every epoch), got {value!r}.")
        return None if value is None else float(value)
    raise KeyError(f"{key} is not a setting loop_setting checks")


# The defaults of trainer keys given with `+trainer.<key>=` (documented in conf/trainer/default.yaml, which cannot hold
# them: Hydra refuses `+` for a key it has).
ADDED_TRAINER_DEFAULTS = {"accumulate_grad_batches": 1, "gradient_clip_algorithm": "norm"}


def _trainer(t: Section) -> dict:
    """``trainer`` checked and normalised: every key the loop implements, its YAML default where it is absent.

    Raises:
        ValueError: Naming the key, its value and what to use instead, for a key the loop does not implement or a
            value it cannot honour.
    """
    _refuse_unknown("trainer", t.given, TRAINER_KEYS)
    null_is_default = ("precision", "accumulate_grad_batches", "gradient_clip_algorithm")
    out = {
        key: loop_setting(key, t.default(key) if key in null_is_default else t(key), f"trainer.{key}")
        for key in TRAINER_KEYS
        if key in LOOP_SETTINGS
    }
    out["deterministic"] = bool(t("deterministic") or False)
    out["enable_progress_bar"] = t("enable_progress_bar")
    if out["enable_progress_bar"] not in (None, True, False):
        raise ValueError(
            f"trainer.enable_progress_bar must be true, false or null (bars on a terminal, one line per epoch "
            f"otherwise), got {out['enable_progress_bar']!r}."
        )
    return out


def _switch(value: Any, what: str) -> str | bool:
    """An ``auto | true | false`` setting."""
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, str) and value.lower() in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[value.lower()]
    raise ValueError(f"{what} must be auto, true or false, got {value!r}.")


def _engine(e: Section) -> dict:
    """``engine`` checked, its YAML defaults where keys are absent: monitor, monitor_mode, patience, min_delta,
    min_epochs (``None``: half the training's epochs, :func:`default_min_epochs`), num_devices, checkpoint_every_s and
    the GPU policy (``auto`` switches decided from the device by :func:`ddcnn.engine.gpu.resolve_policy`)."""
    if e("loop") is not None:
        raise ValueError(_LOOP_GONE.format(value=e.given["loop"]))
    _refuse_unknown("engine", e.given, ENGINE_KEYS)
    out = {key: loop_setting(key, e(key), f"engine.{key}") for key in ENGINE_KEYS if key in LOOP_SETTINGS}
    out["num_devices"] = _positive_int(e.default("num_devices"), "engine.num_devices")
    out["checkpoint_every_s"] = out["checkpoint_every_s"] or 0.0
    least = out["min_epochs"] = e("min_epochs")
    if least is not None and (isinstance(least, bool) or not isinstance(least, int) or least < 1):
        raise ValueError(
            f"engine.min_epochs must be a whole number of epochs >= 1 (early stopping never ends a training before "
            f"it) or null (half of the training's epochs, rounded up), got {least!r}."
        )
    for key in AUTO_SWITCHES:
        out[key] = _switch(e(key), f"engine.{key}")
    fraction = e("device_data_fraction")
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise ValueError(
            f"engine.device_data_fraction must be a fraction in (0, 1] of the free device memory that a split held on "
            f"the device may take, got {fraction!r}."
        )
    out["device_data_fraction"] = float(fraction)
    compile_ = e("compile")
    if not isinstance(compile_, bool):
        raise ValueError(f"engine.compile must be true (torch.compile the network) or false, got {compile_!r}.")
    out["compile"] = compile_
    steps = e("profile_steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(
            f"engine.profile_steps must be a whole number >= 0 (0: no profile; N: a Chrome trace of N training steps "
            f"in the stage's profile/trace.json), got {steps!r}."
        )
    out["profile_steps"] = int(steps)
    return out


def default_min_epochs(min_epochs: int | None, max_epochs: int) -> int:
    """The epochs a training runs before early stopping may end it: ``engine.min_epochs``, or half of its
    ``max_epochs`` rounded up when that is ``None``; never more than ``max_epochs``."""
    return min(int(max_epochs), -(-int(max_epochs) // 2) if min_epochs is None else int(min_epochs))


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
    target = str(_container(node).get("_target_") or "")
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

    - ``ReduceLROnPlateau`` takes the one improvement rule of the loop (:func:`ddcnn.engine.loop.improves`): ``mode``
      = ``monitor_mode``, ``threshold_mode="abs"``, ``threshold`` = ``min_delta``. The loop sets them; a scheduler
      node that sets them otherwise is refused. With early stopping, ``patience`` >= the scheduler's patience + 2:
      the training sees the lowered rate for at least two epochs before it may stop (one to drop, one to improve).
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
        spec = _container(node)
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
                f"Set {name['patience']}>={int(waits) + 2} (or {name['scheduler']}.patience<={int(patience) - 2})."
            )
    if kind == "fixed" and refuse_fixed and patience is not None:
        target = str(_container(node).get("_target_"))
        raise ValueError(
            f"{name['patience']}={patience} with {name['scheduler']} {target.rsplit('.', 1)[-1]}: early stopping "
            f"would cut a fixed-length learning-rate schedule short, before its rate has come down. Drop "
            f"{name['patience']} ({name['patience']}=null: train all epochs), or adapt the budget with the plateau "
            f"scheduler: {name['scheduler']}={{_target_:torch.optim.lr_scheduler.{PLATEAU},_partial_:true,"
            f"factor:0.1,patience:0}}."
        )
    return kind


@dataclass(frozen=True)
class TrainerSettings:
    """``trainer.*`` checked and normalised."""

    max_epochs: int
    precision: str
    deterministic: bool
    enable_progress_bar: bool | None
    log_every_n_steps: int | None
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    limit_train_batches: int | float | None
    limit_val_batches: int | float | None
    accumulate_grad_batches: int


@dataclass(frozen=True)
class EngineSettings:
    """``engine.*`` checked and normalised; ``auto`` switches are decided from the device
    by :func:`ddcnn.engine.gpu.resolve_policy`."""

    monitor: str
    monitor_mode: str
    patience: int | None
    min_delta: float
    min_epochs: int | None
    num_devices: int
    checkpoint_every_s: float
    channels_last: str | bool
    tf32: str | bool
    cudnn_benchmark: str | bool
    data_on_device: str | bool
    device_data_fraction: float
    compile: bool
    profile_steps: int


# The fit_batches arguments that come from the trainer settings and apply to every training of a run, the coarse DNN's
# included (FitSettings.loop_arguments).
LOOP_TRAINER_KEYS = (
    "precision",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "accumulate_grad_batches",
    "limit_train_batches",
    "limit_val_batches",
    "deterministic",
    "log_every_n_steps",
)


@dataclass(frozen=True)
class FitSettings:
    """How every training runs: ``trainer.*``, ``engine.*``, the ``optimizer`` and ``scheduler`` (``_target_``
    specs) and the ``logger`` group, checked together (the scheduler against early stopping)."""

    trainer: TrainerSettings
    engine: EngineSettings
    optimizer: dict
    scheduler: dict | None
    logger: dict

    @classmethod
    def read(cls, plain: Mapping) -> FitSettings:
        """Every ``trainer`` and ``engine`` setting, and the ``scheduler`` against early stopping, checked, from the
        composed configuration as plain data (what :meth:`ddcnn.settings.RunSettings.from_config` made of it).

        Raises:
            ValueError: Naming the setting, its value and the fix.
        """
        trainer = TrainerSettings(**_trainer(Section("trainer", plain.get("trainer"), ADDED_TRAINER_DEFAULTS)))
        engine = EngineSettings(**_engine(Section("engine", plain.get("engine"))))
        top = Section("", plain)
        scheduler = None if top("scheduler") is None else dict(top("scheduler"))
        check_schedule(
            scheduler, patience=engine.patience, monitor_mode=engine.monitor_mode, min_delta=engine.min_delta
        )
        if engine.patience is not None and (engine.min_epochs or 0) > trainer.max_epochs:
            raise ValueError(
                f"engine.min_epochs={engine.min_epochs} is more than trainer.max_epochs={trainer.max_epochs}: early "
                f"stopping (engine.patience={engine.patience}) could never end a training. Lower engine.min_epochs, "
                f"set it to null (half of trainer.max_epochs), or drop engine.patience."
            )
        if trainer.deterministic and engine.cudnn_benchmark is True:
            raise ValueError(
                "engine.cudnn_benchmark=true picks cuDNN's algorithms by timing them, which trainer.deterministic=true "
                "forbids: set engine.cudnn_benchmark=auto (off when deterministic) or false, or "
                "trainer.deterministic=false."
            )
        if trainer.limit_val_batches in (0, 0.0) and engine.monitor.startswith("val_"):
            raise ValueError(
                f"trainer.limit_val_batches=0 skips validation, so engine.monitor={engine.monitor} has nothing to "
                f"select the weights on: set engine.monitor=train_loss engine.monitor_mode=min (or train_acc / max), "
                f"or validate (limit_val_batches null or > 0)."
            )
        return cls(trainer, engine, dict(top("optimizer")), scheduler, dict(top("logger") or {}))

    def loop_arguments(self) -> dict[str, Any]:
        """The :func:`~ddcnn.engine.loop.fit_batches` arguments of the ``trainer`` settings that apply to every
        training of the run, the coarse DNN's included: precision, clipping, gradient accumulation, batch limits,
        deterministic algorithms, step logging."""
        return {key: getattr(self.trainer, key) for key in LOOP_TRAINER_KEYS}

    @property
    def wants_step_losses(self) -> bool:
        """Whether a logger besides the CSV log (one row per epoch) is configured: only then are step losses worth
        collecting."""
        return any(spec and "_target_" in spec for spec in self.logger.values())


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
