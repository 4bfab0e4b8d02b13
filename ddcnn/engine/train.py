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
from torch import nn

from ddcnn.engine.gpu import POLICY_OFF
from ddcnn.engine.launch import seed_everything
from ddcnn.engine.loggers import EpochReporter
from ddcnn.engine.loop import FitResult, fit_batches
from ddcnn.settings.fit import FitSettings, default_min_epochs

__all__ = ["FitResult", "fit", "seed_everything"]


def fit(
    settings: FitSettings,
    net: nn.Module,
    data,
    folder: Path,
    device,
    seed: int,
    start: float,
    max_epochs: int | None = None,
    optimizer: Any = None,
    after_epoch=None,
    *,
    num_devices: int | None = None,
    launcher: str | None = None,
    **loop: Any,
) -> FitResult:
    """Train ``net`` on ``data`` into ``folder`` with the run's settings, resuming from ``folder/last.ckpt``.

    Args:
        settings: The run's :class:`~ddcnn.settings.FitSettings` (``trainer``, ``engine``, ``optimizer``,
            ``scheduler``, ``logger``), checked where they were built.
        net: The network to train.
        data: Its batches (:class:`~ddcnn.data.datamodule.Batches`; under DDP ``batch_size`` is per device).
        folder: The stage folder (``last.ckpt``, ``logs/metrics.csv``).
        device: Where it trains (with DDP spawned over several devices: the first of them).
        seed: Seeds the order of the samples and the dropout of every epoch (see :mod:`ddcnn.engine.loop`).
        start: ``time.perf_counter()`` at the start of the stage in this process.
        max_epochs: Overrides ``trainer.max_epochs`` (the coarse DNN's and the optional methods' own epochs).
        optimizer: Overrides ``optimizer`` (a ``_partial_`` spec or a factory of the parameters).
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
    trainer, engine = settings.trainer, settings.engine
    epochs = int(max_epochs if max_epochs is not None else trainer.max_epochs)
    seed_everything(seed)
    arguments: dict[str, Any] = {
        **settings.loop_arguments(),
        "optimizer": optimizer if optimizer is not None else settings.optimizer,
        "scheduler": settings.scheduler,
        "max_epochs": epochs,
        "seed": int(seed),
        "monitor": engine.monitor,
        "monitor_mode": engine.monitor_mode,
        "patience": engine.patience,
        "min_delta": engine.min_delta,
        # half of this training's epochs unless engine.min_epochs says otherwise (an optional method's own budget)
        "min_epochs": default_min_epochs(engine.min_epochs, epochs),
        "checkpoint_every_s": engine.checkpoint_every_s,
        "device": device,
        "num_devices": int(num_devices if num_devices is not None else engine.num_devices),
        "launcher": launcher,
        "reporter": EpochReporter(settings, folder, epochs),
        "after_epoch": after_epoch,
        "start": start,
        "write_best": False,  # last.ckpt holds the best weights; net.pt is what later stages read
        "gpu": {key: getattr(engine, key) for key in POLICY_OFF},
    }
    if "checkpoint_every" in loop:
        arguments["checkpoint_every_s"] = None  # the stage counts checkpoints in epochs
    arguments.update(loop)
    return fit_batches(net, data, Path(folder), **arguments)
