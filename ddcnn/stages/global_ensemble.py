"""The ``global_ensemble`` stage: an ensemble of ``k`` global CNNs, combined by mean probability.

It separates decomposition from ensembling. The CNN-DNN holds ``N`` trained nets; on small data part of its lead over
one global CNN may be that of any ensemble. Here ``k`` global CNNs train on the same data as the global CNN, each from
a new initialisation: member ``i``'s seed (its initial weights and batch order) follows from the run's seed and ``i``
(:func:`member_seed`), never from another seed's global CNN, and no member is the run's global CNN. Their class
probabilities are averaged (the averaging combiner of the local nets, a :class:`~ddcnn.models.coarse.CoarseMLP`
without trained weights, saved as ``net.pt``); ``global_ensemble_coarse`` fits the coarse DNN on them as on the local
nets' outputs.

``methods.global_ensemble.k``: a whole number, or ``auto`` (:func:`ensemble_size`): the CNN-DNN's one-device training
time (its local nets one after another, then the coarse DNN) over the global CNN's, rounded, at least 2, from the
``time_s`` the run's ``local``, ``coarse`` and ``global`` stages recorded: the ensemble then costs about what the
CNN-DNN costs on one device. A page that fixes ``k`` from its one-job timing runs before its accuracy runs passes the
number it found.

Member ``i`` trains in ``RUN_DIR/global_ensemble/<i>/`` as the global CNN trains (its recipe, epochs and curve),
resumable from its ``last.ckpt`` and marked done on its own. A member depends on nothing of the decomposition or of
``k``: with ``store.reuse`` it is trained once per settings, seed and index and copied into every run that shares
them (:mod:`ddcnn.stages.reuse`), as the global CNN is; runs of two grids whose ``k`` differ share their first members.
The stage's ``time_s`` is the sum of its members' (one device, one after another) and the averaging.
"""

from __future__ import annotations

import logging
import time

import torch

from ddcnn.context import Context, subdomain_seed
from ddcnn.data.datamodule import TensorDataModule
from ddcnn.engine.loop import FitResult
from ddcnn.engine.train import EVAL_CHUNK
from ddcnn.models.coarse import CoarseMLP
from ddcnn.stages import reuse
from ddcnn.stages.coarse import coarse_inputs
from ddcnn.stages.common import finish_stage, skip, stage_seed
from ddcnn.stages.global_cnn import train_stage

log = logging.getLogger(__name__)

__all__ = ["STAGE", "run", "ensemble_size", "member_seed", "train_member"]

STAGE = "global_ensemble"


def member_seed(ctx: Context, member: int) -> int:
    """The seed of member ``member``: from the run's seed (through the stage's seed offset) and the index only."""
    return subdomain_seed(stage_seed(ctx, STAGE), int(member))


def ensemble_size(ctx: Context) -> tuple[int, dict]:
    """``k`` and how it was chosen: ``methods.global_ensemble.k``, or for ``auto`` the CNN-DNN's one-device training
    time over the global CNN's (module doc), from the finished stages' ``meta.json``.

    Raises:
        FileNotFoundError: For ``auto`` before the local nets, the coarse DNN and the global CNN finished, naming them
            and the fix.
    """
    k = ctx.settings.methods.global_ensemble.k
    if k != "auto":
        return int(k), {"setting": "methods.global_ensemble.k", "k": int(k)}
    n = ctx.decomposition.num_subdomains
    missing = [f"local {i}" for i in ctx.run.missing_local(n)]
    missing += [stage for stage in ("coarse", "global") if not ctx.run.is_done(stage)]
    if missing:
        raise FileNotFoundError(
            f"methods.global_ensemble.k=auto takes k from the CNN-DNN's and the global CNN's training times, but "
            f"{missing} have not finished in {ctx.run.root}; run stage=all (or those stages) first, or set "
            f"methods.global_ensemble.k to a number."
        )
    local_s = sum(float(ctx.run.meta("local", i)["time_s"]) for i in range(n))
    coarse_s = float(ctx.run.meta("coarse")["time_s"])
    global_meta = ctx.run.meta("global")
    global_s = float(global_meta["time_s"])
    ratio = (local_s + coarse_s) / global_s if global_s > 0 else float("inf")
    k = max(2, round(ratio)) if ratio != float("inf") else 2
    rule = {
        "setting": "methods.global_ensemble.k=auto",
        "k": int(k),
        "cnn_dnn_sequential_s": local_s + coarse_s,
        "local_total_s": local_s,
        "coarse_s": coarse_s,
        "global_s": global_s,
        "ratio": ratio,
        # a global CNN copied from another run's training carries that run's clock
        **({"global_reused_from": global_meta["reused_from"].get("run_dir")} if global_meta.get("reused_from") else {}),
    }
    return int(k), rule


def train_member(ctx: Context, device, member: int) -> dict:
    """Member ``member`` of the ensemble, trained (or reused from the store, or found finished) in its folder."""
    if (done := skip(ctx, STAGE, member)) is not None:
        return done
    seed = member_seed(ctx, member)
    extra = {"member": int(member)}

    def train(published: dict) -> dict:
        return train_stage(ctx, device, STAGE, 1, {**extra, **published}, member=member, seed=seed)

    return reuse.run(ctx, STAGE, device, train, member=member)


def _members_convergence(metas: list[dict]) -> dict:
    """The ensemble's convergence record: converged when every member's training converged (the reasons by member)."""
    records = [m.get("convergence") or {} for m in metas]
    reasons = [f"member {i}: {r}" for i, rec in enumerate(records) for r in rec.get("reasons") or []]
    converged = all(bool(m.get("converged")) for m in metas)
    if not converged and not reasons:
        reasons = [f"member {i}: not converged" for i, m in enumerate(metas) if not m.get("converged")]
    # The members train as the global CNN does: the first unconverged one's cause and fix are the ensemble's.
    first = next((rec for m, rec in zip(metas, records, strict=True) if not m.get("converged")), {})
    advice = {"advice": first.get("advice") or "train the members to convergence"} if not converged else {}
    return {
        "converged": converged,
        "reasons": reasons,
        "cause": first.get("cause") if not converged else None,
        **advice,
        "epochs": max((int(rec.get("epochs") or 0) for rec in records), default=0),
        "min_epochs": max((int(rec.get("min_epochs") or 0) for rec in records), default=0),
        "stopped_by": "members",
        "lr_ratio": None,
        "train_loss_change_last3": None,
    }


def run(ctx: Context, device=None) -> dict:
    """Train (or reuse) the ``k`` members, then average their class probabilities."""
    if (done := skip(ctx, STAGE)) is not None:
        return done
    k, rule = ensemble_size(ctx)
    ctx.run.make_stage_dir(STAGE)
    log.info("global_ensemble: %d global CNNs (%s)", k, rule["setting"])
    metas = [train_member(ctx, device, i) for i in range(k)]
    start = time.perf_counter()
    x, y = coarse_inputs(ctx, "probs", source=STAGE, count=k)
    net = CoarseMLP(k, ctx.data.num_classes, hidden=(), inputs="probs", skip="mean_prob")
    with torch.no_grad():  # the averaging combiner: log of the mean probability, no weight of its own
        net.mlp[-1].weight.zero_()
        net.mlp[-1].bias.zero_()
    members_s = sum(float(m["time_s"]) for m in metas)
    result = FitResult(net, fit_time_s=members_s + (time.perf_counter() - start))
    seed = stage_seed(ctx, STAGE)
    dm = TensorDataModule(x, y, eval_batch_size=EVAL_CHUNK, seed=seed)  # predictions only
    reused = [m["reused_from"] for m in metas if m.get("reused_from")]
    meta = finish_stage(
        ctx,
        STAGE,
        net,
        dm,
        device,
        seed,
        result,
        k=k,
        k_rule=rule,
        # the parameters the ensemble holds: its members' (the averaging has none that train)
        params=sum(int(m["params"]) for m in metas),
        member_params=[int(m["params"]) for m in metas],
        member_seeds=[int(m["seed"]) for m in metas],
        member_time_s=[float(m["time_s"]) for m in metas],
        member_accuracy=[m["accuracy"] for m in metas],
        convergence=_members_convergence(metas),
        **({"reused_from": reused[0], "reused_members": len(reused)} if reused else {}),
    )
    log.info("global_ensemble (k=%d): test acc %.4f in %.1f s", k, meta["accuracy"]["test"], meta["time_s"])
    return meta
