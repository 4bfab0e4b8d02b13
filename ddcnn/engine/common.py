"""What both training loops share (:mod:`ddcnn.engine.train`'s plain loop and :mod:`ddcnn.engine.fit`'s Lightning):
the result of a training, the ``engine`` settings, the extra loggers, prediction and the saved network. No Lightning.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig
from torch import nn

from ddcnn.io import atomic_torch_save
from ddcnn.rundir import SPLITS

__all__ = [
    "LOOPS",
    "FitResult",
    "engine_settings",
    "stage_name",
    "build_loggers",
    "predict_logits",
    "save_predictions",
    "save_net",
]

LOOPS = ("auto", "plain", "lightning")


@dataclass
class FitResult:
    """What :func:`ddcnn.engine.train.fit` returns.

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
