"""The ``coarse`` stage: the coarse DNN trained on the saved local outputs (train split), selected on val.

What the fit is (:func:`fit_coarse`, the same for every dataset size and class count):

1. **Scaled inputs.** The network standardises its inputs with the training rows' mean and standard deviation
   (:meth:`~ddcnn.models.coarse.CoarseMLP.fit_input_scaling`; buffers of the module, so the exported CNN-DNN
   computes the same).
2. **The convex part first.** The default network (``coarse.net``) is the averaging combiner (``log`` of the mean
   local probability) plus a linear path plus the hidden layers. The linear path is fit exactly: multinomial
   logistic regression on the scaled inputs with the averaging combiner as a fixed offset, by full-batch L-BFGS
   for every L2 strength of ``coarse.linear.l2_grid``, selected on validation together with the averaging combiner
   itself (no linear path). This is convex, needs no learning rate, and on few rows per class keeps the averaging
   combiner (``coarse.linear.max_rows`` caps the rows of this solve on large data).
3. **Then all weights** by AdamW from there (the hidden layers' output starts at zero): ``coarse.steps`` optimizer
   steps, ``coarse.batch_size: auto`` = the power of two nearest ``n_train / 40`` within ``[32, 1024]`` and
   ``coarse.max_epochs: auto`` = enough epochs for those steps within ``[5, 200]``, a cosine schedule, selection on
   ``coarse.monitor`` of the validation split, early stopping after ``coarse.patience`` epochs without improvement.
   The result is kept only if it beats the starting point (step 2) on the validation split; otherwise the starting
   point is the coarse DNN.
4. **Divergence is detected and recovered from**: an epoch whose mean training loss is not finite or exceeds
   twice the larger of the initial loss and ``ln K`` restarts the fit from its starting weights with the learning
   rate divided by 10, at most ``coarse.divergence_restarts`` times (:mod:`ddcnn.engine.tensor_fit`). A fit that
   ends at or near chance on the validation split while the averaging combiner is well above it (possible only
   without the averaging skip, e.g. the paper's plain MLP) is refit the same way.

Every decision (the L2 path, which candidate was kept, restarts) is in the stage's ``meta.json``. A plain PyTorch
loop trains it (:func:`ddcnn.engine.tensor_fit.fit_tensors`, ``coarse.num_threads`` CPU threads); it resumes from
``last.ckpt`` like the other stages, and its ``meta.json`` times include the training time of processes that were
interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddcnn.context import Context, build_coarse_net, coarse_net_spec
from ddcnn.data.datamodule import TensorDataModule
from ddcnn.engine.convex import L2_GRID, fit_logistic
from ddcnn.engine.tensor_fit import EVAL_CHUNK, fit_tensors, torch_threads
from ddcnn.engine.train import EpochReporter, FitResult
from ddcnn.rundir import SPLITS
from ddcnn.stages.common import finish_stage, skip, stage_seed

log = logging.getLogger(__name__)

__all__ = ["run", "coarse_inputs", "coarse_plan", "fit_coarse", "CoarseFit", "near_chance"]

# coarse.batch_size: auto -> the power of two nearest n_train / _ROWS_PER_STEP_DIVISOR, within these bounds.
_AUTO_BATCH = (32, 1024)
_ROWS_PER_STEP_DIVISOR = 40
# coarse.max_epochs: auto -> enough epochs for coarse.steps optimizer steps, within these bounds.
_AUTO_EPOCHS = (5, 200)
# A validation accuracy within this many standard errors (and at least 1 point) of the majority-class rate is "at
# chance"; the averaging combiner "well above" it is another such margin higher.
_CHANCE_SE = 3.0


def coarse_inputs(ctx: Context, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The coarse DNN's data: local outputs ``(n, N, K)`` of every split and their labels, checked against the data."""
    n = ctx.decomposition.num_subdomains
    x, y = {}, {}
    for split in SPLITS:
        x[split], y[split] = ctx.run.local_outputs(n, split, kind)
        if not torch.equal(y[split], ctx.data.y[split]):
            raise ValueError(
                f"saved local {split} predictions do not belong to the current data (labels differ); rerun the local "
                f"stage with force=true."
            )
    return x, y


def _setting(node: Mapping, key: str, default: Any) -> Any:
    value = node.get(key, default)
    return default if value is None else value


def coarse_plan(n_train: int, coarse: Mapping) -> dict:
    """Rows per step and epochs of the coarse DNN's fit for ``n_train`` training rows (``auto`` rules: module doc).

    Returns:
        ``{"batch_size", "max_epochs", "steps_per_epoch", "steps"}``.
    """
    batch = _setting(coarse, "batch_size", "auto")
    if batch == "auto":
        low, high = _AUTO_BATCH
        batch = 2 ** round(math.log2(max(n_train / _ROWS_PER_STEP_DIVISOR, 1)))
        batch = min(n_train, max(low, min(high, batch)))
    elif isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"coarse.batch_size must be a positive whole number or auto, got {batch!r}.")
    batch = min(int(batch), n_train)
    per_epoch = -(-n_train // batch)
    epochs = _setting(coarse, "max_epochs", "auto")
    if epochs == "auto":
        steps = _setting(coarse, "steps", 400)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"coarse.steps must be a positive whole number, got {steps!r}.")
        low, high = _AUTO_EPOCHS
        epochs = min(high, max(low, -(-steps // per_epoch)))
    elif isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"coarse.max_epochs must be a positive whole number or auto, got {epochs!r}.")
    return {"batch_size": batch, "max_epochs": int(epochs), "steps_per_epoch": per_epoch, "steps": per_epoch * epochs}


def _chance_margin(majority_rate: float, n: int) -> float:
    se = math.sqrt(max(majority_rate * (1 - majority_rate), 1e-6) / max(n, 1))
    return max(0.01, _CHANCE_SE * se)


def near_chance(accuracy: float, majority_rate: float, n: int) -> bool:
    """Whether ``accuracy`` on ``n`` samples is within noise (3 standard errors, at least 1 point) of the
    majority-class rate: the accuracy of always predicting the most frequent training class."""
    return accuracy <= majority_rate + _chance_margin(majority_rate, n)


@torch.no_grad()
def _scores(net: nn.Module, x: torch.Tensor, y: torch.Tensor, device) -> dict[str, float]:
    net.eval()
    logits = torch.cat([net(chunk.to(device)).float().cpu() for chunk in x.split(EVAL_CHUNK)])
    return {"acc": float((logits.argmax(-1) == y).float().mean()), "loss": float(F.cross_entropy(logits, y))}


def _better(candidate: dict[str, float], incumbent: dict[str, float], monitor: str) -> bool:
    if monitor == "val_acc":
        return (candidate["acc"], -candidate["loss"]) > (incumbent["acc"], -incumbent["loss"])
    return candidate["loss"] < incumbent["loss"]


@dataclass
class CoarseFit:
    """What :func:`fit_coarse` returns.

    Attributes:
        net: The coarse DNN with the kept weights.
        result: The training's times and history (:class:`ddcnn.engine.train.FitResult`).
        kept: ``trained`` (step 3's result), ``linear`` (the convex starting point) or ``averaging`` (the averaging
            combiner: the convex fit kept no linear path).
        plan: Rows per step and epochs (:func:`coarse_plan`).
        report: What ``meta.json`` records: the L2 path, the validation scores of the candidates, restarts, refits.
    """

    net: nn.Module
    result: FitResult
    kept: str
    plan: dict
    report: dict = field(default_factory=dict)


def _optimizer_with_lr_scale(node: Any, scale: float) -> Any:
    spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    if scale != 1.0 and "lr" in spec:
        spec["lr"] = float(spec["lr"]) * scale
    return spec


def fit_coarse(
    net: nn.Module,
    x: Mapping[str, torch.Tensor],
    y: Mapping[str, torch.Tensor],
    folder: str | Path,
    coarse: Mapping,
    *,
    seed: int,
    device=None,
    on_epoch_end=None,
    start: float | None = None,
) -> CoarseFit:
    """Fit the coarse DNN ``net`` on ``x["train"]`` and select on ``x["val"]`` (the module doc's procedure).

    Args:
        net: A :class:`~ddcnn.models.coarse.CoarseMLP` (another module is trained by step 3 alone).
        x, y: Local outputs ``(n, N, K)`` and labels per split (``train`` and ``val`` are used).
        folder: The stage folder (``last.ckpt``, ``logs/metrics.csv``).
        coarse: The ``coarse`` settings (``optimizer``, ``scheduler``, ``batch_size``, ``max_epochs``, ``steps``,
            ``monitor``, ``divergence_restarts``, ``linear``, ``checkpoint_every``).
        seed: Seeds the fit's shuffling and dropout.
        device: Where it trains.
        on_epoch_end: Called after each epoch (the progress reporter).
        start: ``time.perf_counter()`` at the start of the stage.
    """
    start = time.perf_counter() if start is None else float(start)
    folder = Path(folder)
    device = torch.device(device) if device is not None else torch.device("cpu")
    monitor = str(_setting(coarse, "monitor", "val_loss"))
    if monitor not in ("val_loss", "val_acc"):
        raise ValueError(f"coarse.monitor must be val_loss or val_acc, got {monitor!r}.")
    restarts = int(_setting(coarse, "divergence_restarts", 3))
    if restarts < 0:
        raise ValueError(f"coarse.divergence_restarts must be >= 0, got {restarts!r}.")
    x_train, y_train, x_val, y_val = x["train"], y["train"].long(), x["val"], y["val"].long()
    plan = coarse_plan(len(y_train), coarse)
    report: dict[str, Any] = {"plan": plan, "monitor": monitor}
    is_coarse_mlp = hasattr(net, "fit_input_scaling")
    if is_coarse_mlp:
        net.fit_input_scaling(x_train)
    skip_on = getattr(net, "skip", "none") == "mean_prob"
    has_hidden = is_coarse_mlp and len(net.mlp) > 1
    candidates: dict[str, dict[str, float]] = {}
    if skip_on:
        with torch.no_grad():
            net.mlp[-1].weight.zero_()
            net.mlp[-1].bias.zero_()
            if net.has_linear:
                net.linear.weight.zero_()
                net.linear.bias.zero_()
        candidates["averaging"] = _scores(net, x_val, y_val, "cpu")
    kept = "trained"
    linear_node = coarse.get("linear") or {}
    if is_coarse_mlp and (net.has_linear or not has_hidden) and bool(_setting(linear_node, "enabled", True)):
        kept = _fit_linear_path(net, x_train, y_train, x_val, y_val, linear_node, seed, skip_on, monitor, report)
        candidates["linear"] = _scores(net, x_val, y_val, "cpu")
        if kept == "averaging":
            candidates.pop("linear")
    start_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    start_name = kept if kept != "trained" else None
    train = has_hidden or not is_coarse_mlp or start_name is None
    result = FitResult(net, time.perf_counter() - start, 0.0, None, None)
    if train:
        attempts, lr_scale = 0, 1.0
        while True:
            fitted = fit_tensors(
                net,
                {"train": x_train, "val": x_val},
                {"train": y_train, "val": y_val},
                folder,
                optimizer=_optimizer_with_lr_scale(coarse.get("optimizer"), lr_scale),
                scheduler=coarse.get("scheduler"),
                max_epochs=plan["max_epochs"],
                batch_size=plan["batch_size"],
                seed=seed,
                monitor=monitor,
                monitor_mode="max" if monitor == "val_acc" else "min",
                checkpoint_every=int(_setting(coarse, "checkpoint_every", plan["max_epochs"])),
                device=device,
                on_epoch_end=on_epoch_end,
                divergence_restarts=restarts,
                patience=coarse.get("patience"),
                start=start,
            )
            report["restarts"] = fitted.restarts
            trained = _scores(fitted.net, x_val, y_val, device)
            majority_rate = float((y_val == int(torch.bincount(y_train).argmax())).float().mean())
            averaging = _averaging_scores(x_val, y_val, getattr(net, "inputs", "probs"))
            margin = _chance_margin(majority_rate, len(y_val))
            collapsed = near_chance(trained["acc"], majority_rate, len(y_val)) and (
                averaging["acc"] > majority_rate + 2 * margin
            )
            if not collapsed or attempts >= restarts:
                break
            # At chance while averaging the local nets is well above it: the fit collapsed (e.g. the paper's plain
            # MLP on unscaled logits at too high a rate). Start again with a smaller rate.
            attempts += 1
            lr_scale *= 0.1
            report.setdefault("refits", []).append(
                {"val_acc": trained["acc"], "majority_rate": majority_rate, "lr_scale": lr_scale}
            )
            log.warning(
                "%s: the coarse DNN ended at chance on the validation split (accuracy %.3f, majority class %.3f, "
                "averaging %.3f); fitting again with the learning rate x %g",
                folder,
                trained["acc"],
                majority_rate,
                averaging["acc"],
                lr_scale,
            )
            net.load_state_dict(start_state)
            (folder / "last.ckpt").unlink(missing_ok=True)
        candidates["trained"] = trained
        result = FitResult(
            fitted.net, fitted.fit_time_s, fitted.previous_time_s, fitted.resumed_from_epoch, fitted.best_epoch
        )
        if start_name is not None and not _better(trained, candidates[start_name], monitor):
            net.load_state_dict(start_state)
            kept = start_name
        else:
            kept = "trained"
    report["validation"] = candidates
    report["kept"] = kept
    return CoarseFit(net, result, kept, plan, report)


def _averaging_scores(x: torch.Tensor, y: torch.Tensor, inputs: str) -> dict[str, float]:
    probs = x.softmax(-1) if inputs == "logits" else x
    logits = probs.mean(1).clamp_min(1e-12).log()
    return {"acc": float((logits.argmax(-1) == y).float().mean()), "loss": float(F.nll_loss(logits, y))}


def _fit_linear_path(
    net, x_train, y_train, x_val, y_val, node: Mapping, seed: int, skip_on: bool, monitor: str, report
) -> str:
    """Step 2: the linear path by convex logistic regression (with the averaging offset); returns the candidate it
    leaves in ``net``: ``linear`` or ``averaging`` (the averaging combiner beat every L2 strength on validation)."""
    max_rows = _setting(node, "max_rows", 20_000)
    rows = torch.arange(len(y_train))
    if max_rows and len(rows) > int(max_rows):  # a fixed random subset of the rows: the solve's cost is bounded
        rows = torch.randperm(len(rows), generator=torch.Generator().manual_seed(int(seed)))[: int(max_rows)]
    with torch.no_grad():
        z_train, z_val = net.scale_inputs(x_train[rows]), net.scale_inputs(x_val)
        offsets = (net.averaging_logits(x_train[rows]), net.averaging_logits(x_val)) if skip_on else (None, None)
    grid = tuple(float(v) for v in _setting(node, "l2_grid", L2_GRID))
    fit = fit_logistic(
        z_train,
        y_train[rows],
        z_val,
        y_val,
        net.num_classes,
        l2_grid=grid,
        offset_train=offsets[0],
        offset_val=offsets[1],
        max_iter=int(_setting(node, "max_iter", 200)),
        select=monitor,
    )
    report["linear"] = {"l2": fit.l2, "rows": len(rows), "time_s": fit.time_s, "path": fit.path}
    layer = net.linear_layer()
    with torch.no_grad():
        layer.weight.copy_(fit.weight)
        layer.bias.copy_(fit.bias)
    if skip_on:
        averaging = _averaging_scores(x_val, y_val, net.inputs)
        if not _better({"acc": fit.val_acc, "loss": fit.val_loss}, averaging, monitor):
            with torch.no_grad():
                layer.weight.zero_()
                layer.bias.zero_()
            report["linear"]["kept"] = False
            return "averaging"
    report["linear"]["kept"] = True
    return "linear"


def run(ctx: Context, device=None, stage: str = "coarse", kind: str | None = None) -> dict:
    """Train the coarse DNN on the saved local probabilities (or logits: ``kind``, default ``coarse.input``).

    ``stage`` and ``kind`` let a second coarse DNN train on the other input into its own stage folder
    (``coarse_alt``) by exactly the same procedure and seed.
    """
    if (done := skip(ctx, stage)) is not None:
        return done
    folder = ctx.run.make_stage_dir(stage)
    start = time.perf_counter()
    n = ctx.decomposition.num_subdomains
    kind = str(kind or ctx.cfg.coarse.get("input", "probs"))
    x, y = coarse_inputs(ctx, kind)
    seed = stage_seed(ctx, stage)
    coarse = ctx.cfg.coarse
    torch.manual_seed(seed)
    spec = coarse_net_spec(ctx.cfg, kind)
    net = build_coarse_net(ctx.cfg, n, ctx.data.num_classes, kind=kind, spec=spec)
    plan = coarse_plan(len(y["train"]), coarse)
    reporter = EpochReporter(ctx.cfg, folder, plan["max_epochs"], every=max(1, plan["max_epochs"] // 10))
    with torch_threads(coarse.get("num_threads")), contextlib.ExitStack() as stack:
        stack.callback(reporter.close)
        fitted = fit_coarse(net, x, y, folder, coarse, seed=seed, device=device, on_epoch_end=reporter, start=start)
        dm = TensorDataModule(x, y, eval_batch_size=EVAL_CHUNK, seed=seed)  # predictions only
        meta = finish_stage(
            ctx, stage, fitted.net, dm, device, seed, fitted.result, input=kind, coarse_net=spec, fit=fitted.report
        )
    log.info(
        "%s (on %s): test acc %.4f in %.1f s (kept: %s)",
        stage,
        kind,
        meta["accuracy"]["test"],
        meta["time_s"],
        fitted.kept,
    )
    return meta
