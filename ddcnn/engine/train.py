"""How a stage trains a network: :func:`fit` trains with the run's loop settings (:class:`~ddcnn.settings.LoopSettings`)
in the one loop (:func:`ddcnn.engine.loop.fit_batches`) on one device, with DDP spawned over ``engine.num_devices``,
or with DDP across the tasks of an ``srun`` step (the ``global_ddp`` stage).

The loop and Lightning Fabric are imported with this module, so that a stage module's import (process start-up, before
any stage clock starts) pays for them, never a training's clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The first optimizer a process builds imports torch._dynamo (torch.optim wraps its methods in torch._disable_dynamo):
# about 3 s of CPU on the development machine. Imported with the engine, it is process start-up, outside the time of
# whichever stage happens to build the first optimizer, as the timing rule says.
import torch._dynamo  # noqa: F401
from torch import nn

from ddcnn.data.datamodule import TensorDataModule
from ddcnn.engine.launch import seed_everything
from ddcnn.engine.loggers import EpochReporter
from ddcnn.engine.loop import FitResult, fit_batches
from ddcnn.settings import RunSettings
from ddcnn.settings.loop import LoopSettings

__all__ = ["FitResult", "fit", "fit_tensors", "seed_everything", "EVAL_CHUNK"]

# Rows per forward pass when evaluating the coarse DNN's tensors; bounds the memory of a hidden layer.
EVAL_CHUNK = 65_536


def fit(
    run: RunSettings,
    net: nn.Module,
    data,
    folder: Path,
    start: float,
    callbacks: Sequence[Any] = (),
    **changes: Any,
) -> FitResult:
    """Train ``net`` on ``data`` into ``folder`` with the run's loop settings, resuming from ``folder/last.ckpt``.

    Args:
        run: The run's settings (``run.loop``: :class:`~ddcnn.settings.LoopSettings`; ``run.logger``: the progress
            reporter's loggers), checked where they were built.
        net: The network to train.
        data: Its batches (:class:`~ddcnn.data.datamodule.Batches`; under DDP ``batch_size`` is per device).
        folder: The stage folder (``last.ckpt``, ``logs/metrics.csv``).
        start: ``time.perf_counter()`` at the start of the stage in this process.
        callbacks: What the stage adds to the training (e.g. curve points), after the progress reporter.
        changes: Loop settings this training sets itself (:func:`dataclasses.replace` of ``settings``): ``seed`` and
            ``device`` always; e.g. an optional method's ``max_epochs`` or ``optimizer``, DDP's ``num_devices`` and
            ``launcher``.

    Returns:
        The network with its best weights and the stage's training time over all processes that worked on it.
    """
    # last.ckpt holds the best weights; net.pt is what later stages read
    given = {k: v for k, v in changes.items() if v is not None}
    settings = dataclasses.replace(run.loop, write_best=False, **given)
    seed_everything(settings.seed)
    reporter = EpochReporter(run.logger, settings.enable_progress_bar, folder, settings.max_epochs)
    return fit_batches(net, data, Path(folder), settings, [reporter, *callbacks], start)


def fit_tensors(
    net: nn.Module,
    x: Mapping[str, torch.Tensor],
    y: Mapping[str, torch.Tensor],
    folder: str | Path,
    settings: LoopSettings,
    *,
    batch_size: int | None = None,
    eval_batch_size: int = EVAL_CHUNK,
    callbacks: Sequence[Any] = (),
    start: float | None = None,
) -> FitResult:
    """:func:`fit_batches` on in-memory tensors ``x[split], y[split]`` (the coarse DNN's ``(n, N, K)`` local outputs).

    ``batch_size`` rows per step, ``None`` or 0 for the whole training split (full-batch steps); the data's seed is
    ``settings.seed`` (0 when ``None``).
    """
    for split in ("train", "val"):
        if split not in x or split not in y:
            raise ValueError(
                f"fit_tensors needs x and y for the splits 'train' and 'val', got {sorted(x)}/{sorted(y)}."
            )
    for split in x:
        if len(x[split]) != len(y[split]):
            raise ValueError(f"{split}: {len(x[split])} inputs but {len(y[split])} labels.")
    if batch_size is not None and int(batch_size) < 0:
        raise ValueError(f"batch_size must be a positive number of rows, or 0/null for full batches, got {batch_size}.")
    if int(eval_batch_size) < 1:
        raise ValueError(f"eval_batch_size must be >= 1, got {eval_batch_size!r}.")
    n_train = len(y["train"])
    splits = [s for s in x if s in y]
    seed = 0 if settings.seed is None else settings.seed
    data = TensorDataModule(
        {s: x[s] for s in splits},
        {s: y[s].long() for s in splits},
        batch_size=max(1, int(batch_size) if batch_size else n_train),
        eval_batch_size=int(eval_batch_size),
        seed=int(seed),
    )
    return fit_batches(net, data, folder, dataclasses.replace(settings, seed=seed), callbacks, start)
