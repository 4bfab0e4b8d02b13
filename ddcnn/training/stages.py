"""The stages of a CNN-DNN run that train: ``local``, ``coarse``, ``global``, and ``evaluate``.

Every stage is a function ``stage(cfg, run_dir, ...) -> dict`` that reads only finished artifacts of
earlier stages from the run directory and writes its own atomically (see :mod:`ddcnn.training.rundir`).
A stage whose ``done`` marker exists is skipped unless ``force=true``; one that was interrupted resumes
from its ``last.ckpt``. The CLI, the parallel workers, SLURM jobs, notebooks and tests call them alike.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import time
import warnings
from pathlib import Path

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from ddcnn.data.datamodule import SPLITS, TensorDataModule
from ddcnn.models.cnn_dnn import CNNDNN
from ddcnn.parallel.slurm import slurm_info, slurm_plugins
from ddcnn.training.checkpoint_io import AtomicCheckpointIO
from ddcnn.training.classifier import Classifier

# Re-exported: the context and network builders live in ddcnn.training.context (no Lightning import there).
from ddcnn.training.context import (  # noqa: F401
    Context,
    build_augment,
    build_coarse_net,
    build_context,
    build_global_net,
    build_local_net,
    check_networks,
    check_settings,
    count_parameters,
    ddp_devices,
    instantiate,
    load_data,
    subdomain_seed,
    tuple_or_int,
)
from ddcnn.training.rundir import ArtifactWriteError, RunDir, atomic_torch_save

log = logging.getLogger(__name__)

__all__ = [
    "Context",
    "build_context",
    "run_local",
    "run_coarse",
    "run_global",
    "run_evaluate",
    "subdomain_seed",
    "build_local_net",
    "build_global_net",
    "build_coarse_net",
    "predict_logits",
    "assemble_cnn_dnn",
]

PROB_FILES = tuple(f"probs_{s}.pt" for s in SPLITS)
# Seed offset of the global CNN (initial weights, shuffling); the local nets use their index, the coarse DNN -1.
GLOBAL_SEED = -2


class Crop:
    """Cuts one box out of a batch (a picklable function, so data modules survive ``ddp_spawn``)."""

    def __init__(self, box: tuple[slice, ...]) -> None:
        self.box = box

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.box]


# --- training ------------------------------------------------------------------------------------
def _device_kwargs(device: str | torch.device | None, num_devices: int = 1) -> dict:
    """Trainer arguments for one training on ``device``, or on ``num_devices`` devices from it with DDP.

    Several devices use ``ddp_spawn``: Lightning's plain ``ddp`` launcher re-runs the command line, which
    hangs under Hydra multirun. On CPU the processes talk over gloo.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if num_devices < 1:
        raise ValueError(f"trainer.num_devices must be >= 1, got {num_devices}.")
    if device.type == "cuda":
        first = device.index or 0
        kwargs = {"accelerator": "gpu", "devices": list(range(first, first + num_devices))}
    else:
        kwargs = {"accelerator": "cpu", "devices": num_devices}
    if num_devices > 1:
        # Our batch sampler shards itself by rank (see TensorDataModule), so Lightning must not replace it.
        kwargs.update(strategy="ddp_spawn", use_distributed_sampler=False)
    return kwargs


def _quiet_lightning() -> None:
    """Keep the console for what users read: progress bars, our one-line stage summaries, the results table."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Our logs/ folder shares the stage folder with the checkpoints on purpose.
    warnings.filterwarnings("ignore", message=r".*Checkpoint directory .* exists and is not empty.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")  # in-memory tensors need none
    warnings.filterwarnings("ignore", message=r".*smaller than the logging interval.*")
    # SLURM runs go through submitit or srun (ddcnn.parallel.slurm); an installed srun alone means nothing.
    warnings.filterwarnings("ignore", message=r".*The `srun` command is available on your system.*")
    # ddp_spawn's processes start fresh interpreters: they read filters from PYTHONWARNINGS (a message prefix each).
    current = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    ours = ["ignore:The `srun` command is available", "ignore:Checkpoint directory", "ignore:The number of training"]
    os.environ["PYTHONWARNINGS"] = ",".join(dict.fromkeys(current + ours))


def _trainer(cfg: DictConfig, folder: Path, device, max_epochs: int | None = None) -> tuple[L.Trainer, ModelCheckpoint]:
    _quiet_lightning()
    tcfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    monitor = tcfg.pop("monitor", "val_acc")
    mode = tcfg.pop("monitor_mode", "max")
    num_devices = int(tcfg.pop("num_devices", 1) or 1)
    tcfg.update(_device_kwargs(device, num_devices))
    if max_epochs is not None:
        tcfg["max_epochs"] = int(max_epochs)
    ckpt = ModelCheckpoint(
        dirpath=folder,
        filename="best",
        monitor=monitor,
        mode=mode,
        save_top_k=1,
        save_last=True,
        enable_version_counter=False,
    )
    # CSV always (logs/metrics.csv feeds the training-curve plots); TensorBoard (tb/) when it is installed.
    logger = [CSVLogger(save_dir=str(folder), name="logs", version="")]
    if importlib.util.find_spec("tensorboard") is not None:
        from lightning.pytorch.loggers import TensorBoardLogger

        logger.append(TensorBoardLogger(save_dir=str(folder), name="tb", version="", default_hp_metric=False))
    trainer = L.Trainer(
        default_root_dir=str(folder),
        callbacks=[ckpt],
        logger=logger,
        plugins=[AtomicCheckpointIO(), *slurm_plugins(num_devices)],
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **tcfg,
    )
    return trainer, ckpt


def _scheduler(cfg: DictConfig, stage_epochs: int):
    """The configured learning-rate schedule (a partial: ``optimizer -> LRScheduler``), or ``None``.

    A ``T_max: null`` (cosine annealing) becomes the epochs of the stage that trains: the local nets, the coarse DNN
    and the optional stages each anneal over their own ``max_epochs``.
    """
    node = cfg.get("scheduler")
    if not node:
        return None
    spec = OmegaConf.to_container(node, resolve=True)
    if "T_max" in spec and spec["T_max"] is None:
        spec["T_max"] = stage_epochs
    return hydra.utils.instantiate(spec)


def _fit(
    cfg: DictConfig,
    net: nn.Module,
    dm: TensorDataModule,
    folder: Path,
    device,
    seed: int,
    max_epochs: int | None = None,
    optimizer_cfg: DictConfig | None = None,
) -> nn.Module:
    """Train ``net`` with Lightning, resuming from ``folder/last.ckpt``; return it with the best weights."""
    L.seed_everything(seed, workers=True, verbose=False)
    opt_cfg = optimizer_cfg if optimizer_cfg is not None else cfg.optimizer
    optimizer = hydra.utils.instantiate(opt_cfg)
    scheduler = _scheduler(cfg, int(max_epochs if max_epochs is not None else cfg.trainer.max_epochs))
    module = Classifier(net, num_classes=int(cfg.data.num_classes), optimizer=optimizer, scheduler=scheduler)
    trainer, ckpt = _trainer(cfg, folder, device, max_epochs)
    last = folder / "last.ckpt"
    if last.is_file():
        resumed = torch.load(last, map_location="cpu", weights_only=False).get("epoch")
        log.info("%s: resuming from %s (after epoch %s)", folder, last, resumed)
        (folder / "resumed_from_epoch").write_text(f"{resumed}\n")
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=str(last) if last.is_file() else None)
    except OSError as err:
        if isinstance(err, ArtifactWriteError):
            raise
        raise ArtifactWriteError(
            err.errno,
            f"training in {folder} stopped: {err}. Free disk space or choose a writable run directory, then "
            f"run the same command again: it resumes from the last checkpoint.",
        ) from err
    best = Path(ckpt.best_model_path) if ckpt.best_model_path else folder / "best.ckpt"
    if best.is_file():
        state = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
        module.load_state_dict(state)
    return module.net


def _resumed_from(folder: Path) -> int | None:
    """The epoch a stage resumed after, if any process had to resume it (recorded by :func:`_fit`)."""
    marker = folder / "resumed_from_epoch"
    return int(marker.read_text()) if marker.is_file() else None


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


def _save_predictions(net: nn.Module, dm: TensorDataModule, folder: Path, device) -> dict[str, float]:
    accuracy = {}
    for split in SPLITS:
        logits, labels = predict_logits(net, dm.loader(split), device)
        atomic_torch_save(
            {"logits": logits, "probs": logits.softmax(-1), "labels": labels}, folder / f"probs_{split}.pt"
        )
        accuracy[split] = float((logits.argmax(-1) == labels).float().mean())
    return accuracy


def _save_net(net: nn.Module, folder: Path) -> None:
    atomic_torch_save(net.cpu().state_dict(), folder / "net.pt")


def finish_stage(
    ctx: Context,
    stage: str,
    net: nn.Module,
    dm: TensorDataModule,
    device,
    seed: int,
    start: float,
    fit_time: float,
    subdomain: int | None = None,
    **extra,
) -> dict:
    """Save a trained stage's predictions and weights, then its ``meta.json`` and the ``done`` marker last.

    ``time_s`` runs from ``start`` to the end of the predictions (the stage's whole cost); ``extra`` adds
    stage-specific keys to the metadata.
    """
    folder = ctx.run.stage_dir(stage, subdomain)
    accuracy = _save_predictions(net, dm, folder, device)
    _save_net(net, folder)
    meta = {
        "stage": stage,
        **({"subdomain": subdomain} if subdomain is not None else {}),
        "seed": seed,
        "time_s": time.perf_counter() - start,
        "fit_time_s": fit_time,
        "accuracy": accuracy,
        "params": count_parameters(net),
        "device": str(device or "cpu"),
        **extra,
    }
    ctx.run.mark_done(stage, subdomain, meta, required=(*PROB_FILES, "net.pt"))
    return meta


def _skip(ctx: Context, stage: str, subdomain: int | None = None) -> dict | None:
    if ctx.run.is_done(stage, subdomain) and not ctx.cfg.get("force", False):
        name = stage if subdomain is None else f"local {subdomain}"
        log.info("%s: finished earlier, skipped (force=true recomputes)", name)
        return ctx.run.meta(stage, subdomain)
    if ctx.cfg.get("force", False):
        ctx.run.clear(stage, subdomain)
    return None


def _batch_size(cfg: DictConfig) -> int:
    return int(cfg.data.batch_size)


def run_local(ctx: Context, subdomain: int, device=None) -> dict:
    """Train local net ``subdomain`` on its sub-images only, then save its class probabilities."""
    if not 0 <= subdomain < ctx.decomposition.num_subdomains:
        raise ValueError(
            f"subdomain={subdomain} does not exist: the {ctx.decomposition.describe()} has sub-domains "
            f"0..{ctx.decomposition.num_subdomains - 1}."
        )
    if (done := _skip(ctx, "local", subdomain)) is not None:
        return done
    folder = ctx.run.make_stage_dir("local", subdomain)
    seed = subdomain_seed(ctx.cfg.seed, subdomain)
    dec = ctx.decomposition
    box = (slice(None), slice(None), *dec.box(subdomain))
    augment = build_augment(ctx.cfg)
    if augment is None:
        # Cut the sub-images once: every epoch then reads contiguous memory, as a hand-written loop would.
        x_sub = {split: x[box].contiguous() for split, x in ctx.data.x.items()}
        dm = TensorDataModule(x_sub, ctx.data.y, _batch_size(ctx.cfg), seed=seed)
    else:  # augment the whole image, then cut: every local net sees the same augmented image
        dm = TensorDataModule(ctx.data.x, ctx.data.y, _batch_size(ctx.cfg), seed=seed, view=Crop(box), augment=augment)
    start = time.perf_counter()
    L.seed_everything(seed, workers=True, verbose=False)
    net = build_local_net(ctx.cfg, ctx.data)
    net = _fit(ctx.cfg, net, dm, folder, device, seed)
    fit_time = time.perf_counter() - start
    meta = finish_stage(
        ctx,
        "local",
        net,
        dm,
        device,
        seed,
        start,
        fit_time,
        subdomain,
        position=list(dec.position(subdomain)),
        box=[[s.start, s.stop] for s in dec.box(subdomain)],
        n_train=len(ctx.data.y["train"]),
        resumed_from_epoch=_resumed_from(folder),
        slurm=slurm_info(),
    )
    log.info("local %d: test acc %.4f in %.1f s", subdomain, meta["accuracy"]["test"], meta["time_s"])
    return meta


def local_features(
    run: RunDir, num_subdomains: int, split: str, kind: str = "probs"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated local outputs ``(n, N, K)`` of one split and their labels, checked for consistency."""
    if kind not in ("probs", "logits"):
        raise ValueError(f"coarse.input must be 'probs' or 'logits', got {kind!r}.")
    missing = run.missing_local(num_subdomains)
    if missing:
        raise FileNotFoundError(
            f"local nets {missing} have not finished in {run.root}; run the local stage for them first "
            f"(stage=local, or stage=all which skips the finished ones)."
        )
    feats, labels = [], None
    for i in range(num_subdomains):
        saved = run.load_probs("local", split, i)
        if labels is None:
            labels = saved["labels"]
        elif saved["labels"].shape != labels.shape or not torch.equal(saved["labels"], labels):
            raise ValueError(
                f"saved {split} predictions of local net {i} in {run.stage_dir('local', i)} are for other samples than "
                f"those of local net 0 (labels differ); the local stage ran with other data settings. Rerun it with "
                f"force=true."
            )
        if feats and saved[kind].shape != feats[0].shape:
            raise ValueError(
                f"saved {split} predictions of local net {i} have shape {tuple(saved[kind].shape)}, local net 0 "
                f"{tuple(feats[0].shape)}; rerun the local stage with force=true."
            )
        feats.append(saved[kind])
    return torch.stack(feats, dim=1), labels


def run_coarse(ctx: Context, device=None, stage: str = "coarse", kind: str | None = None) -> dict:
    """Train the coarse DNN on the saved local probabilities (train split), selecting on val.

    ``stage`` and ``kind`` (default ``coarse.input``) let a second coarse DNN train on the other input into its own
    stage folder (``coarse_alt``, :mod:`ddcnn.training.methods`) by exactly the same procedure and seed.
    """
    if (done := _skip(ctx, stage)) is not None:
        return done
    folder = ctx.run.make_stage_dir(stage)
    n = ctx.decomposition.num_subdomains
    kind = str(kind or ctx.cfg.coarse.get("input", "probs"))
    x, y = {}, {}
    for split in SPLITS:
        x[split], y[split] = local_features(ctx.run, n, split, kind)
        if not torch.equal(y[split], ctx.data.y[split]):
            raise ValueError(
                f"saved local {split} predictions do not belong to the current data (labels differ); rerun the local "
                f"stage with force=true."
            )
    seed = subdomain_seed(ctx.cfg.seed, -1)
    dm = TensorDataModule(x, y, int(ctx.cfg.coarse.batch_size), seed=seed)
    start = time.perf_counter()
    L.seed_everything(seed, workers=True, verbose=False)
    net = build_coarse_net(ctx.cfg, n, ctx.data.num_classes)
    net = _fit(ctx.cfg, net, dm, folder, device, seed, int(ctx.cfg.coarse.max_epochs), ctx.cfg.coarse.optimizer)
    fit_time = time.perf_counter() - start
    meta = finish_stage(ctx, stage, net, dm, device, seed, start, fit_time, input=kind)
    log.info("%s (on %s): test acc %.4f in %.1f s", stage, kind, meta["accuracy"]["test"], meta["time_s"])
    return meta


def run_global(ctx: Context, device=None, stage: str = "global", num_devices: int = 1) -> dict:
    """Train the baseline: the same network family on full images.

    With ``num_devices > 1`` (the ``global_ddp`` stage, :mod:`ddcnn.training.methods`) it trains with DDP on that many
    devices into folder ``stage``, from the same initial weights and with the same global batch: each device takes
    ``data.batch_size / num_devices`` samples per step. Predictions are then made in this process on one device.
    """
    if (done := _skip(ctx, stage)) is not None:
        return done
    cfg = ctx.cfg
    if num_devices > 1:
        cfg = copy.deepcopy(ctx.cfg)  # a shallow copy would share (and change) the trainer node
        with open_dict(cfg):
            cfg.trainer.num_devices = num_devices
    folder = ctx.run.make_stage_dir(stage)
    seed = subdomain_seed(ctx.cfg.seed, GLOBAL_SEED)
    batch, augment = _batch_size(ctx.cfg), build_augment(ctx.cfg)
    dm = TensorDataModule(ctx.data.x, ctx.data.y, batch // num_devices, seed=seed, augment=augment)
    start = time.perf_counter()
    L.seed_everything(seed, workers=True, verbose=False)
    net = build_global_net(ctx.cfg, ctx.data)
    net = _fit(cfg, net, dm, folder, device, seed)
    fit_time = time.perf_counter() - start
    if num_devices > 1:
        dm = TensorDataModule(ctx.data.x, ctx.data.y, batch, seed=seed, augment=augment)
    ddp = {"num_devices": num_devices, "batch_per_device": batch // num_devices} if num_devices > 1 else {}
    meta = finish_stage(ctx, stage, net, dm, device, seed, start, fit_time, **ddp)
    log.info(
        "%s: test acc %.4f in %.1f s on %d device(s)", stage, meta["accuracy"]["test"], meta["time_s"], num_devices
    )
    return meta


def assemble_cnn_dnn(ctx: Context) -> CNNDNN:
    """The CNN-DNN of a finished run as one module, from the saved local nets and coarse DNN."""
    n = ctx.decomposition.num_subdomains
    missing = ctx.run.missing_local(n) + ([] if ctx.run.is_done("coarse") else ["coarse"])
    if missing:
        raise FileNotFoundError(f"cannot assemble the CNN-DNN of {ctx.run.root}: stages {missing} have not finished.")
    nets = []
    for i in range(n):
        net = build_local_net(ctx.cfg, ctx.data)
        net.load_state_dict(torch.load(ctx.run.stage_dir("local", i) / "net.pt", weights_only=True))
        nets.append(net)
    coarse = build_coarse_net(ctx.cfg, n, ctx.data.num_classes)
    coarse.load_state_dict(torch.load(ctx.run.stage_dir("coarse") / "net.pt", weights_only=True))
    model = CNNDNN(ctx.decomposition, nets, coarse, str(ctx.cfg.coarse.get("input", "probs")))
    return model.eval()


def run_evaluate(ctx: Context) -> dict:
    """Accuracy of every local net, the combiners, the CNN-DNN and the global CNN; times and speedup."""
    from ddcnn.report.results import evaluate_run

    start = time.perf_counter()
    results = evaluate_run(ctx.run, ctx.decomposition, ctx.data, ctx.cfg)
    report = ctx.cfg.get("report") or {}
    if report.get("plots", True):
        from ddcnn.report.plots import save_run_plots

        save_run_plots(ctx.run, ctx.decomposition, ctx.data, results)
    if report.get("export", True) and ctx.run.is_done("coarse"):
        from ddcnn.export import export_context

        export_context(ctx)
    acc = results["accuracy"]
    log.info(
        "evaluate: CNN-DNN test acc %s, global CNN %s, projected speedup %s, in %.1f s",
        *(f"{v:.4f}" if v is not None else "-" for v in (acc["cnn_dnn"], acc["global"], results["projected_speedup"])),
        time.perf_counter() - start,
    )
    return results
