"""Optional method stages beside the staged CNN-DNN: a second coarse DNN, end-to-end and transfer learning.

Klawonn, Lanser, Weber, "A Domain Decomposition-Based CNN-DNN Architecture for Model Parallel Training
Applied to Image Recognition Problems", SIAM J. Sci. Comput. 46(5), 2024 (arXiv 2302.06564), compare the
CNN-DNN with these variants:

``coarse_alt``
    The coarse DNN trained on the *other* local output than ``coarse.input`` (logits when the main coarse DNN
    uses probabilities, as in the paper, and vice versa), by the same procedure and seed, into ``coarse_alt/``.
    The evaluate stage reports both as ``cnn_dnn_probs`` and ``cnn_dnn_logits``.
``e2e``
    The CNN-DNN (:class:`~ddcnn.models.cnn_dnn.CNNDNN`) trained end to end from scratch on full images. Its
    local nets start from the same random weights as the independently trained ones (same per-sub-domain
    seeds), so the only difference to the staged CNN-DNN is the joint training.
``transfer``
    The CNN-DNN assembled from the finished local nets and coarse DNN (:func:`assemble_cnn_dnn`), then trained
    further end to end on full images with a learning rate scaled by ``methods.transfer.lr_scale``.
``global_transfer``
    The global CNN initialised from the local nets' weights, then trained on full images. Every tensor whose
    name and shape match is copied; with the default ``global_model: null`` the global CNN is built by the same
    builder as the local nets and every tensor matches (the networks end in global pooling, so the input size
    does not enter any weight shape). ``methods.global_transfer.init`` chooses the source:

    - ``best`` (default): the local net with the best validation accuracy. One trained network keeps
      consistent features; its sub-domain is where the information lies.
    - ``mean``: the average of the ``N`` local nets' parameters. The local nets start from different random
      weights, so their channels are not aligned (permutation symmetry) and the average mixes unrelated
      filters; it is offered for comparison, not as the default.
    - an integer ``i``: local net ``i``.
``global_ddp``
    The global CNN trained with Lightning DDP on ``methods.global_ddp.num_devices`` devices (``ddp_spawn``; gloo on
    CPU, one CPU share of ``cores // P`` threads per process), so that the report compares the CNN-DNN on ``P``
    devices with the global CNN on 1 device *and* on ``P`` devices. It starts from the global CNN's initial weights
    and keeps its global batch: each of the ``P`` processes takes ``data.batch_size / P`` samples per step and
    DDP averages their gradients, so it takes the same optimizer steps as the one-device global CNN. Its time is
    the wall time on ``P`` devices, process start-up included.

Every stage is ``stage(ctx, device) -> meta`` like those of :mod:`ddcnn.training.stages`: it writes its folder
atomically with ``probs_{train,val,test}.pt``, ``net.pt``, ``meta.json`` (with its own ``time_s``) and a
``done`` marker last, is skipped when finished (``force=true`` recomputes) and resumes from ``last.ckpt``.
``stage=all`` runs those enabled in ``methods.enabled``; ``stage=<name>`` runs one of them alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddcnn.data.datamodule import TensorDataModule
from ddcnn.models.cnn_dnn import CNNDNN
from ddcnn.training.stages import (
    GLOBAL_SEED,
    Context,
    _batch_size,
    _fit,
    _skip,
    assemble_cnn_dnn,
    build_augment,
    build_coarse_net,
    build_global_net,
    build_local_net,
    ddp_devices,
    finish_stage,
    predict_logits,
    run_coarse,
    run_global,
    subdomain_seed,
)

log = logging.getLogger(__name__)

__all__ = [
    "STAGE_FUNCTIONS",
    "run_coarse_alt",
    "run_e2e",
    "run_transfer",
    "run_global_transfer",
    "init_transfer",
    "init_global_transfer",
    "run_global_ddp",
]

# Seeds of the training runs (shuffling, dropout) of these stages; -1 and -2 are the coarse DNN and the global CNN.
E2E_SEED, TRANSFER_SEED, GLOBAL_TRANSFER_SEED = -3, -4, -5


def _settings(cfg: DictConfig, stage: str) -> DictConfig:
    methods = cfg.get("methods") or {}
    return methods.get(stage) or OmegaConf.create({})


def _max_epochs(cfg: DictConfig, stage: str) -> int:
    value = _settings(cfg, stage).get("max_epochs")
    value = cfg.trainer.max_epochs if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"methods.{stage}.max_epochs must be a positive whole number, got {value!r}.")
    return int(value)


def _optimizer(cfg: DictConfig, stage: str) -> DictConfig:
    """``cfg.optimizer`` with its learning rate scaled by ``methods.<stage>.lr_scale`` (fine-tuning wants less)."""
    scale = _settings(cfg, stage).get("lr_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or scale <= 0:
        raise ValueError(f"methods.{stage}.lr_scale must be a positive number, got {scale!r}.")
    opt = OmegaConf.to_container(cfg.optimizer, resolve=True)
    if "lr" in opt:
        opt["lr"] = float(opt["lr"]) * float(scale)
    return OmegaConf.create(opt)


def _full_image_data(ctx: Context, seed: int) -> TensorDataModule:
    # The same loader as the global CNN's: full images, the configured augmentation, batches fixed by the seed.
    return TensorDataModule(ctx.data.x, ctx.data.y, _batch_size(ctx.cfg), seed=seed, augment=build_augment(ctx.cfg))


def _val_accuracy(net: nn.Module, dm: TensorDataModule, device) -> float:
    logits, labels = predict_logits(net, dm.loader("val"), device)
    return float((logits.argmax(-1) == labels).float().mean())


def _train_full_images(
    ctx: Context, stage: str, net: nn.Module, seed: int, start: float, device, extra: dict, measure_start: bool = False
) -> dict:
    """Train ``net`` on full images into the stage folder, save its predictions and mark the stage done.

    ``measure_start`` records the validation accuracy of the starting point (``start_accuracy``) in the metadata.
    """
    folder = ctx.run.stage_dir(stage)
    dm = _full_image_data(ctx, seed)
    before = _val_accuracy(net, dm, device) if measure_start else None
    net.train()
    net = _fit(ctx.cfg, net, dm, folder, device, seed, _max_epochs(ctx.cfg, stage), _optimizer(ctx.cfg, stage))
    fit_time = time.perf_counter() - start
    extra = {"max_epochs": _max_epochs(ctx.cfg, stage), **extra}
    if before is not None:
        extra["start_accuracy"] = {"val": before}
    meta = finish_stage(ctx, stage, net, dm, device, seed, start, fit_time, **extra)
    log.info("%s: test acc %.4f in %.1f s", stage, meta["accuracy"]["test"], meta["time_s"])
    return meta


# --- stages --------------------------------------------------------------------------------------
def run_coarse_alt(ctx: Context, device=None) -> dict:
    """The coarse DNN on the other local output than ``coarse.input`` (logits vs probabilities)."""
    main = str(ctx.cfg.coarse.get("input", "probs"))
    return run_coarse(ctx, device, stage="coarse_alt", kind="logits" if main == "probs" else "probs")


def run_e2e(ctx: Context, device=None) -> dict:
    """The CNN-DNN trained end to end from random weights on full images."""
    if (done := _skip(ctx, "e2e")) is not None:
        return done
    ctx.run.make_stage_dir("e2e")
    start = time.perf_counter()
    n = ctx.decomposition.num_subdomains
    nets = []
    for i in range(n):
        L.seed_everything(subdomain_seed(ctx.cfg.seed, i), workers=True, verbose=False)
        nets.append(build_local_net(ctx.cfg, ctx.data))
    L.seed_everything(subdomain_seed(ctx.cfg.seed, -1), workers=True, verbose=False)
    coarse = build_coarse_net(ctx.cfg, n, ctx.data.num_classes)
    model = CNNDNN(ctx.decomposition, nets, coarse, str(ctx.cfg.coarse.get("input", "probs")))
    seed = subdomain_seed(ctx.cfg.seed, E2E_SEED)
    return _train_full_images(ctx, "e2e", model, seed, start, device, {"coarse_input": _coarse_input(model)})


def _coarse_input(model: CNNDNN) -> str:
    return "probs" if model.use_probs else "logits"


def init_transfer(ctx: Context) -> CNNDNN:
    """The starting point of the ``transfer`` stage: the CNN-DNN assembled from the finished local nets and coarse
    DNN (raises ``FileNotFoundError`` naming the stages that have not finished)."""
    return assemble_cnn_dnn(ctx).train()


def run_transfer(ctx: Context, device=None) -> dict:
    """The assembled CNN-DNN (finished local nets + coarse DNN) trained further end to end on full images."""
    if (done := _skip(ctx, "transfer")) is not None:
        return done
    start = time.perf_counter()
    model = init_transfer(ctx)  # before creating the folder: a missing local net leaves nothing behind
    ctx.run.make_stage_dir("transfer")
    seed = subdomain_seed(ctx.cfg.seed, TRANSFER_SEED)
    extra = {"coarse_input": _coarse_input(model)}
    return _train_full_images(ctx, "transfer", model, seed, start, device, extra, measure_start=True)


def _local_states(ctx: Context, indices: list[int]) -> list[dict[str, torch.Tensor]]:
    return [torch.load(ctx.run.stage_dir("local", i) / "net.pt", weights_only=True) for i in indices]


def init_global_transfer(ctx: Context) -> tuple[nn.Module, dict]:
    """The global CNN initialised from the local nets' weights as ``methods.global_transfer.init`` says.

    Returns:
        The network and a record of the initialisation (source nets, copied and skipped tensors).
    """
    n = ctx.decomposition.num_subdomains
    missing = ctx.run.missing_local(n)
    if missing:
        raise FileNotFoundError(
            f"global_transfer starts from the local nets, but local nets {missing} have not finished in "
            f"{ctx.run.root}; run the local stage first."
        )
    init = _settings(ctx.cfg, "global_transfer").get("init", "best")
    if init == "best":
        val = [ctx.run.meta("local", i)["accuracy"]["val"] for i in range(n)]
        sources = [max(range(n), key=lambda i: (val[i], -i))]
    elif init == "mean":
        sources = list(range(n))
    elif isinstance(init, int) and not isinstance(init, bool) and 0 <= init < n:
        sources = [init]
    else:
        raise ValueError(
            f"methods.global_transfer.init must be 'best', 'mean' or a local net index 0..{n - 1}, got {init!r}."
        )
    states = _local_states(ctx, sources)
    source: dict[str, torch.Tensor] = {}
    for key, value in states[0].items():
        if value.is_floating_point() and len(states) > 1:
            source[key] = torch.stack([s[key] for s in states]).mean(0)
        else:  # integer buffers (BatchNorm's num_batches_tracked) are counters, not weights: take the first
            source[key] = value
    L.seed_everything(subdomain_seed(ctx.cfg.seed, GLOBAL_SEED), workers=True, verbose=False)  # global CNN init
    net = build_global_net(ctx.cfg, ctx.data)
    target = net.state_dict()
    copied = {k: v for k, v in source.items() if k in target and target[k].shape == v.shape}
    skipped = sorted(set(target) - set(copied))
    if not copied:
        raise ValueError(
            "global_transfer: no tensor of the local nets fits the global CNN (names or shapes differ); use the same "
            "model for both (global_model: null)."
        )
    net.load_state_dict(copied, strict=False)
    record = {"init": init, "sources": sources, "copied_tensors": len(copied), "skipped_tensors": skipped}
    return net, record


def run_global_transfer(ctx: Context, device=None) -> dict:
    """The global CNN initialised from the local nets' weights, trained on full images."""
    if (done := _skip(ctx, "global_transfer")) is not None:
        return done
    start = time.perf_counter()
    net, record = init_global_transfer(ctx)
    ctx.run.make_stage_dir("global_transfer")
    seed = subdomain_seed(ctx.cfg.seed, GLOBAL_TRANSFER_SEED)
    return _train_full_images(ctx, "global_transfer", net, seed, start, device, record, measure_start=True)


def run_global_ddp(ctx: Context, device=None) -> dict:
    """The global CNN trained with DDP on ``methods.global_ddp.num_devices`` devices (see the module doc)."""
    return run_global(ctx, device, stage="global_ddp", num_devices=ddp_devices(ctx.cfg))


# Stage name -> function; the names and their order: ddcnn.training.pipeline.OPTIONAL_STAGES.
STAGE_FUNCTIONS: dict[str, Callable[[Context, object], dict]] = {
    "coarse_alt": run_coarse_alt,
    "e2e": run_e2e,
    "transfer": run_transfer,
    "global_transfer": run_global_transfer,
    "global_ddp": run_global_ddp,
}
