"""The ``local_oof`` stage: out-of-fold local outputs for the coarse DNN (k-fold cross-fitting).

A local net evaluated on its own training images is more accurate and more confident than on new ones; a coarse DNN
fit on those in-sample outputs learns to trust them more than it should (in-sample bias). Cross-fitting removes
that: the training split is cut into ``methods.local_oof.folds`` stratified folds, and for each sub-domain and each
fold a local net is trained (same network, recipe and epochs as the local net; its seed shifted by the fold) on the
other folds and predicts the held-out one. Every training image then has local outputs from nets that never saw it
(``local_oof/<i>/probs_train.pt``), which the ``coarse_oof`` stage fits on.

The ``k`` trainings of a sub-domain run one after another in its folder ``local_oof/<i>/fold_<f>/`` (each resumable
from its ``last.ckpt``, each marked done); their recorded time is that of all ``k`` (``time_s``). A device that
trains local net ``i`` then trains its folds: the coarse_oof row's projected time is the slowest sub-domain's local
net plus its folds, plus the coarse DNN.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ddcnn.context import Context, build_augment, build_local_net, subdomain_seed
from ddcnn.data.datamodule import PreparedBatches, RowSubset
from ddcnn.engine.common import predict_logits, save_net
from ddcnn.engine.train import fit, seed_everything
from ddcnn.io import atomic_torch_save, load_run_file
from ddcnn.runtime import execution_context, run_generation
from ddcnn.stages.common import skip

log = logging.getLogger(__name__)

__all__ = ["run", "oof_folds"]


def oof_folds(labels: torch.Tensor, folds: int, seed: int, groups: np.ndarray | None = None) -> list[torch.Tensor]:
    """The held-out training rows of each fold: stratified, fixed by ``seed``, every row in exactly one fold; with
    ``groups`` (a patient per row) every group in one fold (scikit-learn's ``StratifiedGroupKFold``)."""
    from sklearn.model_selection import StratifiedKFold

    y = labels.numpy()
    counts = np.bincount(y)
    if folds < 2:
        raise ValueError(f"methods.local_oof.folds must be >= 2 (k-fold cross-fitting), got {folds}.")
    if groups is not None:
        from sklearn.model_selection import StratifiedGroupKFold

        n_groups = len(np.unique(groups))
        if n_groups < folds:
            raise ValueError(
                f"methods.local_oof.folds={folds} needs at least {folds} patient groups in the training split, which "
                f"holds {len(y)} samples of {n_groups} group(s); lower the folds to at most {n_groups} or add patients."
            )
        splitter = StratifiedGroupKFold(folds, shuffle=True, random_state=int(seed))
        return [torch.from_numpy(np.sort(held)) for _, held in splitter.split(np.zeros(len(y)), y, groups)]
    if counts[counts > 0].min() < folds:  # a class with fewer samples than folds: plain (shuffled) folds
        from sklearn.model_selection import KFold

        splitter = KFold(folds, shuffle=True, random_state=int(seed))
    else:
        splitter = StratifiedKFold(folds, shuffle=True, random_state=int(seed))
    return [torch.from_numpy(np.sort(held)) for _, held in splitter.split(np.zeros(len(y)), y)]


def _fold_data(ctx: Context, subdomain: int, keep: torch.Tensor, seed: int) -> RowSubset:
    """Local net ``subdomain``'s batches with only the training rows ``keep`` (validation and test as the local
    net's)."""
    full = PreparedBatches(
        ctx.data,
        ctx.settings.data.batch_size,
        seed=seed,
        box=ctx.decomposition.box(subdomain),
        augment=build_augment(ctx.settings),
    )
    return RowSubset(full, {"train": keep})


def _train_fold(ctx: Context, subdomain: int, fold: int, held: torch.Tensor, device) -> tuple[torch.Tensor, dict]:
    """Train the fold's local net (or find it done) and return its logits of the held-out rows and its record."""
    name = f"fold_{fold}"
    folder = ctx.run.stage_dir("local_oof", subdomain) / name
    done = folder / "done.pt"
    if done.is_file():
        saved = load_run_file(done)
        return saved["logits"], saved["record"]
    folder.mkdir(parents=True, exist_ok=True)
    n_train = len(ctx.data.y["train"])
    keep = torch.from_numpy(np.setdiff1d(np.arange(n_train), held.numpy()))
    seed = subdomain_seed(ctx.settings.seed, subdomain) + 104_729 * (fold + 1)
    dm = _fold_data(ctx, subdomain, keep, seed)
    start = time.perf_counter()
    seed_everything(seed)
    net = build_local_net(ctx.settings, ctx.data)
    result = fit(ctx.settings, net, dm, folder, start, seed=seed, device=device)
    predict_start = time.perf_counter()
    # The held-out rows, as the local net sees them (its view of sub-domain `subdomain`, no augmentation).
    full = _fold_data(ctx, subdomain, held, seed)
    logits, _ = predict_logits(result.net, full, "train", device)
    save_net(result.net, folder)
    record = {
        "fold": fold,
        "n_fit": len(keep),
        "n_held_out": len(held),
        "time_s": result.fit_time_s + (time.perf_counter() - predict_start),
        "fit_time_s": result.fit_time_s,
        "best_epoch": result.best_epoch,
        "held_out_accuracy": float((logits.argmax(-1) == ctx.data.y["train"][held]).float().mean()),
        "converged": result.convergence["converged"],  # docs/protocol.md, "Convergence"
        "convergence": result.convergence,
    }
    atomic_torch_save({"logits": logits, "record": record}, done)
    return logits, record


def run(ctx: Context, device=None) -> dict:
    """Out-of-fold local outputs of the training split for every sub-domain (module doc)."""
    if (done := skip(ctx, "local_oof")) is not None:
        return done
    ctx.run.make_stage_dir("local_oof")
    folds = ctx.settings.methods.local_oof.folds
    groups = ctx.data.groups["train"] if ctx.data.groups else None
    held_out = oof_folds(ctx.data.y["train"], folds, ctx.settings.data.split_seed, groups)
    n_train, n = len(ctx.data.y["train"]), ctx.decomposition.num_subdomains
    per_subdomain = []
    for i in range(n):
        if ctx.run.is_done("local_oof", i):
            per_subdomain.append(ctx.run.meta("local_oof", i))
            continue
        ctx.run.make_stage_dir("local_oof", i)
        logits = None
        records = []
        for f, held in enumerate(held_out):
            fold_logits, record = _train_fold(ctx, i, f, held, device)
            if logits is None:
                logits = torch.empty(n_train, fold_logits.shape[-1])
            logits[held] = fold_logits
            records.append(record)
            log.info(
                "local_oof %d fold %d/%d: held-out accuracy %.4f in %.1f s",
                i,
                f + 1,
                folds,
                record["held_out_accuracy"],
                record["time_s"],
            )
        labels = ctx.data.y["train"]
        folder = ctx.run.stage_dir("local_oof", i)
        atomic_torch_save({"logits": logits, "probs": logits.softmax(-1), "labels": labels}, folder / "probs_train.pt")
        meta = {
            "stage": "local_oof",
            "subdomain": i,
            "folds": records,
            "time_s": sum(r["time_s"] for r in records),
            "fit_time_s": sum(r["fit_time_s"] for r in records),
            "accuracy": {"train_out_of_fold": float((logits.argmax(-1) == labels).float().mean())},
            "converged": all(r.get("converged", False) for r in records),  # every fold's training
            "context": execution_context(device),
            "generation": run_generation(ctx.settings.run_generation),
        }
        ctx.run.mark_done("local_oof", i, meta, required=("probs_train.pt",), generation=meta["generation"])
        per_subdomain.append(meta)
    meta = {
        "stage": "local_oof",
        "folds": folds,
        "time_s": sum(m["time_s"] for m in per_subdomain),
        "fit_time_s": sum(m["fit_time_s"] for m in per_subdomain),
        "subdomain_time_s": [m["time_s"] for m in per_subdomain],
        "params": 0,
        "accuracy": {"train_out_of_fold": [m["accuracy"]["train_out_of_fold"] for m in per_subdomain]},
        "converged": all(m.get("converged", False) for m in per_subdomain),
        "context": execution_context(device),
        "generation": run_generation(ctx.settings.run_generation),
    }
    ctx.run.mark_done("local_oof", None, meta, generation=meta["generation"])
    log.info("local_oof: %d folds x %d sub-domains in %.1f s", folds, n, meta["time_s"])
    return meta
