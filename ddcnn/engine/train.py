"""How every stage trains a network: ddcnn's own loop on one device, Lightning for DDP (and on request).

:func:`fit` is what the stages call. ``engine.loop`` picks the loop:

- ``plain``: :func:`ddcnn.engine.tensor_fit.fit_tensors`, a PyTorch loop over the in-memory tensors of a
  :class:`~ddcnn.data.datamodule.TensorDataModule` (the same batches, augmentation, selection on validation,
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
import inspect
import logging
import os
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import hydra
import numpy as np
import torch

# The first optimizer a process builds imports torch._dynamo (torch.optim wraps its methods in torch._disable_dynamo):
# about 3 s of CPU on the development machine. Imported with the engine, it is process start-up, outside the time of
# whichever stage happens to build the first optimizer (the first local net), as the timing rule says.
import torch._dynamo  # noqa: F401
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddcnn.engine.tensor_fit import CHECKPOINT_FORMAT, fit_tensors
from ddcnn.io import atomic_torch_save
from ddcnn.rundir import SPLITS

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

LOOPS = ("auto", "plain", "lightning")
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


@dataclass
class FitResult:
    """What :func:`fit` returns.

    Attributes:
        net: The network with the selected (best on validation) weights.
        time_s: Training time of every process that worked on this stage, this one included (seconds from the
            stage's start to the end of ``fit``; an earlier process counts up to its last checkpoint).
        earlier_s: The part of ``time_s`` spent by earlier processes (0 when nothing was resumed).
        resumed_from_epoch: The epoch of the checkpoint this process resumed from, or ``None``.
        best_epoch: The epoch whose weights were selected.
        startup_s: Process start-up the training paid outside ``time_s`` (DDP: spawning the ranks), 0 otherwise.
        global_rank: This process's rank in the training (0 unless DDP across the tasks of an ``srun`` step).
        world_size: The processes that trained it together (DDP), 1 otherwise.
        loop: The loop that trained it (``plain`` or ``lightning``).
    """

    net: nn.Module
    time_s: float
    earlier_s: float
    resumed_from_epoch: int | None
    best_epoch: int | None
    startup_s: float = 0.0
    global_rank: int = 0
    world_size: int = 1
    loop: str = "plain"


# --- settings ------------------------------------------------------------------------------------
def engine_settings(cfg: DictConfig) -> dict:
    """``cfg.engine`` with defaults: loop, monitor, monitor_mode, num_devices, checkpoint_every_s, ddp_launcher."""
    node = cfg.get("engine") or {}
    out = {
        "loop": str(node.get("loop", "auto") or "auto"),
        "monitor": str(node.get("monitor", "val_acc")),
        "monitor_mode": str(node.get("monitor_mode", "max")),
        "num_devices": int(node.get("num_devices", 1) or 1),
        "checkpoint_every_s": float(node.get("checkpoint_every_s", 0.0) or 0.0),
        "ddp_launcher": str(node.get("ddp_launcher", "spawn") or "spawn"),
    }
    if out["loop"] not in LOOPS:
        raise ValueError(f"engine.loop must be one of {', '.join(LOOPS)}, got {out['loop']!r}.")
    if out["ddp_launcher"] not in ("spawn", "slurm"):
        raise ValueError(f"engine.ddp_launcher must be 'spawn' or 'slurm', got {out['ddp_launcher']!r}.")
    if out["monitor_mode"] not in ("max", "min"):
        raise ValueError(f"engine.monitor_mode must be 'max' or 'min', got {out['monitor_mode']!r}.")
    if out["monitor"] not in ("val_acc", "val_loss", "train_acc", "train_loss"):
        raise ValueError(
            f"engine.monitor must be one of val_acc, val_loss, train_acc, train_loss, got {out['monitor']!r}."
        )
    if out["checkpoint_every_s"] < 0:
        raise ValueError(
            f"engine.checkpoint_every_s must be >= 0 (0: after every epoch), got {out['checkpoint_every_s']}."
        )
    return out


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


def stage_name(folder: Path) -> str:
    """``local 3`` for ``.../local/03``, else the folder's name (the stage)."""
    folder = Path(folder)
    return f"local {int(folder.name)}" if folder.parent.name == "local" and folder.name.isdigit() else folder.name


def build_loggers(cfg: DictConfig, folder: Path) -> list:
    """The loggers of the ``logger`` config group besides the CSV log (which is always written: the training-curve
    plots read it), each given this stage's folder (``save_dir``) and name (``run_name``) where it takes them."""
    out = []
    for name, spec in (cfg.get("logger") or {}).items():
        if not spec or "_target_" not in spec:
            continue  # logger=csv: the CSV log alone
        try:
            factory = hydra.utils.instantiate(spec)
            keywords = getattr(factory, "keywords", {})
            params = inspect.signature(getattr(factory, "func", factory)).parameters
            kwargs = {}
            if "save_dir" in params and "save_dir" not in keywords:
                kwargs["save_dir"] = str(folder)
            if "run_name" in params and "run_name" not in keywords:
                kwargs["run_name"] = stage_name(folder)
            out.append(factory(**kwargs))
        except Exception as err:
            raise ValueError(
                f"cannot create logger {name!r} ({spec.get('_target_')}): {err}. Install what it needs (pip install "
                f"tensorboard, or mlflow-skinny for logger=mlflow) or choose another: logger=csv|tensorboard|mlflow."
            ) from err
    return out


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
        first_epoch: The epoch it starts at (after a resume).
    """

    def __init__(self, cfg: DictConfig, folder: Path, max_epochs: int, first_epoch: int = 0) -> None:
        self.name, self.max_epochs = stage_name(folder), int(max_epochs)
        self.loggers = build_loggers(cfg, folder)
        show = (cfg.get("trainer") or {}).get("enable_progress_bar")
        self.bar = None
        if (sys.stderr.isatty() if show is None else bool(show)) and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.max_epochs, initial=first_epoch, desc=self.name, unit="epoch", leave=False)

    def __call__(self, epoch: int, row: Mapping[str, float]) -> None:
        metrics = {k: float(v) for k, v in row.items() if k not in ("epoch", "step") and v is not None}
        for logger in self.loggers:
            logger.log_metrics({**metrics, "epoch": float(epoch)}, step=int(epoch))
        shown = {k: v for k, v in sorted(metrics.items()) if k.startswith(("train_", "val_"))}
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4f}" for k, v in shown.items()}, refresh=False)
            self.bar.update(1)
        else:
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


def _compose(augment: Callable | None, view: Callable | None) -> Callable | None:
    if augment is None and view is None:
        return None

    def transform(x: torch.Tensor, idx: torch.Tensor, epoch: int) -> torch.Tensor:
        if augment is not None:
            x = augment(x, idx, epoch)
        return view(x) if view is not None else x

    return transform


def _fit_plain(cfg, net, datamodule, folder: Path, device, start: float, epochs: int, optimizer_cfg) -> FitResult:
    settings = engine_settings(cfg)
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    data = datamodule.data
    x = {s: data[s].x for s in ("train", "val")}
    y = {s: data[s].y for s in ("train", "val")}
    last = folder / "last.ckpt"
    first_epoch = 0
    if last.is_file():
        first_epoch = int(torch.load(last, map_location="cpu", weights_only=False).get("epoch", -1)) + 1
    reporter = EpochReporter(cfg, folder, epochs, first_epoch)
    status = "failed"
    try:
        with _deterministic(bool(trainer.get("deterministic"))):
            fitted = fit_tensors(
                net,
                x,
                y,
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
                transform=_compose(datamodule.augment, datamodule.view),
                val_view=datamodule.view,
                keep_on_host=True,
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
) -> FitResult:
    """Train ``net`` on ``datamodule`` into ``folder``, resuming from ``folder/last.ckpt``; see the module doc.

    Args:
        cfg: The run configuration (``trainer``, ``engine``, ``optimizer``, ``scheduler``, ``data.num_classes``).
        net: The network to train.
        datamodule: Its data (:class:`~ddcnn.data.datamodule.TensorDataModule`).
        folder: The stage folder (``last.ckpt``, ``logs/metrics.csv``).
        device: Where it trains (with ``engine.num_devices > 1``: the first of the DDP devices).
        seed: Seeds weights-independent randomness (dropout; the batches follow ``datamodule.seed``).
        start: ``time.perf_counter()`` at the start of the stage in this process.
        max_epochs: Overrides ``trainer.max_epochs``.
        optimizer_cfg: Overrides ``cfg.optimizer``.

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
    return _fit_plain(cfg, net, datamodule, folder, device, start, epochs, optimizer_cfg)


# --- prediction and artifacts --------------------------------------------------------------------
@torch.inference_mode()
def predict_logits(net: nn.Module, loader, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels of every batch of ``loader`` (in order)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    net = net.to(device).eval()
    outs, labels = [], []
    for x, y in loader:
        outs.append(net(x.to(device)).float().cpu())
        labels.append(y)
    return torch.cat(outs), torch.cat(labels)


def save_predictions(net: nn.Module, datamodule, folder: Path, device) -> dict[str, float]:
    """``probs_<split>.pt`` (logits, probabilities, labels) of every split; returns the accuracy per split."""
    accuracy = {}
    for split in SPLITS:
        logits, labels = predict_logits(net, datamodule.loader(split), device)
        atomic_torch_save(
            {"logits": logits, "probs": logits.softmax(-1), "labels": labels}, folder / f"probs_{split}.pt"
        )
        accuracy[split] = float((logits.argmax(-1) == labels).float().mean())
    return accuracy


def save_net(net: nn.Module, folder: Path) -> None:
    """``net.pt``: the state dict of the selected weights, on CPU."""
    atomic_torch_save({k: v.detach().cpu() for k, v in net.state_dict().items()}, folder / "net.pt")
