"""The ``coarse`` stage: the coarse DNN trained on the saved local outputs (train split), selected on val.

What the fit is (:func:`fit_coarse`, the same for every dataset size and class count):

1. **Scaled inputs.** The network standardises its inputs with the training rows' mean and standard deviation
   (:meth:`~ddcnn.models.coarse.CoarseMLP.fit_input_scaling`; buffers of the module, so the exported CNN-DNN
   computes the same).
2. **The convex part first.** The default network (``coarse.net``) is a weighted averaging combiner (``log`` of the
   mean local probability) plus a linear path plus the hidden layers. The linear path is fit exactly as the convex
   stacker is (:mod:`ddcnn.stages.stacker`): multinomial logistic regression on the scaled inputs by full-batch
   L-BFGS for every L2 strength of ``coarse.linear.l2_grid``, the strength chosen on validation accuracy. The
   averaging combiner alone is the other candidate: whichever does better on validation is the starting point
   (the other's weight at zero). This is convex, needs no learning rate, and on few rows per class keeps the
   averaging combiner, which a regression fit from so few rows cannot match (``coarse.linear.max_rows`` caps the
   rows of this solve on large data).
3. **Then all weights** by AdamW from there (the hidden layers' output starts at zero): ``coarse.steps`` optimizer
   steps, ``coarse.batch_size: auto`` = the power of two nearest ``n_train / 40`` within ``[32, 1024]`` and
   ``coarse.max_epochs: auto`` = enough epochs for those steps within ``[5, 200]``, a cosine schedule, selection on
   ``coarse.monitor`` of the validation split, early stopping after ``coarse.patience`` epochs without improvement.
   The result is kept only if it beats the starting point (step 2) on the validation split; otherwise the starting
   point is the coarse DNN.
4. **Divergence is detected and recovered from**: an epoch whose mean training loss is not finite or exceeds
   twice the larger of the initial loss and ``ln K`` restarts the fit from its starting weights with the learning
   rate divided by 10, at most ``coarse.divergence_restarts`` times (:mod:`ddcnn.engine.loop`). A fit that
   ends at or near chance on the validation split while the averaging combiner is well above it (possible only
   without the averaging skip, e.g. the paper's plain MLP) is refit the same way.

Every decision (the L2 path, which candidate was kept, restarts) is in the stage's ``meta.json``.

The CNN-DNN's accuracy-versus-time curve (``coarse/curve.json``, with ``report.curves``): at each snapshot epoch of
the local nets (:class:`ddcnn.stages.common.LocalSnapshots`) a coarse DNN is fit the same way on that epoch's local
outputs; a point's time is the slowest local net's training clock at that epoch plus that coarse fit's time (the
projected time on one device per local net), and the averaging combiner's points come with it. This is reporting
work: it is not in the stage's ``time_s``. ddcnn's one training loop trains it (:func:`ddcnn.engine.train.fit_tensors`,
with the run's precision, clipping and batch limits; ``coarse.num_threads`` CPU threads); it resumes from ``last.ckpt``
like the other stages, and its ``meta.json`` times include the training time of processes that were interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddcnn.context import Context, build_coarse_net, coarse_net_spec
from ddcnn.data.datamodule import TensorDataModule
from ddcnn.engine.convex import fit_logistic
from ddcnn.engine.gpu import POLICY_OFF
from ddcnn.engine.loggers import EpochReporter
from ddcnn.engine.loop import FitResult
from ddcnn.engine.optim import torch_threads
from ddcnn.engine.train import EVAL_CHUNK, fit_tensors
from ddcnn.io import atomic_write_json, load_run_file
from ddcnn.metrics import chance_margin, majority_rate, near_chance
from ddcnn.rundir import CURVE_FILE, SPLITS, TARGET_SPLIT
from ddcnn.settings import CoarseLinearSettings, CoarseSettings, LoopSettings
from ddcnn.stages.common import (
    SNAPSHOT_DIR,
    finish_stage,
    logistic_convergence,
    skip,
    stage_seed,
)

log = logging.getLogger(__name__)

__all__ = [
    "run",
    "coarse_inputs",
    "coarse_plan",
    "fit_coarse",
    "CoarseFit",
    "cnn_dnn_curve",
]


# coarse.batch_size: auto -> the power of two nearest n_train / _ROWS_PER_STEP_DIVISOR, within these bounds.
_AUTO_BATCH = (32, 1024)
_ROWS_PER_STEP_DIVISOR = 40
# coarse.max_epochs: auto -> enough epochs for coarse.steps optimizer steps, within these bounds.
_AUTO_EPOCHS = (5, 200)


def coarse_inputs(
    ctx: Context, kind: str, source: str = "local", count: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The coarse DNN's data: local outputs ``(n, N, K)`` of every split and their labels, checked against the data.

    ``source``/``count``: the ``count`` nets of another stage in their place (the members of ``global_ensemble``);
    default the ``N`` local nets."""
    n = ctx.decomposition.num_subdomains if count is None else int(count)
    x, y = {}, {}
    for split in (*SPLITS, TARGET_SPLIT) if TARGET_SPLIT in ctx.data.y else SPLITS:
        x[split], y[split] = ctx.run.local_outputs(n, split, kind, stage=source)
        if not torch.equal(y[split], ctx.data.y[split]):
            raise ValueError(
                f"saved {source} {split} predictions do not belong to the current data (labels differ); rerun "
                f"stage={source} with force=true."
            )
    return x, y


def coarse_plan(n_train: int, coarse: CoarseSettings) -> dict:
    """Rows per step and epochs of the coarse DNN's fit for ``n_train`` training rows (``auto`` rules: module doc).

    Returns:
        ``{"batch_size", "max_epochs", "steps_per_epoch", "steps"}``.
    """
    batch = coarse.batch_size
    if batch == "auto":
        low, high = _AUTO_BATCH
        batch = 2 ** round(math.log2(max(n_train / _ROWS_PER_STEP_DIVISOR, 1)))
        batch = min(n_train, max(low, min(high, batch)))
    batch = min(int(batch), n_train)
    per_epoch = -(-n_train // batch)
    epochs = coarse.max_epochs
    if epochs == "auto":
        low, high = _AUTO_EPOCHS
        epochs = min(high, max(low, -(-coarse.steps // per_epoch)))
    return {"batch_size": batch, "max_epochs": int(epochs), "steps_per_epoch": per_epoch, "steps": per_epoch * epochs}


@torch.no_grad()
def _scores(net: nn.Module, x: torch.Tensor, y: torch.Tensor, device) -> dict[str, float]:
    net.eval()
    logits = torch.cat([net(chunk.to(device)).float().cpu() for chunk in x.split(EVAL_CHUNK)])
    return {"acc": float((logits.argmax(-1) == y).float().mean()), "loss": float(F.cross_entropy(logits, y))}


def _outscores(candidate: dict[str, float], incumbent: dict[str, float], monitor: str) -> bool:
    """Whether ``candidate``'s validation scores (``acc``, ``loss``) beat ``incumbent``'s: on ``val_acc`` the higher
    accuracy, ties to the lower loss; otherwise the lower loss. Picks between two finished fits; epochs within one
    training are compared by :func:`ddcnn.engine.convergence.improves`."""
    if monitor == "val_acc":
        return (candidate["acc"], -candidate["loss"]) > (incumbent["acc"], -incumbent["loss"])
    return candidate["loss"] < incumbent["loss"]


@dataclass
class CoarseFit:
    """What :func:`fit_coarse` returns.

    Attributes:
        net: The coarse DNN with the kept weights.
        result: The training's times and history (:class:`ddcnn.engine.loop.FitResult`).
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


def _optimizer_with_lr_scale(node: Mapping, scale: float) -> dict:
    spec = dict(node)
    if scale != 1.0 and "lr" in spec:
        spec["lr"] = float(spec["lr"]) * scale
    return spec


def coarse_loop(
    loop: LoopSettings | None, coarse: CoarseSettings, plan: Mapping, seed: int, device, lr_scale: float = 1.0
) -> LoopSettings:
    """The coarse DNN's loop settings: the run's ``loop`` (``None``: the loop's Python defaults) with the
    ``coarse.*`` fields replaced: optimizer (its rate times ``lr_scale``), schedule, epochs (``plan``), monitor,
    patience (no minimum of epochs, no ``min_delta``), checkpoints every ``coarse.checkpoint_every`` epochs,
    divergence restarts; one device in this process, the GPU policy off (a small MLP on tensors)."""
    optimizer = _optimizer_with_lr_scale(coarse.optimizer, lr_scale)
    base = loop if loop is not None else LoopSettings(optimizer=optimizer, max_epochs=int(plan["max_epochs"]))
    every = plan["max_epochs"] if coarse.checkpoint_every is None else coarse.checkpoint_every
    return dataclasses.replace(
        base,
        optimizer=optimizer,
        scheduler=coarse.scheduler,
        max_epochs=int(plan["max_epochs"]),
        monitor=coarse.monitor,
        monitor_mode="max" if coarse.monitor == "val_acc" else "min",
        patience=coarse.patience,
        min_epochs=0,
        min_steps=0,
        min_delta=0.0,
        checkpoint_every=int(every),
        checkpoint_every_s=None,
        divergence_restarts=coarse.divergence_restarts,
        seed=int(seed),
        device=device,
        num_devices=1,
        launcher=None,
        write_best=True,
        activation_checkpointing="none",  # a small MLP on tensors: nothing to recompute
        **POLICY_OFF,
    )


# The reason a restart of the coarse fit records when it collapsed (CollapseRefit).
COLLAPSED = "collapsed"


class CollapseRefit:
    """The coarse fit's callback ``on_train_end``: a fit that ended at chance on validation while averaging the local
    nets is well above it has collapsed (e.g. the paper's plain MLP on unscaled logits at too high a rate), and the
    loop trains it again from its initial weights with the learning rate x 0.1, at most ``allowed`` times (the
    loop's restarts record them, so a resumed fit counts them too); ``refits`` what each saw."""

    def __init__(self, x_val, y_val, rate: float, averaging: float, allowed: int, device, folder) -> None:
        self.x_val, self.y_val, self.rate, self.averaging = x_val, y_val, rate, averaging
        self.allowed, self.device, self.folder = int(allowed), device, folder
        self.refits: list[dict[str, float]] = []

    def on_train_end(self, epoch: int, net: nn.Module, restarts: list[dict]) -> tuple[str, float] | None:
        done = [r for r in restarts if str(r["reason"]).startswith(COLLAPSED)]
        acc = _scores(net, self.x_val, self.y_val, self.device)["acc"]
        n = len(self.y_val)
        if not near_chance(acc, self.rate, n) or self.averaging <= self.rate + 2 * chance_margin(self.rate, n):
            return None
        if len(done) >= self.allowed:
            return None
        scale = (restarts[-1]["lr_scale"] if restarts else 1.0) * 0.1
        self.refits.append({"val_acc": acc, "majority_rate": self.rate, "lr_scale": scale})
        log.warning(
            "%s: the coarse DNN ended at chance on the validation split (accuracy %.3f, majority class %.3f, "
            "averaging %.3f); fitting again with the learning rate x %g",
            self.folder,
            acc,
            self.rate,
            self.averaging,
            scale,
        )
        return f"{COLLAPSED} at chance on validation (accuracy {acc:.3f}, averaging {self.averaging:.3f})", 0.1


def fit_coarse(
    net: nn.Module,
    x: Mapping[str, torch.Tensor],
    y: Mapping[str, torch.Tensor],
    folder: str | Path,
    coarse: CoarseSettings,
    *,
    seed: int,
    loop: LoopSettings | None = None,
    device=None,
    callbacks: Sequence[Any] = (),
    start: float | None = None,
) -> CoarseFit:
    """Fit the coarse DNN ``net`` on ``x["train"]`` and select on ``x["val"]`` (the module doc's procedure).

    Args:
        net: A :class:`~ddcnn.models.coarse.CoarseMLP` (another module is trained by step 3 alone).
        x, y: Local outputs ``(n, N, K)`` and labels per split (``train`` and ``val`` are used).
        folder: The stage folder (``last.ckpt``, ``logs/metrics.csv``).
        coarse: The run's ``coarse`` settings (``settings.coarse``; the fit reads ``optimizer``, ``scheduler``,
            ``batch_size``, ``max_epochs``, ``steps``, ``monitor``, ``patience``, ``divergence_restarts``,
            ``linear``, ``checkpoint_every``).
        seed: Seeds the fit's shuffling and dropout.
        loop: The run's loop settings (precision, clipping, batch limits, ...: :func:`coarse_loop`), so that they
            reach the coarse DNN as every other training; ``None``: the loop's Python defaults.
        device: Where it trains.
        callbacks: The progress reporter (:class:`~ddcnn.engine.loggers.EpochReporter`), outside the clock.
        start: ``time.perf_counter()`` at the start of the stage.
    """
    start = time.perf_counter() if start is None else float(start)
    folder = Path(folder)
    device = torch.device(device) if device is not None else torch.device("cpu")
    monitor, restarts = coarse.monitor, coarse.divergence_restarts
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
    if is_coarse_mlp and (net.has_linear or not has_hidden) and coarse.linear.enabled:
        kept = _fit_linear_path(net, x_train, y_train, x_val, y_val, coarse.linear, seed, skip_on, monitor, report)
        candidates["linear"] = _scores(net, x_val, y_val, "cpu")
        if kept == "averaging":
            candidates.pop("linear")
    start_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    start_name = kept if kept != "trained" else None
    train = has_hidden or not is_coarse_mlp or start_name is None
    result = FitResult(net, fit_time_s=time.perf_counter() - start)
    if train:
        rate = majority_rate(y_train, y_val)
        averaging = _averaging_scores(x_val, y_val, getattr(net, "inputs", "probs"))
        refit = CollapseRefit(x_val, y_val, rate, averaging["acc"], restarts or 0, device, folder)
        fitted = fit_tensors(
            net,
            {"train": x_train, "val": x_val},
            {"train": y_train, "val": y_val},
            folder,
            coarse_loop(loop, coarse, plan, seed, device),
            batch_size=plan["batch_size"],
            callbacks=[*callbacks, refit],
            start=start,
        )
        report["restarts"] = fitted.restarts
        if refit.refits:
            report["refits"] = refit.refits
        trained = _scores(fitted.net, x_val, y_val, device)
        candidates["trained"] = trained
        result = fitted
        if start_name is not None and not _outscores(trained, candidates[start_name], monitor):
            net.load_state_dict(start_state)
            kept = start_name
        else:
            kept = "trained"
    report["validation"] = candidates
    report["kept"] = kept
    return CoarseFit(net, result, kept, plan, report)


def _convergence(fitted: CoarseFit, coarse: CoarseSettings) -> dict:
    """``finish_stage``'s convergence record of the coarse DNN, from the fit that gave the kept weights: the loop's
    (AdamW with ``coarse.patience``; no minimum of epochs), the linear path's L-BFGS solve, or none for the averaging
    combiner (nothing fitted: converged)."""
    if fitted.kept == "trained":
        names = {"epochs": "coarse.max_epochs", "patience": "coarse.patience", "min_epochs": "", "plateau": ""}
        names |= {"monitor": "coarse.monitor", "monitor_mode": "", "lr": "coarse.optimizer.lr", "scheduler": ""}
        return {"convergence": fitted.result.convergence, "advice_names": names}
    if fitted.kept == "linear":
        linear = fitted.report["linear"]
        record = logistic_convergence(linear["path"], linear["l2"], coarse.linear.max_iter)
        return {"convergence": record, "advice_names": {"epochs": "coarse.linear.max_iter"}}
    record = {"converged": True, "reasons": [], "cause": None, "epochs": 0, "min_epochs": 0, "stopped_by": "no_fit"}
    return {"convergence": record | {"lr_ratio": None, "train_loss_change_last3": None}}


def _averaging_scores(x: torch.Tensor, y: torch.Tensor, inputs: str) -> dict[str, float]:
    probs = x.softmax(-1) if inputs == "logits" else x
    logits = probs.mean(1).clamp_min(1e-12).log()
    return {"acc": float((logits.argmax(-1) == y).float().mean()), "loss": float(F.nll_loss(logits, y))}


def _fit_linear_path(
    net, x_train, y_train, x_val, y_val, settings: CoarseLinearSettings, seed: int, skip_on: bool, monitor: str, report
) -> str:
    """Step 2: the linear path by convex logistic regression (the convex stacker's fit), or the averaging combiner
    when that does better on validation; returns the candidate it leaves in ``net``: ``linear`` or ``averaging``."""
    max_rows = settings.max_rows
    rows = torch.arange(len(y_train))
    if max_rows and len(rows) > int(max_rows):  # a fixed random subset of the rows: the solve's cost is bounded
        rows = torch.randperm(len(rows), generator=torch.Generator().manual_seed(int(seed)))[: int(max_rows)]
    with torch.no_grad():
        z_train, z_val = net.scale_inputs(x_train[rows]), net.scale_inputs(x_val)
    fit = fit_logistic(
        z_train,
        y_train[rows],
        z_val,
        y_val,
        net.num_classes,
        l2_grid=settings.l2_grid,
        max_iter=settings.max_iter,
        select="val_acc",
    )
    report["linear"] = {"l2": fit.l2, "rows": len(rows), "time_s": fit.time_s, "path": fit.path}
    layer = net.linear_layer()
    linear = {"acc": fit.val_acc, "loss": fit.val_loss}
    if skip_on and not _outscores(linear, _averaging_scores(x_val, y_val, net.inputs), monitor):
        with torch.no_grad():  # the averaging combiner alone (skip weight 1, no linear path)
            layer.weight.zero_()
            layer.bias.zero_()
            net.skip_scale.fill_(1.0)
        report["linear"]["kept"] = False
        return "averaging"
    with torch.no_grad():  # the logistic regression alone (the averaging skip's weight 0: step 3 may raise it)
        layer.weight.copy_(fit.weight)
        layer.bias.copy_(fit.bias)
        if skip_on:
            net.skip_scale.fill_(0.0)
    report["linear"]["kept"] = True
    return "linear"


FIT_ON = ("in_sample", "out_of_fold", "val")


def _fit_data(ctx: Context, kind: str, fit_on: str, seed: int, source: str = "local", count: int | None = None):
    """The coarse DNN's fit (``train``) and selection (``val``) rows, and all local outputs (for predictions).

    ``in_sample``: the local nets' outputs on their own training images (the paper's fit), selected on validation;
    ``out_of_fold``: the training images' out-of-fold outputs (stage ``local_oof``), selected on validation;
    ``val``: the validation split's outputs, half to fit and half to select (stratified, fixed by ``seed``).
    """
    x, y = coarse_inputs(ctx, kind, source, count)
    if fit_on == "in_sample":
        return x, y, x, y
    if fit_on == "out_of_fold":
        n = ctx.decomposition.num_subdomains
        missing = [i for i in range(n) if not ctx.run.is_done("local_oof", i)]
        if missing:
            raise FileNotFoundError(
                f"the out-of-fold local outputs of sub-domains {missing} have not finished in {ctx.run.root}; run "
                f"stage=local_oof first (stage=all with methods.enabled.coarse_oof=true runs it)."
            )
        oof = torch.stack([ctx.run.load_probs("local_oof", "train", i)[kind] for i in range(n)], dim=1)
        return {**x, "train": oof}, y, x, y
    from sklearn.model_selection import train_test_split

    labels = y["val"].numpy()
    rows = torch.arange(len(labels)).numpy()
    if ctx.data.groups is not None:  # one patient's studies on one side
        from ddcnn.data.splits import stratified_split

        what = (
            "coarse_val (methods.enabled.coarse_val) fits on one half of the validation split and selects on the "
            "other, one patient's studies on one side; raise data.val_fraction or set methods.enabled.coarse_val="
            "false"
        )
        fit_rows, select_rows = stratified_split(labels, 0.5, int(seed), ctx.data.groups["val"], what)
    else:
        try:
            fit_rows, select_rows = train_test_split(rows, test_size=0.5, stratify=labels, random_state=int(seed))
        except ValueError:  # a class too small to stratify: a plain seeded half
            fit_rows, select_rows = train_test_split(rows, test_size=0.5, random_state=int(seed))
    fit_rows, select_rows = torch.from_numpy(fit_rows).sort().values, torch.from_numpy(select_rows).sort().values
    fit_x = {"train": x["val"][fit_rows], "val": x["val"][select_rows]}
    fit_y = {"train": y["val"][fit_rows], "val": y["val"][select_rows]}
    return fit_x, fit_y, x, y


def run(
    ctx: Context,
    device=None,
    stage: str = "coarse",
    kind: str | None = None,
    fit_on: str = "in_sample",
    source: str = "local",
    count: int | None = None,
    extra: dict | None = None,
) -> dict:
    """Train the coarse DNN on the saved local probabilities (or logits: ``kind``, default ``coarse.input``).

    ``stage``, ``kind`` and ``fit_on`` (:data:`FIT_ON`) let another coarse DNN train into its own stage folder by
    exactly the same procedure and seed: on the other input (``coarse_alt``), on out-of-fold local outputs
    (``coarse_oof``) or on the validation split's (``coarse_val``); ``source`` and ``count`` on the outputs of
    ``count`` nets of another stage in place of the local nets (``global_ensemble_coarse``: the members of
    ``global_ensemble``), ``extra`` added to its ``meta.json``.
    """
    if fit_on not in FIT_ON:
        raise ValueError(f"fit_on must be one of {', '.join(FIT_ON)}, got {fit_on!r}.")
    if (done := skip(ctx, stage)) is not None:
        return done
    folder = ctx.run.make_stage_dir(stage)
    start = time.perf_counter()
    n = ctx.decomposition.num_subdomains if count is None else int(count)
    coarse = ctx.settings.coarse
    kind = str(kind or coarse.input)
    seed = stage_seed(ctx, stage)
    fit_x, fit_y, x, y = _fit_data(ctx, kind, fit_on, seed, source, count)
    torch.manual_seed(seed)
    spec = coarse_net_spec(coarse, kind)
    net = build_coarse_net(coarse, n, ctx.data.num_classes, spec=spec)
    plan = coarse_plan(len(fit_y["train"]), coarse)
    every = max(1, plan["max_epochs"] // 10)
    reporter = EpochReporter(
        ctx.settings.logger, ctx.settings.loop.enable_progress_bar, folder, plan["max_epochs"], every
    )
    with torch_threads(coarse.num_threads), contextlib.ExitStack() as stack:
        stack.callback(reporter.close)
        fitted = fit_coarse(
            net,
            fit_x,
            fit_y,
            folder,
            coarse,
            seed=seed,
            loop=ctx.settings.loop,
            device=device,
            callbacks=[reporter],
            start=start,
        )
        dm = TensorDataModule(x, y, eval_batch_size=EVAL_CHUNK, seed=seed)  # predictions only
        if stage == "coarse" and ctx.settings.report.curves.enabled:
            curve = cnn_dnn_curve(ctx, kind, seed)  # reporting work, outside the stage's time (fitted.result)
            if curve is not None:
                atomic_write_json(folder / CURVE_FILE, curve)
        by_design = "coarse.num_threads" if coarse.num_threads is not None else None
        meta = finish_stage(
            ctx,
            stage,
            fitted.net,
            dm,
            device,
            seed,
            fitted.result,
            threads_by_design=by_design,
            input=kind,
            fit_on=fit_on,
            coarse_net=spec,
            fit=fitted.report,
            **_convergence(fitted, coarse),
            **(extra or {}),
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


# A local net that early stopping ended before a curve epoch: its final outputs (the kept weights' ``probs_*.pt``)
# and its whole training clock stand for it at that epoch, as they do in the final CNN-DNN.
_FINISHED = "finished"


def _snapshot_files(ctx: Context) -> dict[int, list]:
    """``{epoch: [what local net i holds at that epoch, ...]}`` for every epoch some local net has a snapshot of: its
    snapshot file, or :data:`_FINISHED` where the net had stopped before that epoch (its final outputs stand in), or
    ``None`` where it has no snapshot there although it trained on (the epoch is then left out)."""
    n = ctx.decomposition.num_subdomains
    per_net = []
    for i in range(n):
        folder = ctx.run.stage_dir("local", i) / SNAPSHOT_DIR
        per_net.append({int(f.stem.split("_")[1]): f for f in folder.glob("epoch_*.pt")} if folder.is_dir() else {})
    if not per_net or not all(per_net):
        return {}
    epochs = sorted(set().union(*(set(d) for d in per_net)))
    out = {}
    for e in epochs:
        held = [d.get(e, _FINISHED if e > max(d) else None) for d in per_net]
        if None in held:
            log.warning("coarse curve: a local net has no snapshot of epoch %d although it trained on; skipped", e)
            continue
        if any(h is not _FINISHED for h in held):  # an epoch after every net stopped is the final CNN-DNN's point
            out[e] = held
    return out


def _final_snapshot(ctx: Context, subdomain: int, rows: torch.Tensor) -> dict:
    """A finished local net as a snapshot: its saved outputs of every split (the training rows ``rows`` of them) and
    its training clock at its end (``fit_time_s``)."""
    folder = ctx.run.stage_dir("local", subdomain)
    logits = {}
    for split in (*SPLITS, TARGET_SPLIT):
        path = folder / f"probs_{split}.pt"
        if path.is_file():
            saved = load_run_file(path)["logits"]
            logits[split] = saved[rows] if split == "train" else saved
    return {"time_s": float(ctx.run.meta("local", subdomain)["fit_time_s"]), "train_rows": rows, "logits": logits}


def cnn_dnn_curve(ctx: Context, kind: str, seed: int) -> dict | None:
    """The CNN-DNN's and the averaging combiner's accuracy-versus-time curve from the local nets' snapshots (module
    doc), or ``None`` when the local nets kept none. A point's test accuracy is there where every net's outputs of
    that epoch include the test split (``report.curves.points: all`` evaluates it at a few epochs only)."""
    files = _snapshot_files(ctx)
    if not files:
        return None
    coarse = ctx.settings.coarse
    n, k = ctx.decomposition.num_subdomains, ctx.data.num_classes
    points, averaging = [], []
    for epoch, paths in files.items():
        live = [load_run_file(p) for p in paths if p is not _FINISHED]
        rows = live[0]["train_rows"]
        snaps = [load_run_file(p) if p is not _FINISHED else _final_snapshot(ctx, i, rows) for i, p in enumerate(paths)]
        if any(not torch.equal(s["train_rows"], rows) for s in snaps):
            log.warning("coarse curve: the local nets' snapshots of epoch %d hold other training rows; skipped", epoch)
            continue
        splits = [s for s in (*SPLITS, TARGET_SPLIT) if all(s in snap["logits"] for snap in snaps)]
        x = {split: torch.stack([s["logits"][split].float() for s in snaps], dim=1) for split in splits}
        if kind == "probs":
            x = {split: v.softmax(-1) for split, v in x.items()}
        y = {split: ctx.data.y[split] for split in splits if split in ctx.data.y}
        y["train"] = ctx.data.y["train"][rows]
        times = [float(s["time_s"]) for s in snaps]
        torch.manual_seed(seed)
        net = build_coarse_net(coarse, n, k, kind=kind)
        fit_start = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            fitted = fit_coarse(net, x, y, folder, coarse, seed=seed, loop=ctx.settings.loop)
        coarse_s = time.perf_counter() - fit_start
        val = _scores(fitted.net, x["val"], y["val"], "cpu")
        test = _scores(fitted.net, x["test"], y["test"], "cpu") if "test" in x else {"acc": None, "loss": None}
        base = {"epoch": epoch, "local_max_s": max(times), "local_total_s": sum(times), "train_rows": len(rows)}
        target = {}
        if TARGET_SPLIT in x and TARGET_SPLIT in y:  # measured for the fixed targets, never chosen on
            target["val_target_acc"] = _scores(fitted.net, x[TARGET_SPLIT], y[TARGET_SPLIT], "cpu")["acc"]
        points.append(
            {
                **base,
                "coarse_s": coarse_s,
                "coarse_fit_s": fitted.result.fit_time_s,  # its training clock (coarse_s: wall time, set-up included)
                "local_s": times,
                "time_s": max(times) + coarse_s,
                "val_acc": val["acc"],
                "val_loss": val["loss"],
                "test_acc": test["acc"],
                "test_loss": test["loss"],
                **target,
            }
        )
        mean_val = _averaging_scores(x["val"], y["val"], kind)
        mean_test = _averaging_scores(x["test"], y["test"], kind) if "test" in x else {"acc": None}
        if target:
            target = {"val_target_acc": _averaging_scores(x[TARGET_SPLIT], y[TARGET_SPLIT], kind)["acc"]}
        averaging.append(
            {**base, "time_s": max(times), "val_acc": mean_val["acc"], "test_acc": mean_test["acc"], **target}
        )
        log.info(
            "coarse curve: epoch %d, slowest local net %.1f s + coarse DNN %.1f s: val acc %.4f%s",
            epoch,
            max(times),
            coarse_s,
            val["acc"],
            "" if test["acc"] is None else f", test acc {test['acc']:.4f}",
        )
    return {"input": kind, "cnn_dnn": points, "mean_prob": averaging}
