"""The Lightning side of the engine: Trainer construction and :func:`fit_lightning` with resume.

Stages call :func:`ddcnn.engine.train.fit`, which trains with this module under DDP and with ``engine.loop=lightning``
(the prediction helpers of :mod:`ddcnn.engine.common` are re-exported here, their former home). It resumes from
``folder/last.ckpt`` and returns the network with the weights selected on validation (``engine.monitor`` /
``engine.monitor_mode``). What does not train is kept off the critical path:

- the best weights are kept in memory (:class:`BestWeights`), not written to ``best.ckpt`` at every improvement;
- ``last.ckpt`` is written when ``engine.checkpoint_every_s`` seconds of training have passed since the previous one
  (``0``: after every epoch). It carries the best weights so far and the training time of every process that worked
  on the stage (:class:`TrainingClock`), so a resumed stage continues exactly from its last checkpoint and reports
  the time of all its parts;
- epoch metrics are accumulated as tensors and logged once per epoch (:class:`~ddcnn.engine.classifier.Classifier`).
"""

from __future__ import annotations

import csv
import io
import logging
import os
import sys
import time
from pathlib import Path

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddcnn.engine.checkpoint_io import AtomicCheckpointIO
from ddcnn.engine.classifier import Classifier
from ddcnn.engine.common import (
    FitResult,
    build_loggers,
    engine_settings,
    predict_logits,
    save_net,
    save_predictions,
    stage_name,
)
from ddcnn.engine.sync_norm import convert_batch_norm, has_batch_norm
from ddcnn.engine.tensor_fit import scheduler_factory
from ddcnn.io import ArtifactWriteError, atomic_write_text, is_space_or_permission
from ddcnn.runtime import srun_task

log = logging.getLogger(__name__)

__all__ = [
    "FitResult",
    "BestWeights",
    "TrainingClock",
    "PeriodicCheckpoint",
    "EpochLine",
    "device_kwargs",
    "slurm_plugins",
    "independent_ranks",
    "build_scheduler",
    "build_trainer",
    "engine_settings",
    "fit_lightning",
    "predict_logits",
    "save_predictions",
    "save_net",
]


# --- settings ------------------------------------------------------------------------------------
def device_kwargs(device: str | torch.device | None, num_devices: int = 1, launcher: str = "spawn") -> dict:
    """Trainer arguments for one training on ``device``, or on ``num_devices`` devices from it with DDP.

    ``launcher="spawn"``: this process spawns the ranks (``ddp_spawn``: Lightning's plain ``ddp`` launcher re-runs the
    command line, which hangs under Hydra multirun). ``launcher="slurm"``: the ranks are the tasks of this ``srun``
    step, one device each; world size, ranks and nodes come from SLURM. On CPU the processes talk over gloo.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if num_devices < 1:
        raise ValueError(f"engine.num_devices must be >= 1, got {num_devices}.")
    if num_devices > 1 and launcher == "slurm":
        import os

        nodes = int(os.environ.get("SLURM_NNODES") or os.environ.get("SLURM_JOB_NUM_NODES") or 1)
        per_node = max(1, num_devices // nodes)
        return {
            "accelerator": "gpu" if device.type == "cuda" else "cpu",
            "devices": per_node,
            "num_nodes": nodes,
            "strategy": "ddp",
            "use_distributed_sampler": False,
        }
    if device.type == "cuda":
        first = device.index or 0
        kwargs = {"accelerator": "gpu", "devices": list(range(first, first + num_devices))}
    else:
        kwargs = {"accelerator": "cpu", "devices": num_devices}
    if num_devices > 1:
        # Our batch sampler shards itself by rank (see TensorDataModule), so Lightning must not replace it.
        kwargs.update(strategy="ddp_spawn", use_distributed_sampler=False)
    return kwargs


def slurm_plugins(num_devices: int = 1, launcher: str = "spawn") -> list:
    """Trainer plugins under SLURM: Lightning must not requeue (submitit owns that) nor take tasks for ranks.

    A single-device training in a one-task job gets ``SLURMEnvironment(auto_requeue=False)``; a task of a
    multi-task ``srun`` step, or a training that spans several devices inside one task (``ddp_spawn``), gets a
    plain ``LightningEnvironment`` because its processes are not SLURM's tasks. Outside SLURM: no plugins.
    """
    import os

    if "SLURM_JOB_ID" not in os.environ:
        return []
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    if num_devices > 1 and launcher == "slurm":  # DDP across the tasks of this srun step
        return [SLURMEnvironment(auto_requeue=False)]
    ntasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS") or 1)
    if ntasks > 1 or num_devices > 1 or os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return [LightningEnvironment()]
    return [SLURMEnvironment(auto_requeue=False)]


def independent_ranks() -> None:
    """Let a process that is one of several SLURM tasks train on its own, as rank 0 of a world of one.

    Lightning sets its rank-zero guard from ``SLURM_PROCID`` at import; for an independent local net every
    task must log and write like rank 0.
    """
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    rank_zero_only.rank = 0


def build_scheduler(cfg: DictConfig, stage_epochs: int):
    """The configured learning-rate schedule (a partial: ``optimizer -> LRScheduler``), or ``None``; ``T_max: null``
    becomes the epochs of the stage that trains (:func:`ddcnn.engine.tensor_fit.scheduler_factory`)."""
    return scheduler_factory(cfg.get("scheduler"), stage_epochs)


# --- callbacks -----------------------------------------------------------------------------------
class BestWeights(Callback):
    """Keeps the network's weights of the best validation epoch in memory (strictly better replaces, as
    Lightning's ``ModelCheckpoint``); its state, saved in ``last.ckpt``, carries them across a resume."""

    def __init__(self, monitor: str = "val_acc", mode: str = "max") -> None:
        self.monitor, self.mode = monitor, mode
        self.best_score: float | None = None
        self.best_epoch: int | None = None
        self.best_state: dict[str, torch.Tensor] | None = None

    def _better(self, score: float) -> bool:
        if self.best_score is None:
            return True
        return score > self.best_score if self.mode == "max" else score < self.best_score

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        score = float(trainer.callback_metrics[self.monitor])
        if self._better(score):
            self.best_score, self.best_epoch = score, int(trainer.current_epoch)
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in pl_module.net.state_dict().items()}

    def state_dict(self) -> dict:
        return {"best_score": self.best_score, "best_epoch": self.best_epoch, "best_state": self.best_state}

    def load_state_dict(self, state_dict: dict) -> None:
        self.best_score = state_dict.get("best_score")
        self.best_epoch = state_dict.get("best_epoch")
        self.best_state = state_dict.get("best_state")


class TrainingClock(Callback):
    """Training time of all the processes that worked on one stage, carried in its checkpoints.

    ``start`` is this process's start of the stage (``time.perf_counter()``); a checkpoint stores the time of the
    earlier processes plus this one's so far, and a resumed process adds its own time to what it restored. In a
    process that DDP spawned, the clock restarts when training starts there, so that the processes' start-up is
    not counted (it is recorded apart as ``startup_s``, see :func:`fit`).
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.earlier_s = 0.0
        self._pid = os.getpid()
        self._prefit_s = 0.0

    def mark_fit(self) -> None:
        """Called just before ``trainer.fit``: the set-up time so far belongs to the stage."""
        self._prefit_s = time.perf_counter() - self.start

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if os.getpid() != self._pid:  # a spawned DDP process: count from here, plus the parent's set-up
            self.start = time.perf_counter() - self._prefit_s
            self._pid = os.getpid()

    def elapsed(self) -> float:
        return self.earlier_s + (time.perf_counter() - self.start)

    def state_dict(self) -> dict:
        return {"elapsed_s": self.elapsed(), "earlier_s": self.earlier_s}

    def load_state_dict(self, state_dict: dict) -> None:
        self.earlier_s = float(state_dict.get("elapsed_s", 0.0))


class PeriodicCheckpoint(Callback):
    """Writes ``last.ckpt`` after a validated epoch once ``every_s`` seconds passed since the previous write, and
    after the last epoch.

    ``every_s=0`` writes after every epoch. The checkpoint goes through :class:`AtomicCheckpointIO` and holds the
    state of every callback (best weights, clock), so a resume from it is exact.
    """

    def __init__(self, path: Path, every_s: float) -> None:
        self.path, self.every_s = Path(path), float(every_s)
        self._last_write = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        now = time.perf_counter()
        final = trainer.current_epoch + 1 >= (trainer.max_epochs or 0)
        due = final or now - self._last_write >= self.every_s
        if trainer.world_size > 1:  # saving is collective under DDP: every rank follows rank 0's clock
            due = bool(trainer.strategy.broadcast(due, src=0))
        if due:
            for logger in trainer.loggers:  # the epochs in the checkpoint are in metrics.csv too
                logger.save()
            trainer.save_checkpoint(self.path, weights_only=False)
            self._last_write = time.perf_counter()


class EpochLine(Callback):
    """One log line per epoch, for output that is not a terminal (SLURM's ``slurm-*.out``, CI logs, ``> log``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("train_", "val_"))}
        shown = " ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
        log.info("%s: epoch %d/%d %s", self.name, trainer.current_epoch + 1, trainer.max_epochs, shown)


# --- CSV history that survives a resume ------------------------------------------------------------
class _KeepingWriter(ExperimentWriter):
    """Lightning's CSV writer deletes ``metrics.csv`` when it starts; after a resume it keeps the rows of the epochs
    up to the checkpoint (those after it are trained again) and appends the new ones."""

    def __init__(self, log_dir: str, keep_through_epoch: int | None) -> None:
        self._keep_through = keep_through_epoch
        super().__init__(log_dir=log_dir)

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        if self._keep_through is None:
            path.unlink()
            return
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            header, rows = list(reader.fieldnames or []), list(reader)
        kept = [r for r in rows if r.get("epoch") not in (None, "") and float(r["epoch"]) <= self._keep_through]
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=header)
        writer.writeheader()
        writer.writerows(kept)
        atomic_write_text(path, buffer.getvalue(), fsync=False)
        self.metrics_keys = sorted(header)


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` keeps every epoch across a resume (``keep_through_epoch``: the epoch of the
    checkpoint resumed from, ``None`` for a fresh start)."""

    def __init__(self, *args, keep_through_epoch: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._keep_through = keep_through_epoch

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeepingWriter(self.log_dir, self._keep_through)
        return self._experiment


# --- trainer -------------------------------------------------------------------------------------
def build_trainer(
    cfg: DictConfig,
    folder: Path,
    device,
    max_epochs: int | None = None,
    callbacks: list[Callback] = (),
    resumed_epoch: int | None = None,
) -> L.Trainer:
    """A Lightning ``Trainer`` for one training into ``folder`` from ``cfg.trainer`` and ``cfg.engine``.

    ``trainer.enable_progress_bar: null`` (the default) shows progress bars on a terminal and, when the output is a
    file, one line per epoch instead of carriage-return redraws.
    """
    tcfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    settings = engine_settings(cfg)
    tcfg.update(device_kwargs(device, settings["num_devices"], settings["ddp_launcher"]))
    if max_epochs is not None:
        tcfg["max_epochs"] = int(max_epochs)
    callbacks = list(callbacks)
    if tcfg.get("enable_progress_bar") is None:
        tcfg["enable_progress_bar"] = sys.stderr.isatty()
        if not tcfg["enable_progress_bar"]:
            callbacks.append(EpochLine(stage_name(folder)))
    logger = [ResumableCSVLogger(save_dir=str(folder), name="logs", version="", keep_through_epoch=resumed_epoch)]
    logger += build_loggers(cfg, folder)
    return L.Trainer(
        default_root_dir=str(folder),
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=False,  # PeriodicCheckpoint writes last.ckpt; BestWeights keeps the best in memory
        plugins=[AtomicCheckpointIO(), *slurm_plugins(settings["num_devices"], settings["ddp_launcher"])],
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **tcfg,
    )


def fit_lightning(
    cfg: DictConfig,
    net: nn.Module,
    datamodule,
    folder: Path,
    device,
    seed: int,
    start: float,
    max_epochs: int | None = None,
    optimizer_cfg: DictConfig | None = None,
) -> FitResult:
    """Train ``net`` with Lightning into ``folder``, resuming from ``folder/last.ckpt`` (``engine.loop=lightning``,
    and DDP; :func:`ddcnn.engine.train.fit` chooses).

    Arguments and result as :func:`ddcnn.engine.train.fit`.
    """
    L.seed_everything(seed, workers=True, verbose=False)
    settings = engine_settings(cfg)
    if srun_task("auto") is not None and not (settings["num_devices"] > 1 and settings["ddp_launcher"] == "slurm"):
        independent_ranks()
    epochs = int(max_epochs if max_epochs is not None else cfg.trainer.max_epochs)
    if settings["num_devices"] > 1 and has_batch_norm(net):
        # DDP normalises over the global batch, as the one-device run does: exact DDP (see ddcnn.engine.sync_norm).
        net = convert_batch_norm(net, device)
    optimizer = hydra.utils.instantiate(optimizer_cfg if optimizer_cfg is not None else cfg.optimizer)
    module = Classifier(
        net, num_classes=int(cfg.data.num_classes), optimizer=optimizer, scheduler=build_scheduler(cfg, epochs)
    )
    last = folder / "last.ckpt"
    best = BestWeights(settings["monitor"], settings["monitor_mode"])
    clock = TrainingClock(start)
    callbacks = [best, clock, PeriodicCheckpoint(last, settings["checkpoint_every_s"])]
    resumed = None
    if last.is_file():
        resumed = torch.load(last, map_location="cpu", weights_only=False).get("epoch")
        log.info("%s: resuming from %s (after epoch %s)", folder, last, resumed)
    trainer = build_trainer(cfg, folder, device, epochs, callbacks, resumed_epoch=resumed)
    clock.mark_fit()
    try:
        trainer.fit(
            module,
            train_dataloaders=datamodule.train_dataloader(),
            val_dataloaders=datamodule.val_dataloader(),
            ckpt_path=str(last) if last.is_file() else None,
        )
    except OSError as err:
        if isinstance(err, ArtifactWriteError) or not is_space_or_permission(err):
            raise
        raise ArtifactWriteError(
            err.errno,
            f"training in {folder} stopped: {err}. Free disk space or choose a writable run directory, then "
            f"run the same command again: it resumes from the last checkpoint.",
        ) from err
    startup = 0.0
    spawned = settings["num_devices"] > 1 and settings["ddp_launcher"] == "spawn"
    if spawned:
        # ddp_spawn trained in other processes: their callbacks' states come back only in the final last.ckpt.
        wall = time.perf_counter() - start
        states = torch.load(last, map_location="cpu", weights_only=False).get("callbacks", {})
        best.load_state_dict(states.get(best.state_key, {}))
        saved = states.get(clock.state_key, {})
        trained, earlier = float(saved.get("elapsed_s", wall)), float(saved.get("earlier_s", 0.0))
        startup = max(0.0, wall - (trained - earlier))  # spawning the ranks, process-group set-up, tear-down
        clock.earlier_s, clock.start = trained, time.perf_counter()
    clock_time, earlier = clock.elapsed(), earlier if spawned else clock.earlier_s
    if best.best_state is not None:
        module.net.load_state_dict(best.best_state)
    elif (folder / "best.ckpt").is_file():  # a run directory written before the best weights moved into last.ckpt
        module.load_state_dict(torch.load(folder / "best.ckpt", map_location="cpu", weights_only=False)["state_dict"])
    rank = 0 if spawned else int(trainer.global_rank)
    world = int(trainer.world_size)
    return FitResult(module.net, clock_time, earlier, resumed, best.best_epoch, startup, rank, world, "lightning")
