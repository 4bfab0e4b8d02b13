"""How a stage trains a network: :func:`fit` reads the run's ``trainer`` and ``engine`` settings and trains with the
one loop (:func:`ddcnn.engine.loop.fit_batches`) on one device, with DDP spawned over ``engine.num_devices``, or with
DDP across the tasks of an ``srun`` step (the ``global_ddp`` stage).

The loop and Lightning Fabric are imported with this module, so that a stage module's import (process start-up, before
any stage clock starts) pays for them, never a training's clock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# The first optimizer a process builds imports torch._dynamo (torch.optim wraps its methods in torch._disable_dynamo):
# about 3 s of CPU on the development machine. Imported with the engine, it is process start-up, outside the time of
# whichever stage happens to build the first optimizer, as the timing rule says.
import torch._dynamo  # noqa: F401
from omegaconf import DictConfig
from torch import nn

from ddcnn.engine.gpu import POLICY_OFF
from ddcnn.engine.launch import seed_everything
from ddcnn.engine.loggers import EpochReporter
from ddcnn.engine.loop import FitResult, fit_batches
from ddcnn.engine.settings import check_schedule, default_min_epochs, engine_settings, trainer_settings

__all__ = ["FitResult", "fit", "loop_settings", "seed_everything"]


def loop_settings(cfg: DictConfig) -> dict[str, Any]:
    """The :func:`~ddcnn.engine.loop.fit_batches` arguments that come from the run's ``trainer`` settings and apply to
    every training of the run, the coarse DNN's included: precision, clipping, gradient accumulation, batch limits,
    deterministic algorithms, step logging."""
    trainer = trainer_settings(cfg)
    keys = (
        "precision",
        "gradient_clip_val",
        "gradient_clip_algorithm",
        "accumulate_grad_batches",
        "limit_train_batches",
        "limit_val_batches",
        "deterministic",
        "log_every_n_steps",
    )
    return {key: trainer[key] for key in keys}


def fit(
    cfg: DictConfig,
    net: nn.Module,
    data,
    folder: Path,
    device,
    seed: int,
    start: float,
    max_epochs: int | None = None,
    optimizer_cfg: Any = None,
    after_epoch=None,
    *,
    num_devices: int | None = None,
    launcher: str | None = None,
    **loop: Any,
) -> FitResult:
    """Train ``net`` on ``data`` into ``folder`` with the run's settings, resuming from ``folder/last.ckpt``.

    Args:
        cfg: The run configuration (``trainer``, ``engine``, ``optimizer``, ``scheduler``, ``logger``).
        net: The network to train.
        data: Its batches (:class:`~ddcnn.data.datamodule.Batches`; under DDP ``batch_size`` is per device).
        folder: The stage folder (``last.ckpt``, ``logs/metrics.csv``).
        device: Where it trains (with DDP spawned over several devices: the first of them).
        seed: Seeds the order of the samples and the dropout of every epoch (see :mod:`ddcnn.engine.loop`).
        start: ``time.perf_counter()`` at the start of the stage in this process.
        max_epochs: Overrides ``trainer.max_epochs`` (the coarse DNN's and the optional methods' own epochs).
        optimizer_cfg: Overrides ``cfg.optimizer``.
        after_epoch: ``(epoch, row, net) -> metrics | None`` after each epoch's validation (rank 0), outside the
            training clock; its metrics join the row (see :func:`~ddcnn.engine.loop.fit_batches`).
        num_devices: DDP ranks; default ``engine.num_devices``.
        launcher: ``local``, ``spawn`` or ``srun`` (see :func:`~ddcnn.engine.loop.fit_batches`); default: one device
            in this process, spawned DDP for several.
        loop: Further :func:`~ddcnn.engine.loop.fit_batches` arguments a stage sets itself, e.g. the coarse DNN's
            ``checkpoint_every`` (epochs instead of ``engine.checkpoint_every_s``), ``after_epoch`` or
            ``divergence_restarts``.

    Returns:
        The network with its best weights and the stage's training time over all processes that worked on it.
    """
    trainer, engine = trainer_settings(cfg), engine_settings(cfg)
    epochs = int(max_epochs if max_epochs is not None else trainer["max_epochs"])
    # engine.patience with a fixed-length schedule is refused here (cut short, its rate would never come down); the
    # loop itself allows it for the coarse DNN's own recipe (coarse.patience).
    check_schedule(
        cfg.get("scheduler"),
        patience=engine["patience"],
        monitor_mode=engine["monitor_mode"],
        min_delta=engine["min_delta"],
    )
    seed_everything(seed)
    settings: dict[str, Any] = {
        **loop_settings(cfg),
        "optimizer": optimizer_cfg if optimizer_cfg is not None else cfg.optimizer,
        "scheduler": cfg.get("scheduler"),
        "max_epochs": epochs,
        "seed": int(seed),
        "monitor": engine["monitor"],
        "monitor_mode": engine["monitor_mode"],
        "patience": engine["patience"],
        "min_delta": engine["min_delta"],
        # half of this training's epochs unless engine.min_epochs says otherwise (an optional method's own budget)
        "min_epochs": default_min_epochs(engine["min_epochs"], epochs),
        "checkpoint_every_s": engine["checkpoint_every_s"],
        "device": device,
        "num_devices": int(num_devices if num_devices is not None else engine["num_devices"]),
        "launcher": launcher,
        "reporter": EpochReporter(cfg, folder, epochs),
        "after_epoch": after_epoch,
        "start": start,
        "write_best": False,  # last.ckpt holds the best weights; net.pt is what later stages read
        "gpu": {key: engine[key] for key in POLICY_OFF},
    }
    if "checkpoint_every" in loop:
        settings["checkpoint_every_s"] = None  # the stage counts checkpoints in epochs
    settings.update(loop)
    return fit_batches(net, data, Path(folder), **settings)
