"""How every stage trains a network: ddcnn's own loop on one device, Lightning for DDP (and on request).

:func:`fit` is what the stages call. ``engine.loop`` picks the loop:

- ``plain``: :func:`ddcnn.engine.tensor_fit.fit_tensors`, a PyTorch loop over the batches of a
  :class:`~ddcnn.data.datamodule.Batches` (the same batches, augmentation, selection on validation,
  ``last.ckpt`` every ``engine.checkpoint_every_s`` with an exact resume, ``logs/metrics.csv`` and the configured
  loggers). A process that trains this way never imports Lightning;
- ``lightning``: a Lightning ``Trainer`` (:func:`ddcnn.engine.fit.fit_lightning`), which DDP always uses;
- ``auto`` (the default): ``plain`` for a training on one device whose ``trainer`` settings the plain loop implements,
  ``lightning`` otherwise (DDP, other Trainer arguments, or a stage interrupted under Lightning, which resumes there).

Why a loop of our own: the local nets are small and many. Measured on the 2-core development machine, importing
Lightning costs about 6 s of CPU per process (it imports torchmetrics, which imports torchvision's models and
SciPy), and the tear-down of such a process about 2 s more: on the critical path of every worker process, SLURM task
and command. Lightning's per-step work (hooks, closures, result collection) is about 1 ms per step, which a 9x9
sub-image pays as fully as a full image. The global CNN trains with the same loop, so the comparison stays fair.

This module, :mod:`ddcnn.engine.tensor_fit` and :mod:`ddcnn.data.datamodule` do not import Lightning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

# The first optimizer a process builds imports torch._dynamo (torch.optim wraps its methods in torch._disable_dynamo):
# about 3 s of CPU on the development machine. Imported with the engine, it is process start-up, outside the time of
# whichever stage happens to build the first optimizer (the first local net), as the timing rule says.
import torch._dynamo  # noqa: F401
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddcnn.engine.common import (
    LOOPS,
    FitResult,
    build_loggers,
    engine_settings,
    predict_logits,
    save_net,
    save_predictions,
    stage_name,
)
from ddcnn.engine.tensor_fit import CHECKPOINT_FORMAT, fit_tensors

log = logging.getLogger(__name__)

__all__ = [
    "LOOPS",
    "FitResult",
    "EpochReporter",
    "engine_settings",
    "choose_loop",
    "build_loggers",
    "seed_everything",
    "stage_name",
    "fit",
    "predict_logits",
    "save_predictions",
    "save_net",
]

# Trainer arguments (conf/trainer/) the plain loop implements; any other one that is set needs Lightning.
PLAIN_TRAINER_KEYS = frozenset(
    {
        "max_epochs",
        "precision",
        "deterministic",
        "enable_progress_bar",
        "log_every_n_steps",  # the plain loop logs once per epoch
        "gradient_clip_val",
        "limit_train_batches",
        "limit_val_batches",
    }
)
_PRECISIONS = {"32": None, "32-true": None, "bf16-mixed": torch.bfloat16}


def _checkpoint_format(path: Path) -> str | None:
    """``plain`` or ``lightning`` for the loop that wrote ``path``, ``None`` when there is no checkpoint."""
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    return "plain" if isinstance(state, dict) and state.get("format") == CHECKPOINT_FORMAT else "lightning"


def _unsupported(trainer: Mapping) -> list[str]:
    """The ``trainer`` settings that only Lightning implements, as ``key=value``."""
    out = [f"{k}={v!r}" for k, v in trainer.items() if k not in PLAIN_TRAINER_KEYS and v is not None]
    precision = str(trainer.get("precision", "32-true"))
    if precision not in _PRECISIONS:
        out.append(f"precision={precision!r}")
    if trainer.get("limit_val_batches") in (0, 0.0):
        out.append("limit_val_batches=0 (no validation)")
    return out


def choose_loop(cfg: DictConfig, folder: Path | None = None) -> tuple[str, str]:
    """The loop (``plain`` or ``lightning``) that trains with ``cfg`` into ``folder``, and why."""
    settings = engine_settings(cfg)
    wanted = settings["loop"]
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    found = _checkpoint_format(Path(folder) / "last.ckpt") if folder is not None else None
    reasons = []
    if settings["num_devices"] > 1:
        reasons.append(f"DDP on {settings['num_devices']} devices")
    reasons += _unsupported(trainer)
    if wanted == "plain" and reasons:
        raise ValueError(
            f"engine.loop=plain cannot train with {', '.join(reasons)}: use engine.loop=lightning (or auto), or drop "
            f"those settings."
        )
    loop = "plain" if wanted == "plain" or (wanted == "auto" and not reasons) else "lightning"
    if found is not None and found != loop:
        if wanted == "auto" and found == "lightning":
            return "lightning", f"{folder}/last.ckpt was written by Lightning: it resumes there"
        raise ValueError(
            f"{folder}/last.ckpt was written by the {found} loop, but this training would use the {loop} loop "
            f"({', '.join(reasons) or 'engine.loop=' + wanted}), which cannot resume it. Set engine.loop={found} to "
            f"resume, or run with force=true to start the stage over."
        )
    if loop == "lightning":
        return loop, ", ".join(reasons) if reasons else "engine.loop=lightning"
    return loop, "one device" if wanted == "auto" else "engine.loop=plain"


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (as Lightning's ``seed_everything``, without Lightning)."""
    seed = int(seed)
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class EpochReporter:
    """What a plain-loop training shows and logs after each epoch: a progress bar on a terminal or one log line per
    epoch (SLURM's ``slurm-*.out``, CI logs, ``> log``), and the epoch's metrics to the loggers of ``logger``.

    Args:
        cfg: The run configuration (``logger``, ``trainer.enable_progress_bar``).
        folder: The stage folder (where the loggers write).
        max_epochs: Epochs of the training.
        every: Log a line every this many epochs (and after the last one), for trainings of many short epochs.

    The bar starts at the first epoch reported (a resumed training's).
    """

    def __init__(self, cfg: DictConfig, folder: Path, max_epochs: int, every: int = 1) -> None:
        self.name, self.max_epochs, self.every = stage_name(folder), int(max_epochs), max(1, int(every))
        self.loggers = build_loggers(cfg, folder)
        self.use_bar = (cfg.get("trainer") or {}).get("enable_progress_bar") is not False and sys.stderr.isatty()
        self.bar = None

    def __call__(self, epoch: int, row: Mapping[str, float]) -> None:
        metrics = {k: float(v) for k, v in row.items() if k not in ("epoch", "step") and v is not None}
        for logger in self.loggers:
            logger.log_metrics({**metrics, "epoch": float(epoch)}, step=int(epoch))
        shown = {k: v for k, v in sorted(metrics.items()) if k.startswith(("train_", "val_"))}
        if self.use_bar:
            if self.bar is None:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=self.max_epochs, initial=epoch, desc=self.name, unit="epoch", leave=False)
            self.bar.set_postfix({k: f"{v:.4f}" for k, v in shown.items()}, refresh=False)
            self.bar.update(1)
        elif (epoch + 1) % self.every == 0 or epoch + 1 == self.max_epochs:
            text = " ".join(f"{k} {v:.4f}" for k, v in shown.items())
            log.info("%s: epoch %d/%d %s", self.name, epoch + 1, self.max_epochs, text)

    def close(self, status: str = "success") -> None:
        if self.bar is not None:
            self.bar.close()
        for logger in self.loggers:
            logger.finalize(status)


@contextlib.contextmanager
def _deterministic(enabled: bool) -> Iterator[None]:
    """``trainer.deterministic`` for the plain loop: torch's deterministic algorithms within the block."""
    if not enabled:
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _fit_plain(
    cfg, net, datamodule, folder: Path, device, start: float, epochs: int, optimizer_cfg, after_epoch=None
) -> FitResult:
    settings = engine_settings(cfg)
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    reporter = EpochReporter(cfg, folder, epochs)
    status = "failed"
    try:
        with _deterministic(bool(trainer.get("deterministic"))):
            fitted = fit_tensors(
                net,
                {},
                {},
                folder,
                optimizer=optimizer_cfg if optimizer_cfg is not None else cfg.optimizer,
                scheduler=cfg.get("scheduler"),
                max_epochs=epochs,
                batch_size=datamodule.batch_size,
                seed=datamodule.seed,
                monitor=settings["monitor"],
                monitor_mode=settings["monitor_mode"],
                checkpoint_every_s=settings["checkpoint_every_s"],
                device=device,
                eval_batch_size=datamodule.eval_batch_size,
                on_epoch_end=reporter,
                after_epoch=after_epoch,
                batches=datamodule,  # the data's Batches protocol: reads, moves, normalises, augments, crops
                limit_train_batches=trainer.get("limit_train_batches"),
                limit_val_batches=trainer.get("limit_val_batches"),
                gradient_clip_val=trainer.get("gradient_clip_val"),
                autocast_dtype=_PRECISIONS[str(trainer.get("precision", "32-true"))],
                start=start,
                write_best=False,
            )
        status = "success"
    finally:
        reporter.close(status)
    return FitResult(
        fitted.net, fitted.fit_time_s, fitted.previous_time_s, fitted.resumed_from_epoch, fitted.best_epoch
    )


def fit(
    cfg: DictConfig,
    net: nn.Module,
    datamodule,
    folder: Path,
    device,
    seed: int,
    start: float,
    max_epochs: int | None = None,
    optimizer_cfg: DictConfig | None = None,
    after_epoch=None,
) -> FitResult:
    """Train ``net`` on ``datamodule`` into ``folder``, resuming from ``folder/last.ckpt``; see the module doc.

    Args:
        cfg: The run configuration (``trainer``, ``engine``, ``optimizer``, ``scheduler``, ``data.num_classes``).
        net: The network to train.
        datamodule: Its data (a :class:`~ddcnn.data.datamodule.Batches`, e.g. ``PreparedBatches``).
        folder: The stage folder (``last.ckpt``, ``logs/metrics.csv``).
        device: Where it trains (with ``engine.num_devices > 1``: the first of the DDP devices).
        seed: Seeds weights-independent randomness (dropout; the batches follow ``datamodule.seed``).
        start: ``time.perf_counter()`` at the start of the stage in this process.
        max_epochs: Overrides ``trainer.max_epochs``.
        optimizer_cfg: Overrides ``cfg.optimizer``.
        after_epoch: ``(epoch, row, net) -> metrics | None`` after each epoch, outside the training clock (the
            plain loop: :func:`ddcnn.engine.tensor_fit.fit_tensors`); the Lightning loop does not call it.

    Returns:
        The network with its best weights and the stage's training time over all processes that worked on it.
    """
    folder = Path(folder)
    loop, why = choose_loop(cfg, folder)
    epochs = int(max_epochs if max_epochs is not None else cfg.trainer.max_epochs)
    log.debug("%s: %s loop (%s)", stage_name(folder), loop, why)
    if loop == "lightning":
        from ddcnn.engine.fit import fit_lightning

        return fit_lightning(cfg, net, datamodule, folder, device, seed, start, epochs, optimizer_cfg)
    seed_everything(seed)
    return _fit_plain(cfg, net, datamodule, folder, device, start, epochs, optimizer_cfg, after_epoch)
