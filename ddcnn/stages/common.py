"""What the stage modules share: skip/force, the finishing of a stage, seeds, and full-image training.

Every stage is a function ``run(ctx, device, ...) -> meta`` that reads only finished artifacts of earlier stages
from the run directory and writes its own atomically (see :mod:`ddcnn.rundir`): ``probs_{train,val,test}.pt``,
``net.pt``, ``meta.json`` and the ``done`` marker last. A stage whose ``done`` marker exists is skipped unless
``force=true``; one that was interrupted resumes from its ``last.ckpt``.
"""

from __future__ import annotations

import logging
import time

from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddcnn import registry
from ddcnn.context import Context, build_augment, count_parameters, subdomain_seed
from ddcnn.data.datamodule import Batches, PreparedBatches
from ddcnn.engine.train import FitResult, fit, predict_logits, save_net, save_predictions
from ddcnn.rundir import PROB_FILES
from ddcnn.runtime import execution_context, run_generation, slurm_info

log = logging.getLogger(__name__)

__all__ = [
    "skip",
    "finish_stage",
    "stage_seed",
    "batch_size",
    "method_settings",
    "method_epochs",
    "method_optimizer",
    "full_image_data",
    "val_accuracy",
    "train_full_images",
]


def stage_seed(ctx: Context, stage: str) -> int:
    """The seed of stage ``stage`` (its registry ``seed_offset``) in this run."""
    offset = registry.get(stage).seed_offset
    if offset is None:
        raise ValueError(f"stage {stage!r} has one seed per sub-domain: use subdomain_seed(seed, i).")
    return subdomain_seed(ctx.cfg.seed, offset)


def batch_size(cfg: DictConfig) -> int:
    return int(cfg.data.batch_size)


def skip(ctx: Context, stage: str, subdomain: int | None = None) -> dict | None:
    """The metadata of a finished stage (it is skipped), or ``None`` when it must train.

    With ``force=true`` a stage is cleared and trained again unless its ``done`` marker belongs to this run
    generation (:func:`ddcnn.runtime.run_generation`): another process of the same attempt (an ``srun`` peer, a
    second copy of the command, the final job of ``ddcnn-slurm``) already recomputed it. The caller holds the
    stage's lock, so the check and the clearing happen once per generation.
    """
    name = stage if subdomain is None else f"local {subdomain}"
    force = bool(ctx.cfg.get("force", False))
    if ctx.run.is_done(stage, subdomain):
        if not force:
            log.info("%s: finished earlier, skipped (force=true recomputes)", name)
            return ctx.run.meta(stage, subdomain)
        if ctx.run.done_generation(stage, subdomain) == run_generation(ctx.cfg):
            log.info("%s: recomputed by another process of this run generation, skipped", name)
            return ctx.run.meta(stage, subdomain)
    if force:
        ctx.run.clear(stage, subdomain)
    return None


def finish_stage(
    ctx: Context,
    stage: str,
    net: nn.Module,
    dm: Batches,
    device,
    seed: int,
    result: FitResult,
    subdomain: int | None = None,
    num_devices: int = 1,
    **extra,
) -> dict:
    """Save a trained stage's predictions and weights, then its ``meta.json`` and the ``done`` marker last.

    ``time_s`` is the stage's whole cost: from the start of the stage (data in memory) through training, summed over
    every process that worked on it (carried across resumes in its checkpoint), to its saved predictions. Process
    start-up is not in it, for any method: DDP's spawned ranks record theirs as ``startup_s``. ``context`` says
    where it was measured (:func:`ddcnn.runtime.execution_context`); ``extra`` adds stage-specific keys.
    """
    folder = ctx.run.stage_dir(stage, subdomain)
    predict_start = time.perf_counter()
    accuracy = save_predictions(net, dm, folder, device)
    save_net(net, folder)
    meta = {
        "stage": stage,
        **({"subdomain": subdomain} if subdomain is not None else {}),
        "seed": seed,
        "time_s": result.time_s + (time.perf_counter() - predict_start),
        "fit_time_s": result.time_s,
        "time_s_earlier_processes": result.earlier_s,
        "startup_s": result.startup_s,
        "resumed_from_epoch": result.resumed_from_epoch,
        "best_epoch": result.best_epoch,
        "accuracy": accuracy,
        "params": count_parameters(net),
        "device": str(device or "cpu"),
        "loop": result.loop,
        **({"num_devices": num_devices} if num_devices > 1 else {}),
        "context": execution_context(device, num_devices),
        "slurm": slurm_info(),
        "data": ctx.data.describe(),
        **extra,
    }
    meta["generation"] = run_generation(ctx.cfg)
    ctx.run.mark_done(stage, subdomain, meta, required=(*PROB_FILES, "net.pt"), generation=meta["generation"])
    return meta


# --- the optional methods' settings (methods.<stage>.*) ----------------------------------------------
def method_settings(cfg: DictConfig, stage: str) -> DictConfig:
    methods = cfg.get("methods") or {}
    return methods.get(stage) or OmegaConf.create({})


def method_epochs(cfg: DictConfig, stage: str) -> int:
    value = method_settings(cfg, stage).get("max_epochs")
    value = cfg.trainer.max_epochs if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"methods.{stage}.max_epochs must be a positive whole number, got {value!r}.")
    return int(value)


def method_optimizer(cfg: DictConfig, stage: str) -> DictConfig:
    """``cfg.optimizer`` with its learning rate scaled by ``methods.<stage>.lr_scale`` (fine-tuning wants less)."""
    scale = method_settings(cfg, stage).get("lr_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or scale <= 0:
        raise ValueError(f"methods.{stage}.lr_scale must be a positive number, got {scale!r}.")
    opt = OmegaConf.to_container(cfg.optimizer, resolve=True)
    if "lr" in opt:
        opt["lr"] = float(opt["lr"]) * float(scale)
    return OmegaConf.create(opt)


def full_image_data(ctx: Context, seed: int, batch: int | None = None) -> PreparedBatches:
    """The global CNN's batches: full images, the configured augmentation, batches fixed by the seed."""
    size = batch_size(ctx.cfg) if batch is None else batch
    return PreparedBatches(ctx.data, size, seed=seed, augment=build_augment(ctx.cfg))


def val_accuracy(net: nn.Module, dm: Batches, device) -> float:
    logits, labels = predict_logits(net, dm.loader("val"), device)
    return float((logits.argmax(-1) == labels).float().mean())


def train_full_images(
    ctx: Context, stage: str, net: nn.Module, start: float, device, extra: dict, measure_start: bool = False
) -> dict:
    """Train ``net`` on full images into the stage folder, save its predictions and mark the stage done.

    ``measure_start`` records the validation accuracy of the starting point (``start_accuracy``) in the metadata.
    """
    folder = ctx.run.stage_dir(stage)
    seed = stage_seed(ctx, stage)
    dm = full_image_data(ctx, seed)
    before = val_accuracy(net, dm, device) if measure_start else None
    net.train()
    epochs = method_epochs(ctx.cfg, stage)
    result = fit(ctx.cfg, net, dm, folder, device, seed, start, epochs, method_optimizer(ctx.cfg, stage))
    extra = {"max_epochs": epochs, **extra}
    if before is not None:
        extra["start_accuracy"] = {"val": before}
    meta = finish_stage(ctx, stage, result.net, dm, device, seed, result, **extra)
    log.info("%s: test acc %.4f in %.1f s", stage, meta["accuracy"]["test"], meta["time_s"])
    return meta
