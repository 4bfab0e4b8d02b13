"""The ``stacker`` stage: the convex stacker, the bar every coarse DNN must clear.

Multinomial logistic regression from the concatenated local outputs (``coarse.input``: probabilities or logits,
standardised with the training rows' statistics) to the classes, fit to convergence by full-batch L-BFGS for every
L2 strength of ``methods.stacker.l2_grid`` and selected on the validation split's accuracy
(:func:`ddcnn.engine.convex.fit_logistic`). It is the textbook stacking of the local nets: no hidden layer, no
learning rate, no epochs. A coarse DNN below it has a fitting problem, not a capacity problem.

The fitted model is a :class:`~ddcnn.models.coarse.CoarseMLP` without hidden layers, saved like the coarse DNN's.
"""

from __future__ import annotations

import logging
import time

import torch

from ddcnn.context import Context
from ddcnn.data.datamodule import TensorDataModule
from ddcnn.engine.convex import fit_logistic
from ddcnn.engine.loop import FitResult
from ddcnn.engine.optim import torch_threads
from ddcnn.engine.train import EVAL_CHUNK
from ddcnn.models.coarse import CoarseMLP
from ddcnn.rundir import L2_GRID
from ddcnn.stages.coarse import coarse_inputs
from ddcnn.stages.common import finish_stage, logistic_convergence, skip, stage_seed

log = logging.getLogger(__name__)

__all__ = ["run"]


def run(ctx: Context, device=None) -> dict:
    """Fit the convex stacker on the saved local outputs of the training split, select on validation."""
    if (done := skip(ctx, "stacker")) is not None:
        return done
    ctx.run.make_stage_dir("stacker")
    start = time.perf_counter()
    kind = ctx.settings.coarse.input
    x, y = coarse_inputs(ctx, kind)
    settings = ctx.settings.methods.stacker
    grid = settings.l2_grid or L2_GRID
    n, k = ctx.decomposition.num_subdomains, ctx.data.num_classes
    spec = {
        "_target_": "ddcnn.models.coarse.CoarseMLP",
        "hidden": [],
        "inputs": kind,
        "input_norm": "standardize",
        "skip": "none",
    }
    net = CoarseMLP(n, k, hidden=(), inputs=kind, input_norm="standardize", skip="none")
    seed = stage_seed(ctx, "stacker")
    threads = ctx.settings.coarse.num_threads
    with torch_threads(threads):
        net.fit_input_scaling(x["train"])
        with torch.no_grad():
            z_train, z_val = net.scale_inputs(x["train"]), net.scale_inputs(x["val"])
        fit = fit_logistic(
            z_train,
            y["train"],
            z_val,
            y["val"],
            k,
            l2_grid=grid,
            max_iter=settings.max_iter,
            select="val_acc",
        )
        with torch.no_grad():
            net.linear_layer().weight.copy_(fit.weight)
            net.linear_layer().bias.copy_(fit.bias)
        result = FitResult(net, fit_time_s=time.perf_counter() - start)
        dm = TensorDataModule(x, y, eval_batch_size=EVAL_CHUNK, seed=seed)  # predictions only
        meta = finish_stage(
            ctx,
            "stacker",
            net,
            dm,
            device,
            seed,
            result,
            threads_by_design="coarse.num_threads" if threads is not None else None,
            input=kind,
            coarse_net=spec,
            l2=fit.l2,
            path=fit.path,
            convergence=logistic_convergence(fit.path, fit.l2, settings.max_iter),
            advice_names={"epochs": "methods.stacker.max_iter"},
        )
    log.info("stacker (on %s): L2 %g, test acc %.4f in %.1f s", kind, fit.l2, meta["accuracy"]["test"], meta["time_s"])
    return meta
