"""What the stage modules share: skip/force, the finishing of a stage, seeds, and full-image training.

Every stage is a function ``run(ctx, device, ...) -> meta`` that reads only finished artifacts of earlier stages
from the run directory and writes its own atomically (see :mod:`ddcnn.rundir`): ``probs_{train,val,test}.pt``,
``net.pt``, ``meta.json`` and the ``done`` marker last. A stage whose ``done`` marker exists is skipped unless
``force=true``; one that was interrupted resumes from its ``last.ckpt``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddcnn import registry
from ddcnn.context import Context, build_augment, count_parameters, subdomain_seed, weights_meta
from ddcnn.data.datamodule import Batches, PreparedBatches
from ddcnn.engine.common import data_splits, predict_logits, save_net, save_predictions
from ddcnn.engine.convergence import convergence_advice
from ddcnn.engine.train import FitResult, fit
from ddcnn.io import atomic_torch_save
from ddcnn.rundir import PROB_FILES, TARGET_SPLIT
from ddcnn.runtime import execution_context, run_generation, slurm_info

log = logging.getLogger(__name__)

__all__ = [
    "skip",
    "finish_stage",
    "logistic_convergence",
    "stage_seed",
    "method_epochs",
    "method_optimizer",
    "scaled_optimizer",
    "lr_advice_names",
    "full_image_data",
    "val_accuracy",
    "train_full_images",
    "curve_callbacks",
    "snapshot_epochs",
    "curve_epochs",
    "snapshot_train_rows",
    "TestCurve",
    "LocalSnapshots",
    "SNAPSHOT_DIR",
]

# Where a local net keeps the logits of its snapshot epochs (the CNN-DNN's accuracy-versus-time curve).
SNAPSHOT_DIR = "snapshots"


def stage_seed(ctx: Context, stage: str) -> int:
    """The seed of stage ``stage`` (its registry ``seed_offset``) in this run."""
    offset = registry.get(stage).seed_offset
    if offset is None:
        raise ValueError(f"stage {stage!r} has one seed per sub-domain: use subdomain_seed(seed, i).")
    return subdomain_seed(ctx.settings.seed, offset)


def skip(ctx: Context, stage: str, subdomain: int | None = None) -> dict | None:
    """The metadata of a finished stage (it is skipped), or ``None`` when it must train.

    With ``force=true`` a stage is cleared and trained again unless its ``done`` marker belongs to this run
    generation (:func:`ddcnn.runtime.run_generation`): another process of the same attempt (an ``srun`` peer, a
    second copy of the command, the final job of ``ddcnn-slurm``) already recomputed it. The caller holds the
    stage's lock, so the check and the clearing happen once per generation.
    """
    name = stage if subdomain is None else f"{stage} {subdomain}"
    force = ctx.settings.force
    if ctx.run.is_done(stage, subdomain):
        if not force:
            log.info("%s: finished earlier, skipped (force=true recomputes)", name)
            return ctx.run.meta(stage, subdomain)
        if ctx.run.done_generation(stage, subdomain) == run_generation(ctx.settings.run_generation):
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
    threads_by_design: str | None = None,
    **extra,
) -> dict:
    """Save a trained stage's predictions and weights, then its ``meta.json`` and the ``done`` marker last.

    ``time_s`` is the stage's whole cost: from the start of the stage (data in memory) through training, summed over
    every process that worked on it (carried across resumes in its checkpoint), to its saved predictions. Left out of
    it, for every method alike (:mod:`ddcnn.engine.loop`): process start-up and DDP's launch and rendezvous
    (``startup_s``), the device warm-up (``warmup_s``), per-epoch hooks and the progress/loggers. ``context`` says where
    it was measured (:func:`ddcnn.runtime.execution_context`; ``threads_by_design`` names the setting that chose this
    stage's CPU threads as part of the method, e.g. ``coarse.num_threads``); ``extra`` adds stage-specific keys.

    ``converged`` and ``convergence`` (docs/protocol.md, "Convergence") come from the loop's record of the training
    (:func:`ddcnn.engine.convergence.convergence`), or from ``extra["convergence"]`` for a fit the loop did not run (the
    stacker's L-BFGS); an unconverged training is logged with what to try (``extra["advice_names"]``: the settings to
    name, :func:`ddcnn.engine.convergence.convergence_advice`).
    """
    record = extra.pop("convergence", None) or result.convergence
    names = extra.pop("advice_names", None)
    if record is None:  # a result that did not come from the loop and says nothing of its fit
        record = {"converged": False, "reasons": ["no record of how the fit ended"], "cause": None, "epochs": 0}
        record["min_epochs"] = 0
        record |= {"stopped_by": None, "lr_ratio": None, "train_loss_change_last3": None}
    name = stage if subdomain is None else f"{stage} {subdomain}"
    if not record["converged"]:
        # the cause and its one fix, kept in the record: results.md's flag prints it (the report reads no engine code)
        record = {**record, "advice": convergence_advice(record, names)}
        log.warning("%s: not converged (%s); try %s", name, "; ".join(record["reasons"]), record["advice"])
    folder = ctx.run.stage_dir(stage, subdomain)
    predict_start = time.perf_counter()
    accuracy = save_predictions(net, dm, folder, device)
    save_net(net, folder)
    meta = {
        "stage": stage,
        **({"subdomain": subdomain} if subdomain is not None else {}),
        "seed": seed,
        "time_s": result.fit_time_s + (time.perf_counter() - predict_start),
        "fit_time_s": result.fit_time_s,
        "time_s_earlier_processes": result.previous_time_s,
        "startup_s": result.startup_s,
        "warmup_s": result.warmup_s,
        "resumed_from_epoch": result.resumed_from_epoch,
        "best_epoch": result.best_epoch,
        # early stopping (engine.patience / coarse.patience) ended the training after this epoch (0-based)
        **({"stopped_epoch": result.stopped_epoch} if result.stopped_epoch is not None else {}),
        # whether the training converged, and why not (docs/protocol.md, "Convergence")
        "converged": bool(record["converged"]),
        "convergence": record,
        "accuracy": accuracy,
        "params": count_parameters(net),
        "device": str(device or "cpu"),
        "loop": "fabric",
        "precision": result.precision,
        # The GPU policy it trained under (bench/gpu_check.py reads these names) and its peak GPU memory.
        **({"engine": result.engine} if result.engine else {}),
        "gpu_peak_memory_bytes": result.gpu_peak_memory_bytes,
        **({"compile_time_s": result.compile_time_s} if result.compile_time_s is not None else {}),
        **({"restarts": result.restarts} if result.restarts else {}),
        **({"num_devices": num_devices} if num_devices > 1 else {}),
        "context": execution_context(device, num_devices, threads_by_design=threads_by_design),
        "slurm": slurm_info(),
        "data": ctx.data.describe(),
        **weights_meta(net),  # the pretrained weights file it started from (model.weights), if any
        **extra,
    }
    meta["generation"] = run_generation(ctx.settings.run_generation)
    ctx.run.mark_done(stage, subdomain, meta, required=(*PROB_FILES, "net.pt"), generation=meta["generation"])
    return meta


def logistic_convergence(path: list[dict], l2: float, max_iter: int) -> dict:
    """The convergence record (:func:`ddcnn.engine.convergence.convergence`'s keys) of a convex fit
    (:func:`ddcnn.engine.convex.fit_logistic`): that of the selected L2 strength's L-BFGS solve. Converged when the
    solver stopped by its own criteria: its gradient tolerance (``stopped_by`` ``tolerance``) or no further change of
    the objective or the weights before ``max_iter`` function evaluations (``no_change``); not converged when its
    iteration cap ended it with the gradient above tolerance (``max_iter``). ``epochs`` counts its function
    evaluations."""
    solve = next(entry for entry in path if entry["l2"] == l2)
    evaluations = int(solve["iterations"])
    stopped_by = "tolerance" if solve["converged"] else "no_change" if evaluations < int(max_iter) else "max_iter"
    reasons = [] if stopped_by != "max_iter" else [f"L-BFGS hit its iteration cap ({max_iter}) at L2 {l2:g}"]
    return {
        "converged": not reasons,
        "reasons": reasons,
        "cause": "max_iter" if reasons else None,
        "epochs": evaluations,
        "min_epochs": 0,
        "stopped_by": stopped_by,
        "lr_ratio": None,
        "train_loss_change_last3": None,
    }


# --- the optional methods' settings (methods.<stage>.*, checked in ddcnn.settings) -------------------
def method_epochs(ctx: Context, stage: str) -> int:
    """``methods.<stage>.max_epochs`` of a method that trains on full images, or ``trainer.max_epochs`` when null."""
    value = ctx.settings.methods.settings_of(stage).max_epochs
    return ctx.settings.loop.max_epochs if value is None else value


def method_optimizer(ctx: Context, stage: str) -> dict:
    """The run's ``optimizer`` with its learning rate scaled by ``methods.<stage>.lr_scale`` (fine-tuning wants
    less)."""
    return scaled_optimizer(ctx, ctx.settings.methods.settings_of(stage).lr_scale)


def scaled_optimizer(ctx: Context, scale: float) -> dict:
    """The run's ``optimizer`` with its learning rate times ``scale``."""
    opt = dict(ctx.settings.loop.optimizer)
    if "lr" in opt:
        opt["lr"] = float(opt["lr"]) * scale
    return opt


def lr_advice_names(ctx: Context, setting: str, scale: float) -> dict:
    """What a training at ``optimizer.lr`` times ``scale`` (the setting ``setting``) names when its advice is a lower
    learning rate: ``setting`` with the new factor where the scale is in use (``optimizer.lr`` would move every other
    training too, and by the wrong amount), nothing at 1 (``optimizer.lr`` then)."""
    lr = ctx.settings.loop.optimizer.get("lr")
    return {"lr": setting, "lr_base": float(lr)} if scale != 1.0 and lr else {}


def full_image_data(ctx: Context, seed: int, batch: int | None = None) -> PreparedBatches:
    """The global CNN's batches: full images, the configured augmentation, batches fixed by the seed."""
    size = ctx.settings.data.batch_size if batch is None else batch
    return PreparedBatches(ctx.data, size, seed=seed, augment=build_augment(ctx.settings))


def val_accuracy(net: nn.Module, dm: Batches, device) -> float:
    logits, labels = predict_logits(net, dm, "val", device)
    return float((logits.argmax(-1) == labels).float().mean())


# --- accuracy-versus-time curves ---------------------------------------------------------------------
def snapshot_epochs(max_epochs: int, points: int) -> list[int]:
    """The epochs (1-based) at which a training's curve is sampled: about ``points`` epochs spread geometrically from
    the first to the last (every epoch when there are no more than ``points``); the last is always one."""
    if points <= 0 or max_epochs < 1:
        return []
    if max_epochs <= points:
        return list(range(1, max_epochs + 1))
    if points == 1:
        return [max_epochs]
    return sorted({max(1, round(max_epochs ** (i / (points - 1)))) for i in range(points)} | {max_epochs})


def curve_epochs(curves, max_epochs: int) -> tuple[list[int], list[int]]:
    """The epochs of a training's curve points and, among them, those that evaluate the test split
    (``report.curves``, :class:`~ddcnn.settings.run.CurveSettings`): both :func:`snapshot_epochs` at ``points``, or
    with ``points: all`` every epoch and the test split at ``test_points`` of them."""
    test = snapshot_epochs(max_epochs, curves.test_points)
    return (list(range(1, max_epochs + 1)) if curves.every_epoch else test), test


def snapshot_train_rows(n_train: int, max_rows: int, seed: int) -> torch.Tensor:
    """The training rows whose local outputs a snapshot keeps: all, or a fixed random subset of ``max_rows`` (the
    same in every local net: it depends on the data's size and split seed only), sorted."""
    if not max_rows or n_train <= max_rows:
        return torch.arange(n_train)
    return torch.randperm(n_train, generator=torch.Generator().manual_seed(int(seed)))[:max_rows].sort().values


@torch.no_grad()
def _logits(net: nn.Module, dm: Batches, split: str, idx: torch.Tensor, device) -> torch.Tensor:
    device = torch.device(device) if device is not None else torch.device("cpu")
    # The inputs in the network's dtype: a curve point of a trainer.precision=64-true training sees it in float64.
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.float32)
    out = []
    for chunk in idx.split(dm.eval_batch_size):
        x = dm.eval_batch(split, chunk, device)[0]
        out.append(net(x.to(dtype) if x.is_floating_point() else x).float().cpu())
    return torch.cat(out)


class TestCurve:
    """An ``after_epoch`` hook: the test accuracy and cross-entropy at the snapshot epochs (columns ``test_acc``,
    ``test_loss`` of ``logs/metrics.csv``); its time is not training time."""

    def __init__(self, dm: Batches, device, epochs: list[int]) -> None:
        self.dm, self.device, self.epochs = dm, device, set(epochs)

    def _test(self, net: nn.Module) -> tuple[torch.Tensor, dict[str, float]]:
        labels = self.dm.labels("test")
        logits = _logits(net, self.dm, "test", torch.arange(len(labels)), self.device)
        metrics = {
            "test_acc": float((logits.argmax(-1) == labels).float().mean()),
            "test_loss": float(F.cross_entropy(logits, labels)),
        }
        return logits, metrics

    def on_validation_end(self, epoch: int, row: dict, net: nn.Module) -> dict | None:
        if epoch + 1 not in self.epochs:
            return None
        return self._test(net)[1]


class LocalSnapshots(TestCurve):
    """:class:`TestCurve` that also keeps a local net's logits at each snapshot epoch (``snapshots/epoch_<e>.pt``:
    the training rows of :func:`snapshot_train_rows`, the validation and target splits and, at the ``test_epochs``
    among them (default: all), the test split, in float16, and the training clock): the coarse stage fits a coarse
    DNN on each to draw the CNN-DNN's curve."""

    def __init__(
        self,
        dm: Batches,
        device,
        epochs: list[int],
        folder: Path,
        train_rows: torch.Tensor,
        test_epochs: list[int] | None = None,
    ):
        super().__init__(dm, device, epochs if test_epochs is None else test_epochs)
        self.snapshot_epochs = set(epochs)
        self.folder, self.train_rows = Path(folder) / SNAPSHOT_DIR, train_rows

    def on_validation_end(self, epoch: int, row: dict, net: nn.Module) -> dict | None:
        if epoch + 1 not in self.snapshot_epochs:
            return None
        test, metrics = self._test(net) if epoch + 1 in self.epochs else (None, None)
        logits = {
            "train": _logits(net, self.dm, "train", self.train_rows, self.device),
            "val": _logits(net, self.dm, "val", torch.arange(self.dm.size("val")), self.device),
            **({"test": test} if test is not None else {}),
        }
        if TARGET_SPLIT in data_splits(self.dm):
            logits[TARGET_SPLIT] = _logits(
                net, self.dm, TARGET_SPLIT, torch.arange(self.dm.size(TARGET_SPLIT)), self.device
            )
        snapshot = {
            "epoch": epoch + 1,
            "time_s": float(row["time_s"]),
            "train_rows": self.train_rows,
            "logits": {split: v.half() for split, v in logits.items()},
        }
        atomic_torch_save(snapshot, self.folder / f"epoch_{epoch + 1:04d}.pt")
        return metrics


def curve_callbacks(ctx: Context, dm: Batches, device, max_epochs: int) -> list[TestCurve]:
    """The loop callbacks of a full-image training's accuracy-versus-time curve (none where curves are off)."""
    curves = ctx.settings.report.curves
    return [TestCurve(dm, device, curve_epochs(curves, max_epochs)[1])] if curves.enabled else []


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
    epochs = method_epochs(ctx, stage)
    callbacks = curve_callbacks(ctx, dm, device, epochs)
    optimizer = method_optimizer(ctx, stage)
    result = fit(
        ctx.settings,
        net,
        dm,
        folder,
        start,
        callbacks,
        seed=seed,
        device=device,
        max_epochs=epochs,
        optimizer=optimizer,
    )
    extra = {"max_epochs": epochs, **extra}
    names = lr_advice_names(ctx, f"methods.{stage}.lr_scale", ctx.settings.methods.settings_of(stage).lr_scale)
    if names:
        extra["advice_names"] = names
    if before is not None:
        extra["start_accuracy"] = {"val": before}
    meta = finish_stage(ctx, stage, result.net, dm, device, seed, result, **extra)
    log.info("%s: test acc %.4f in %.1f s", stage, meta["accuracy"]["test"], meta["time_s"])
    return meta
