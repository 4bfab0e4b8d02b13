"""The ``evaluate`` stage: one table of every method of a run, as ``results.json`` and ``results.md``.

Reads only the run directory and the registry's data (:mod:`ddcnn.registry`): which stages exist, what their rows
are called and which recorded times add up to each row's time. Besides the per-key dictionaries (``accuracy``,
``metrics``, ``val``, ``time_s``, ``params``), ``results.json`` holds ``methods``: one row per finished method
(:func:`method_rows`) with its test accuracy, sequential training time, projected time on the devices it can use,
speedup against the global CNN on one device and parameter count, and ``timing``: in which execution context each
time was measured and whether the compared times share one. The protocol behind every verdict (``docs/protocol.md``)
adds ``convergence`` (whether each training converged), ``train_accuracy`` (each training's accuracy on its own
training images), ``flags`` (rows a reader must not take at face value: at chance, and then whether the net did not
learn or does not generalise, far below averaging, unconverged; each local net at chance with the rows it feeds),
``time_to_target`` (time to a fixed target set by the global CNN), ``projected_time_s_by_devices`` and
``speedup_equal_devices`` (the CNN-DNN on 1, 2 and N devices against a baseline on as many). The comparison report
across runs (:mod:`ddcnn.report.compare`) reads those rows.
"""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ddcnn import registry
from ddcnn.io import atomic_write_json, atomic_write_text, load_run_file
from ddcnn.metrics import at_chance, decides_constant, majority_rate, near_chance
from ddcnn.registry import ResultRow
from ddcnn.report.combiners import majority_vote, mean_probability
from ddcnn.report.curves import (
    held_out_target,
    makespan_by_devices,
    run_curves,
    speedup_at_equal_accuracy,
    target_accuracy,
    time_to_target,
)
from ddcnn.report.stats import BASELINE_NOT_CONVERGED, PAIRS, image_paired_difference
from ddcnn.rundir import TARGET_SPLIT

if TYPE_CHECKING:
    from ddcnn.settings import RunSettings

log = logging.getLogger(__name__)

__all__ = [
    "METHODS",
    "COMBINER_ROWS",
    "TIMING_RULE",
    "classification_metrics",
    "evaluate_run",
    "method_rows",
    "results_markdown",
    "timing_contexts",
    "flag_rows",
    "flag_lines",
    "training_accuracy",
    "convergence_of",
    "row_trainings",
    "image_pairs",
]

# Stages that combine the saved local outputs (their parameters add to the local nets').
COMBINER_STAGES = ("coarse", "coarse_alt", "coarse_oof", "coarse_val", "stacker")

# The cheap combiners of the local outputs: rows of the table that no stage trains.
COMBINER_ROWS = (
    ResultRow("mean_prob", "mean probability", ("local_total",), ("local_max",), "N", 1),
    ResultRow("majority_vote", "majority vote", ("local_total",), ("local_max",), "N", 2),
)


def _table_rows() -> list[tuple[str | None, ResultRow]]:
    """``(stage, row)`` of every row the table can have, in table order (combiners have no stage)."""
    rows = [(s.name, s.row) for s in registry.STAGES if s.row is not None] + [(None, r) for r in COMBINER_ROWS]
    return sorted(rows, key=lambda sr: sr[1].order)


def _method_names() -> dict[str, str]:
    names: dict[str, str] = {}
    for _, row in _table_rows():
        if "{input}" in row.key:
            for kind in ("probs", "logits"):
                names[row.key.format(input=kind)] = row.name.format(input=kind)
        else:
            names[row.key] = row.name
    return names


# Every method a run can report, in table order: key -> display name (from the registry and the combiners).
METHODS: dict[str, str] = _method_names()

# How every time in the table is measured: the footnote of results.md and of ddcnn-report's tables.
TIMING_RULE = (
    "Times: a stage's time runs from its start in a process that has the data in memory, through training, to its "
    "saved predictions, summed over every process that worked on it (a resumed stage adds the time of the earlier "
    "ones up to their last checkpoint). Left out of every method alike and recorded apart: process start-up "
    "(interpreter, imports, data loading, spawning DDP ranks or worker processes, the DDP rendezvous: startup_s, "
    "parallel.json) and the device warm-up (one untimed training step and evaluation batch before the clock: "
    "warmup_s). Projected times assume one device per local net."
)

# The fields of a stage's recorded context that must agree for two of its times to be comparable. Device kind (not
# the index: two workers on cuda:0 and cuda:1 of one model are alike), device count, threads, trainings side by side,
# the machine (its name and the CPU instructions torch's kernels used: a run resumed on another machine of the same
# name), how its host allocator treated freed memory (ddcnn.runtime.host_allocator) and the code that was timed. The
# load is compared apart (_load_differences): it is a number, not a label.
CONTEXT_KEYS = (
    "device_kind",
    "num_devices",
    "torch_threads",
    "concurrent_trainings",
    "host",
    "cpu_capability",
    "host_allocator",
    "code",
)
# Stages whose device count is part of the method (DDP on P devices): each of its devices (a rank, its threads) is
# compared with the one device of the others; equal device counts are the business of speedup_equal_devices.
_MULTI_DEVICE_STAGES = ("global_ddp",)


def _context_value(context: dict, field: str):
    if field == "device_kind" and "device_kind" not in context:  # recorded before device_kind existed
        device = str(context.get("device") or "cpu")
        return device.split(":")[0] if not context.get("device_name") else f"cuda ({context['device_name']})"
    if field == "num_devices":
        return context.get("num_devices", 1)
    return context.get(field)


def _devices_line(kinds: dict[str, str]) -> str:
    """Which kind of device the stages trained on: one kind, or each kind with its stages (a mixed table)."""
    by_kind: dict[str, list[str]] = {}
    for stage, kind in kinds.items():
        by_kind.setdefault(kind, []).append(stage)
    if len(by_kind) <= 1:
        return f"- Device: every stage trained on {next(iter(by_kind), 'cpu')}."
    parts = "; ".join(f"{kind}: {', '.join(stages)}" for kind, stages in sorted(by_kind.items()))
    return f"- **Devices of different kinds** ({parts}): the rows' times are not comparable across kinds."


def classification_metrics(
    pred: torch.Tensor, labels: torch.Tensor, scores: torch.Tensor | None, num_classes: int
) -> dict:
    """Accuracy, balanced accuracy, the share of the decisions on one class and (when scores are given and both
    classes occur) ROC AUC.

    For two classes the AUC uses the score of class 1; for more it is the one-vs-rest macro average.
    """
    from sklearn.metrics import balanced_accuracy_score, roc_auc_score

    y, p = labels.numpy(), pred.numpy()
    out: dict[str, float | None] = {
        "accuracy": float((p == y).mean()),
        "balanced_accuracy": float(balanced_accuracy_score(y, p)),
        "auc": None,
        # the share of the decisions on the class decided most often (1.0: a constant decision)
        "decision_share": float(np.bincount(p.astype(np.int64), minlength=num_classes).max() / max(len(p), 1)),
    }
    if scores is not None and len(np.unique(y)) == num_classes:
        s = scores.double().numpy()
        try:
            if num_classes == 2:
                out["auc"] = float(roc_auc_score(y, s[:, 1]))
            else:
                s = s / s.sum(axis=1, keepdims=True).clip(min=1e-12)
                out["auc"] = float(roc_auc_score(y, s, multi_class="ovr", average="macro"))
        except ValueError:
            out["auc"] = None
    return out


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _excess_load(context: dict) -> float | None:
    """The machine's 1-minute load average when the time was recorded, less the load the stage itself puts on it
    (its threads, times the trainings of its run side by side, times its devices): what else was running."""
    load = context.get("load_avg")
    if not load:
        return None
    own = int(context.get("torch_threads") or 1) * int(context.get("concurrent_trainings") or 1)
    own *= int(context.get("num_devices") or 1)
    return max(0.0, float(load[0]) - min(own, int(context.get("cpu_count") or own)))


def load_tolerance(contexts: Mapping[str, dict]) -> float:
    """How far two stages' excess loads may differ and still count as one condition: one core, or a quarter of the
    machine's cores if that is more (the 1-minute load average itself moves by about that on a quiet machine)."""
    cores = max((int(c.get("cpu_count") or 1) for c in contexts.values()), default=1)
    return max(1.0, 0.25 * cores)


def _load_differences(contexts: Mapping[str, dict]) -> dict[str, list[str]] | None:
    loads = {k: _excess_load(c) for k, c in contexts.items()}
    known = {k: v for k, v in loads.items() if v is not None}
    if len(known) < 2 or max(known.values()) - min(known.values()) <= load_tolerance(contexts):
        return None
    values: dict[str, list[str]] = {}
    for stage, v in known.items():
        values.setdefault(f"{v:.1f} besides its own", []).append(stage)
    return values


def timing_contexts(contexts: dict[str, dict | None], reused: Mapping[str, dict] | None = None) -> dict:
    """Whether the times of ``contexts`` (stage -> recorded context) were measured alike: same device kind, device
    count, threads, trainings side by side, host, CPU instructions and code, a like load (:func:`_excess_load` within
    :func:`load_tolerance`), and none copied from another run's training (``reused``: stage -> its ``reused_from``),
    except for threads a stage records as chosen by design (``threads_by_design``, the coarse DNN's
    ``coarse.num_threads``) and the device count of a method that trains on several devices (DDP: each rank is
    compared with the others' one device).

    Returns:
        ``{"contexts": {stage: {...}}, "comparable": bool, "differences": {key: {value: [stages]}}}``; stages without
        a recorded context (older runs) are listed under ``unknown``. ``differences`` may hold ``load`` and ``reused``
        besides the context fields.
    """
    known = {k: {f: _context_value(c, f) for f in CONTEXT_KEYS} for k, c in contexts.items() if c}
    by_design = {k for k, c in contexts.items() if c and c.get("threads_by_design")}
    for stage in _MULTI_DEVICE_STAGES:
        if stage in known:
            known[stage].pop("num_devices")  # its P devices are the method's; each is compared like one device
    differences: dict[str, dict[str, list[str]]] = {}
    for field in CONTEXT_KEYS:
        values: dict[str, list[str]] = {}
        for stage, c in known.items():
            if field not in c or (field == "torch_threads" and stage in by_design):
                continue  # chosen as part of the method (the coarse DNN's coarse.num_threads), not a difference
            values.setdefault(str(c[field]), []).append(stage)
        if len(values) > 1:
            differences[field] = values
    load = _load_differences({k: c for k, c in contexts.items() if c})
    if load:
        differences["load"] = load
    copied = {s: r for s, r in (reused or {}).items() if s in contexts}
    if copied:
        values = {}
        for stage, source in copied.items():
            values.setdefault(f"trained by {source.get('run_dir') or 'another run'}", []).append(stage)
        if here := [s for s in contexts if s not in copied]:
            values["trained in this run"] = here
        differences["reused"] = values
    unknown = sorted(k for k, c in contexts.items() if not c)
    loads = {k: _excess_load(c) for k, c in contexts.items() if c}
    return {
        "contexts": known,
        "comparable": not differences,
        "differences": differences,
        "unknown": unknown,
        "excess_load": loads,
    }


def _context_note(timing: dict | None) -> str | None:
    if not timing or timing.get("comparable", True):
        return None
    parts = []
    for field, values in timing["differences"].items():
        parts.append(f"{field}: " + "; ".join(f"{v} ({', '.join(_short(s))})" for v, s in values.items()))
    return (
        "- **The compared times come from different execution contexts** (" + " | ".join(parts) + "): speedups "
        "mix them; rerun the stages in one context for a like-for-like comparison."
    )


def _short(stages: list[str]) -> list[str]:
    local = [s for s in stages if s.startswith("local ")]
    others = [s for s in stages if not s.startswith("local ")]
    return ([f"{len(local)} local nets"] if len(local) > 1 else local) + others


# How far below the averaging combiner a combiner of the local nets may fall before it is flagged: 3 points, or
# 3 standard errors of an accuracy on the test split if that is more.
_BELOW_AVERAGING = 0.03


def convergence_of(meta: Mapping[str, Any]) -> dict:
    """Whether one training converged, from its ``meta.json``: ``converged`` (``True``, ``False`` or ``None``: not
    recorded, a run of an older ddcnn), the ``reasons`` it did not, and how it ended (``stopped_by``:
    ``early_stopping`` when early stopping ended it, else ``budget``, unless the record says otherwise) and the
    epochs it trained (``epochs``, where recorded)."""
    record = meta.get("convergence") or {}
    converged = meta.get("converged", record.get("converged"))
    stopped_by = record.get("stopped_by") or ("early_stopping" if meta.get("stopped_epoch") is not None else "budget")
    return {
        "converged": None if converged is None else bool(converged),
        "reasons": [str(r) for r in record.get("reasons") or []],
        "stopped_by": stopped_by,
        **({"epochs": int(record["epochs"])} if record.get("epochs") else {}),
        **({"cause": record["cause"]} if record.get("cause") else {}),
        **({"advice": str(record["advice"])} if record.get("advice") else {}),
    }


def row_trainings(stage: str | None) -> tuple[str, ...]:
    """The trainings a results row builds on (stage names; ``local`` stands for every local net): its own stage and
    those its registry row adds up (the CNN-DNN: the local nets and the coarse DNN). Combiners: the local nets."""
    if stage is None:
        return ("local",)
    row = registry.get(stage).row if stage in registry.STAGE_NAMES else None
    terms = (row.sequential or row.projected) if row is not None else (stage,)
    out: list[str] = []
    for term in (*terms, stage):
        if term in ("local_total", "local_max"):
            out.append("local")
        elif term == "local_oof_max":
            out += ["local", "local_oof"]
        else:
            out.append(term)
    return tuple(dict.fromkeys(out))


def _unconverged_records(results: Mapping[str, Any], stage: str | None) -> list[tuple[str, Mapping[str, Any]]]:
    """``(training in words, record)`` of each training behind ``stage``'s row that did not converge."""
    convergence = results.get("convergence") or {}
    out = []
    for training in row_trainings(stage):
        records = convergence.get(training)
        if records is None:
            continue
        if training == "local" and isinstance(records, list):
            named = [(f"local net {i}", r) for i, r in enumerate(records)]
        else:
            named = [(training if training != "global" else "global CNN", records)]
        out += [(what, record) for what, record in named if record and record.get("converged") is False]
    return out


def _unconverged_advice(results: Mapping[str, Any], stage: str | None) -> str:
    """What to try for ``stage``'s unconverged trainings: each one's recorded cause and fix (the engine's
    ``convergence_advice``, saved in its record), the same fix once; the general advice for records without one (an
    older ddcnn)."""
    advice: dict[str, list[str]] = {}
    for what, record in _unconverged_records(results, stage):
        if not record.get("advice"):
            return _UNCONVERGED_TRY
        advice.setdefault(str(record["advice"]), []).append(what)
    if not advice:
        return _UNCONVERGED_TRY
    if len(advice) == 1:
        return f"Try: {next(iter(advice))}. Until then no verdict against it holds."
    parts = [f"{', '.join(whats)}: {fix}" for fix, whats in advice.items()]
    return "Try: " + "; ".join(parts) + ". Until then no verdict against it holds."


def _converged_cell(results: Mapping[str, Any], stage: str | None) -> str:
    """``results.md``'s converged cell of a row not flagged unconverged: ``yes`` when every training behind it
    recorded convergence, ``unknown`` when one did not record it (an older ddcnn, or a row of no training), or of a
    single training (``local/<i>``)."""
    convergence = results.get("convergence") or {}
    if stage is not None and stage.startswith("local/"):
        records = convergence.get("local") or []
        i = int(stage.split("/", 1)[1])
        state = records[i].get("converged") if i < len(records) and records[i] else None
        return {True: "yes", False: "**no**", None: "unknown"}[state]
    states = []
    for training in row_trainings(stage):
        records = convergence.get(training)
        records = records if isinstance(records, list) else [records]
        states += [r.get("converged") if isinstance(r, Mapping) else None for r in records]
    return "yes" if states and all(state is True for state in states) else "unknown"


def baseline_converged(results: Mapping[str, Any], stage: str = "global") -> bool | None:
    """Whether the training of ``stage`` converged (``None``: not recorded or not finished)."""
    record = (results.get("convergence") or {}).get(stage)
    return None if not isinstance(record, Mapping) else record.get("converged")


_UNCONVERGED_TRY = (
    "Train it to convergence (docs/protocol.md, Convergence): a larger trainer.max_epochs (coarse.max_epochs for the "
    "coarse DNN), early stopping that waits longer (engine.patience, coarse.patience); the convergence record in its "
    "meta.json says which test failed. Until then no verdict against it holds."
)


def training_accuracy(folder: Path, meta: Mapping[str, Any]) -> dict:
    """What one training recorded of its accuracy on its own training images.

    Args:
        folder: The training's stage folder (its ``logs/metrics.csv``).
        meta: Its ``meta.json``.

    Returns:
        ``{"epochs", "selected"}``: the highest per-epoch ``train_acc`` of ``logs/metrics.csv`` (in training mode:
        dropout, batch statistics and augmentation on, averaged over the epoch's batches) and ``meta.json``
        ``accuracy.train`` (the selected weights in evaluation mode, the weights its test accuracy is of); ``None``
        where the training did not record it.
    """
    best = None
    path = Path(folder) / "logs" / "metrics.csv"
    if path.is_file():
        with open(path, newline="") as fh:
            values = [float(row["train_acc"]) for row in csv.DictReader(fh) if row.get("train_acc") not in (None, "")]
        best = max(values) if values else None
    selected = (meta.get("accuracy") or {}).get("train") if isinstance(meta.get("accuracy"), Mapping) else None
    return {"epochs": best, "selected": None if selected is None else float(selected)}


# What to try for a row at chance, by what its training accuracy says (:func:`_learning`).
_DID_NOT_LEARN_TRY = (
    "It did not learn: lower optimizer.lr, train longer (trainer.max_epochs) and check the labels and data.num_classes."
)
_COARSE_DID_NOT_LEARN_TRY = (
    "The coarse DNN did not learn: read the fit record in its meta.json (kept, restarts, refits); the default "
    "coarse.net (input_norm=standardize, skip=mean_prob) cannot end below averaging the local nets."
)
_LOCAL_DID_NOT_LEARN_TRY = (
    "The local net did not learn: its sub-domain may hold too little of the image to tell the classes apart (a "
    "larger decomposition.overlap or a coarser decomposition.grid gives it more), or its training failed (lower "
    "optimizer.lr, train longer: trainer.max_epochs); the rows it feeds average it in."
)
_DOES_NOT_GENERALISE_TRY = (
    "It fits its training images but not new ones: check that the validation and test images are like the training "
    "images (same source, preprocessing and classes; RUN_DIR/splits.csv lists which image is in which split), then "
    "regularise: augmentation (data.augment), weight decay (optimizer.weight_decay), a smaller or pretrained network "
    "(model.weights). A network with batch normalisation whose selected weights score far lower on their own training "
    "images in evaluation mode than in training mode has batch statistics that do not carry over to evaluation."
)
_UNKNOWN_LEARNING_TRY = (
    "No training accuracy was recorded (logs/metrics.csv train_acc, meta.json accuracy.train), so whether it did not "
    "learn or does not generalise cannot be told: lower optimizer.lr, train longer (trainer.max_epochs), check the "
    "labels and data.num_classes, and retrain with this ddcnn to record it."
)


def _percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def _learning(
    results: Mapping[str, Any], figures: Mapping[str, Any] | None, test_acc: float, rate: float, n_test: int
) -> dict:
    """Whether a training at chance on test did not learn or does not generalise, from its training accuracy
    (``figures``: :func:`training_accuracy`): ``did not learn`` only when every recorded training accuracy is within
    noise of the training split's majority-class rate too; else ``does not generalise``, with the gap in points
    (training minus test accuracy); ``unknown`` when no training accuracy was recorded. The training split's
    majority-class rate and size (``results["train_majority_rate"]``, ``data.n_train``) decide; a results dict without
    them (an older ddcnn's) is judged by the test split's ``rate`` and ``n_test``.

    Returns:
        ``{"state", "text", "train_accuracy", "gap_points"}``; ``text`` is what ``results.md`` prints.
    """
    figures = figures or {}
    known = {k: float(v) for k, v in figures.items() if v is not None and math.isfinite(float(v))}
    if not known:
        return {
            "state": "unknown",
            "text": "no training accuracy was recorded, so whether it did not learn or does not generalise is unknown",
            "train_accuracy": None,
            "gap_points": None,
        }
    train_rate = results.get("train_majority_rate")
    n_train = (results.get("data") or {}).get("n_train")
    rate, n = (float(train_rate), int(n_train)) if train_rate is not None and n_train else (float(rate), int(n_test))
    best = max(known.values())
    if near_chance(best, rate, n):
        return {
            "state": "did not learn",
            "text": f"did not learn (training accuracy at most {_percent(best)}, at chance too: majority-class rate "
            f"{_percent(rate)})",
            "train_accuracy": best,
            "gap_points": None,
        }
    # The selected weights in evaluation mode are the weights the test accuracy is of: their training accuracy is
    # the gap's, unless only the training-mode figure rose above chance (then it says so).
    selected, epochs = known.get("selected"), known.get("epochs")
    above = selected is None or not near_chance(selected, rate, n)
    train = selected if selected is not None and above else best
    gap = 100 * (train - test_acc)
    text = f"does not generalise (training {_percent(train)} vs test {_percent(test_acc)}: a gap of {gap:.1f} points)"
    if train != selected and selected is not None:
        text += (
            f"; that training accuracy is the best epoch's in training mode (logs/metrics.csv), its selected weights "
            f"score {_percent(selected)} on the training images in evaluation mode"
        )
    elif train == selected and epochs is not None and epochs > selected + 0.1:
        text += f" (in training mode its best epoch reached {_percent(epochs)})"
    return {"state": "does not generalise", "text": text, "train_accuracy": train, "gap_points": gap}


def _chance_also(auc: float | None, balanced: float | None) -> str:
    if auc is not None:
        return f" and its AUC {auc:.4f} is within noise of 0.5"
    if balanced is not None:
        return f" and its balanced accuracy {balanced:.4f} is within noise of 1/K"
    return ""


def _local_chance_flags(results: Mapping[str, Any], rate: float, counts: Sequence[int]) -> list[dict]:
    """A local net at chance on test (:func:`~ddcnn.metrics.at_chance`, as a row is): its index, test and
    validation accuracy, the majority-class rate, whether it did not learn or does not generalise, and the rows that
    average it in."""
    metrics = results.get("metrics") or {}
    val = ((results.get("val") or {}).get("accuracy") or {}).get("local") or []
    trained = (results.get("train_accuracy") or {}).get("local") or []
    # the rows built on the local nets (the combiners, the CNN-DNNs)
    fed = [row for row in results.get("methods") or [] if "local" in row_trainings(row.get("stage"))]
    flags = []
    for i, r in enumerate(metrics.get("local") or []):
        acc, auc, balanced = r["accuracy"], r.get("auc"), r.get("balanced_accuracy")
        if not at_chance(acc, rate, counts, auc=auc, balanced_accuracy=balanced):
            continue
        learning = _learning(results, trained[i] if i < len(trained) else None, acc, rate, sum(counts))
        val_acc = val[i] if i < len(val) else None
        on_val = f" (validation {val_acc:.4f})" if val_acc is not None else ""
        reason = (
            f"test accuracy {acc:.4f}{on_val} is at chance (majority-class rate {rate:.4f})"
            f"{_chance_also(auc, balanced)}; {learning['text']}"
        )
        feeds = f"{len(fed)} row{'s' if len(fed) != 1 else ''}" + (
            ": " + _bold([r["name"] for r in fed]) if fed else ""
        )
        try_ = _LOCAL_DID_NOT_LEARN_TRY if learning["state"] != "does not generalise" else _DOES_NOT_GENERALISE_TRY
        flags.append(
            {
                "method": f"local/{i}",
                "kind": "chance",
                "subdomain": i,
                "accuracy": acc,
                "val_accuracy": val_acc,
                "majority_rate": rate,
                "learning": learning["state"],
                "train_accuracy": learning["train_accuracy"],
                "gap_points": learning["gap_points"],
                "feeds": [row["key"] for row in fed],
                "reason": f"{reason}. It feeds {feeds}",
                "message": f"local net {i}: {reason}. It feeds {feeds}.",
                "try": try_,
            }
        )
    return flags


def _unconverged_reason(whats: Sequence[str], stage: str | None) -> str:
    """A row's short reason for its unconverged flag (``whats``: the unconverged trainings behind it): its own
    training, and the trainings it builds on."""
    own = "global CNN" if stage == "global" else stage
    others = [w for w in whats if w != own]
    if not others:
        return "its own training"
    return f"built on {_names(others)}" + (" and its own training" if own in whats else "")


def flag_rows(results: dict, rate: float, counts: Sequence[int]) -> list[dict]:
    """Rows a reader must not take at face value: built on a training that did not converge (``unconverged``: its own,
    or any it builds on: for the CNN-DNN any local net or the coarse DNN; ``results["convergence"]``), at chance
    (every figure of the row within noise of a guess unrelated to the labels: accuracy against the majority-class
    ``rate``, then ROC AUC against 0.5 or balanced accuracy against ``1/K``; see :func:`ddcnn.metrics.at_chance`), or
    a combiner of the local nets far below averaging them; and each local net at chance (``method`` ``local/<i>``,
    with the rows it feeds). ``counts`` are the test split's class sizes.

    A row at chance "did not learn" only when its training accuracy (``results["train_accuracy"]``) stayed at chance
    too; otherwise it "does not generalise", with the gap between its training and test accuracy.

    Each flag has ``method``, ``kind``, ``message`` (the whole finding, for the log), ``reason`` (the row's own part
    of it, which ``results.md`` lists under the explanation of its kind, :func:`flag_lines`) and ``try``."""
    flags = []
    n_test = sum(int(c) for c in counts)
    mean = (results.get("accuracy") or {}).get("mean_prob")
    trained = results.get("train_accuracy") or {}
    for row in results.get("methods") or []:
        acc, key, name = row["accuracy"], row["key"], row["name"]
        if unconverged := _unconverged_records(results, row.get("stage")):
            whats = [what for what, _ in unconverged]
            reasons = [(what, "; ".join(r.get("reasons") or [])) for what, r in unconverged]
            described = [what + (f" ({text})" if text else "") for what, text in reasons]  # local net 2 (stopped ...)
            flags.append(
                {
                    "method": key,
                    "kind": "unconverged",
                    "trainings": whats,
                    "reason": _unconverged_reason(whats, row.get("stage")),
                    "message": f"{name}: trained without converging: {', '.join(described)}.",
                    "try": _unconverged_advice(results, row.get("stage")),
                }
            )
        auc, balanced = row.get("auc"), row.get("balanced_accuracy")
        coarse = row.get("stage") in COMBINER_STAGES
        if at_chance(acc, rate, counts, auc=auc, balanced_accuracy=balanced):
            learning = _learning(results, trained.get(key), acc, rate, n_test)
            if learning["state"] == "does not generalise":
                hint = _DOES_NOT_GENERALISE_TRY
            elif learning["state"] == "unknown":
                hint = _UNKNOWN_LEARNING_TRY
            else:
                hint = _COARSE_DID_NOT_LEARN_TRY if coarse else _DID_NOT_LEARN_TRY
            reason = (
                f"test accuracy {acc:.4f} is at chance (majority-class rate {rate:.4f}){_chance_also(auc, balanced)}; "
                f"{learning['text']}"
            )
            flags.append(
                {
                    "method": key,
                    "kind": "chance",
                    "learning": learning["state"],
                    "train_accuracy": learning["train_accuracy"],
                    "gap_points": learning["gap_points"],
                    "reason": reason,
                    "message": f"{name}: {reason}.",
                    "try": hint,
                }
            )
            continue
        share = row.get("decision_share")
        if decides_constant(acc, rate, counts, auc=auc, decision_share=share):
            reason = (
                f"{100 * share:.1f}% of its test decisions are one class and its test accuracy {acc:.4f} is within "
                f"noise of the majority-class rate {rate:.4f}, though its AUC {auc:.4f} ranks the classes"
            )
            flags.append(
                {
                    "method": key,
                    "kind": "constant",
                    "reason": reason,
                    "message": f"{name}: {reason}: it decides like a constant guess.",
                    "try": _constant_try(results, row.get("stage")),
                }
            )
            continue
        se = math.sqrt(max(acc * (1 - acc), 1e-6) / max(n_test, 1))
        if coarse and mean is not None and acc < mean - max(_BELOW_AVERAGING, 3 * se):
            flags.append(
                {
                    "method": key,
                    "kind": "below_averaging",
                    "reason": f"test accuracy {acc:.4f}, averaging the local nets {mean:.4f}",
                    "message": f"{name}: test accuracy {acc:.4f} is far below averaging the local nets ({mean:.4f}).",
                    "try": _below_averaging_try(results, row.get("stage")),
                }
            )
    return flags + _local_chance_flags(results, rate, counts)


def _constant_try(results: Mapping[str, Any], stage: str | None) -> str:
    """What to try for a row that ranks the classes but decides like a constant guess: train it longer, by what
    ended its training (early stopping: a longer patience; the budget: twice its epochs); a row without a training of
    its own (a combiner) is read on its AUC until its local nets decide."""
    record = (results.get("convergence") or {}).get(stage or "")
    record = record if isinstance(record, Mapping) else {}
    epochs = int(record.get("epochs") or 0)
    if record.get("stopped_by") == "early_stopping" and epochs:
        longer = (
            f"early stopping ended it after {epochs} epochs: engine.patience=12 lets it train past a flat "
            "validation loss"
        )
    elif epochs:
        longer = f"trainer.max_epochs={2 * epochs} (twice its {epochs} epochs)"
    else:
        longer = "the trainings it is built on (trainer.max_epochs, engine.patience)"
    return (
        f"Its scores order the images but its decisions do not follow them yet: train longer ({longer}); until then "
        "compare it on its AUC."
    )


def _names(whats: Sequence[str]) -> str:
    """``local net 0, local net 1, global CNN`` as ``local nets 0, 1 and global CNN``."""
    local = [w.removeprefix("local net ") for w in whats if w.startswith("local net ")]
    others = [w for w in whats if not w.startswith("local net ")]
    parts = [f"local net{'s' if len(local) > 1 else ''} {', '.join(local)}"] if local else []
    return " and ".join(parts + others)


# How results.md explains each kind of flag, once: what it means and what follows from it.
_FLAG_KINDS = {
    "unconverged": (
        "Trained without converging",
        "a row built on a training that did not converge is not a baseline (docs/protocol.md, Convergence); no verdict "
        "against it holds until that training converges.",
    ),
    "chance": (
        "At chance",
        "every figure within noise of a guess unrelated to the labels (accuracy against the majority-class rate, then "
        'ROC AUC against 0.5 or balanced accuracy against 1/K). A net at chance on test "did not learn" only when '
        'its training accuracy stayed at chance too; otherwise it "does not generalise".',
    ),
    "constant": (
        "Decides like a constant guess",
        "its scores rank the classes (ROC AUC clearly above 0.5), yet at least 98% of its decisions are one class and "
        "its accuracy is within noise of the majority-class rate. Its accuracy says no more than always answering "
        "that class does, so no verdict on accuracy against it is given (results.json keeps the figures); read its "
        "AUC.",
    ),
    "below_averaging": (
        "Far below averaging the local nets",
        "a combiner of the local nets that ends more than 3 points (or 3 standard errors) below their mean probability "
        "does worse than the combiner that needs no training.",
    ),
}


def _grouped(pairs: Sequence[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """``(name, text)`` pairs as ``([names], text)``, one entry per distinct text, in first-seen order."""
    out: dict[str, list[str]] = {}
    for name, text in pairs:
        out.setdefault(text, []).append(name)
    return [(names, text) for text, names in out.items()]


def _row_names(results: Mapping[str, Any]) -> dict[str, str]:
    names = {row["key"]: row["name"] for row in results.get("methods") or []}
    n = len((results.get("metrics") or {}).get("local") or [])
    names.update({f"local/{i}": f"local net {i}" for i in range(n)})
    return names


def _unconverged_lines(results: Mapping[str, Any], flags: Sequence[Mapping[str, Any]], names: Mapping) -> list[str]:
    """The unconverged trainings once each (why, and what to try), then the rows built on them."""
    stages = {row["key"]: row.get("stage") for row in results.get("methods") or []}
    trainings: dict[str, Mapping[str, Any]] = {}
    for flag in flags:
        for what, record in _unconverged_records(results, stages.get(flag["method"])):
            trainings.setdefault(what, record)
    lines = []
    for what, record in trainings.items():
        reasons = "; ".join(record.get("reasons") or []) or "not converged (no reason recorded)"
        lines.append(f"- {what} did not converge: {reasons}.")
    advice = [(what, str(record.get("advice") or "")) for what, record in trainings.items()]
    if not trainings or any(not text for _, text in advice):
        lines.append(f"- Try: {_UNCONVERGED_TRY}")
    else:
        groups = _grouped(advice)
        if len(groups) == 1:
            lines.append(f"- Try: {groups[0][1]}.")
        else:
            lines.append("- Try: " + "; ".join(f"{_names(whats)}: {text}" for whats, text in groups) + ".")
    return lines + _row_lines(flags, names)


def _row_lines(flags: Sequence[Mapping[str, Any]], names: Mapping[str, str]) -> list[str]:
    """One line per reason with the rows whose reason it is (their names in bold: a name may hold a comma)."""
    rows = _grouped([(names.get(f["method"], f["method"]), f.get("reason") or f["message"]) for f in flags])
    return [f"- {_bold(row_names)}: {reason}." for row_names, reason in rows]


def _bold(row_names: Sequence[str]) -> str:
    return ", ".join(f"**{name}**" for name in row_names)


def flag_lines(results: Mapping[str, Any]) -> list[str]:
    """``results.md``'s section on its flags: each kind explained once, each flagged row with its own reason, each
    fix once with the rows (or trainings) it is for; nothing when nothing is flagged."""
    flags = list(results.get("flags") or [])
    if not flags:
        return []
    names = _row_names(results)
    lines = ["", "## Check these rows", ""]
    kinds = list(dict.fromkeys([*_FLAG_KINDS, *(f["kind"] for f in flags)]))
    for kind in kinds:
        of_kind = [f for f in flags if f["kind"] == kind]
        if not of_kind:
            continue
        title, explanation = _FLAG_KINDS.get(kind, (kind, ""))
        lines.append(f"**{title}**" + (f": {explanation}" if explanation else ""))
        lines.append("")
        if kind == "unconverged" and all("trainings" in f for f in of_kind):
            lines += _unconverged_lines(results, of_kind, names)
        else:
            lines += _row_lines(of_kind, names)
            tries = _grouped([(names.get(f["method"], f["method"]), f["try"]) for f in of_kind])
            if len(tries) == 1:
                lines.append(f"- Try: {tries[0][1]}")
            else:
                lines += [f"- Try, for {_bold(row_names)}: {text}" for row_names, text in tries]
        lines.append("")
    return lines[:-1]


# The default coarse net's parts that keep it at or above averaging the local nets on validation (conf/coarse/mlp.yaml).
_DEFAULT_COARSE_NET = {"input_norm": "standardize", "skip": "mean_prob"}


def _below_averaging_try(results: Mapping[str, Any], stage: str | None) -> str:
    """What to try for a combiner far below averaging, by what was in use: the convex stacker has no coarse net; a
    coarse DNN that is not the default net is pointed to it; the default net is not advised again."""
    if stage == "stacker":
        return (
            "The convex stacker (logistic regression, its L2 strength chosen on validation) has no coarse net to "
            "change: its fit did worse than averaging on test, so read the mean-probability row as this run's "
            "combiner of the local nets."
        )
    net = (results.get("coarse_nets") or {}).get(stage or "")
    if isinstance(net, Mapping) and all(net.get(key) == value for key, value in _DEFAULT_COARSE_NET.items()):
        return (
            "The default coarse.net (input_norm=standardize, skip=mean_prob) was in use and its selection on "
            "validation still fell below averaging on test: select on the validation loss, coarse.monitor=val_loss."
        )
    return (
        "Use the default coarse.net (its averaging skip keeps it at or above averaging on validation): "
        "coarse.net.input_norm=standardize coarse.net.skip=mean_prob."
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _baseline_state(results: Mapping[str, Any], stage: str = "global") -> str | None:
    """``None`` for a converged baseline, else what a verdict against it must say instead of a lead."""
    converged = baseline_converged(results, stage)
    return {True: None, False: "baseline not converged", None: "convergence unknown"}[converged]


def _by_devices_lines(results: Mapping[str, Any]) -> list[str]:
    by_devices = results.get("projected_time_s_by_devices")
    if not by_devices:
        return []
    n = results["decomposition"]["num_subdomains"]
    times = "; ".join(f"{p} device{'s' if int(p) > 1 else ''}: {_seconds(v)}" for p, v in by_devices.items())
    lines = [
        f"- Projected CNN-DNN time on P devices (its {n} local nets placed longest first on P devices from their "
        f"recorded times, then the coarse DNN): {times}."
    ]
    speedups = results.get("speedup_equal_devices") or {}
    parts = []
    for p in by_devices:
        e = speedups.get(p)
        if e is None:
            parts.append(f"{p} devices: no baseline ran on {p} devices (global_ddp on {p} would give one)")
            continue
        name = "global CNN" if e["baseline"] == "global" else f"global CNN, DDP on {p} devices"
        lead = f"{e['speedup']:.2f}x"
        baseline = _baseline_state(results, e["baseline"])
        if baseline == "baseline not converged":
            lead = "baseline not converged (no speedup against it is given)"  # the figure stays in results.json
        elif baseline:
            lead = f"{lead}, {baseline}"
        parts.append(
            f"{p} device{'s' if int(p) > 1 else ''}: {name} {_seconds(e['baseline_s'])} / CNN-DNN "
            f"{_seconds(e['cnn_dnn_s'])}: {lead}"
        )
    if parts:
        comparable = (results.get("timing") or {}).get("comparable", True)
        lines.append(
            "- Speedup at equal devices (baseline time / CNN-DNN time on as many devices): "
            + "; ".join(parts)
            + "."
            + ("" if comparable else " **Timed under different conditions** (below): not a like-for-like comparison.")
        )
    return lines


def _time_to_target_line(results: Mapping[str, Any], key: str = "time_to_target") -> str | None:
    ttt = results.get(key)
    if not ttt:
        return None
    reverse = key == "time_to_target_reverse"
    target = ttt["target"]
    parts = []
    for key, e in ttt.items():
        if key in ("target", "comparable"):
            continue
        name = METHODS.get(key, "CNN-DNN" if key == "cnn_dnn" else key)
        devices = e.get("devices")
        on = f" on {devices} device{'s' if devices and devices > 1 else ''}" if devices else ""
        if e["reached"]:
            text = f"{name} {_seconds(e['time_s'])}{on} (epoch {e['epoch']})"
            by = e.get("time_s_by_devices")
            if by:
                text += " [" + ", ".join(f"{p} device{'s' if int(p) > 1 else ''}: {_seconds(v)}" for p, v in by.items())
                text += "]"
        else:
            why = {"budget": "its epochs ran out", "stopped": "early stopping ended it"}.get(e["why_not"], e["why_not"])
            text = f"{name}: not reached ({why})"
        if e.get("reused_from"):
            text += f" (reused: the clock of {e['reused_from']}, its own timing context)"
        parts.append(text)
    note = ""
    if target.get("baseline_converged") is False:
        note = (
            " **The CNN-DNN did not converge: the target is not a converged training's (not converged).**"
            if reverse
            else " **The global CNN did not converge: the target is not a converged baseline's "
            "(baseline not converged).**"
        )
    elif target.get("baseline_converged") is None:
        note = " (convergence unknown)"
    if not ttt.get("comparable", True):
        note += " Timed under different conditions (below)."
    held = target.get("split") == "val_target"
    what = "held-out target split accuracy" if held else "validation accuracy"
    name = "the reverse target (set by the CNN-DNN)" if reverse else "the fixed target"
    return (
        f"- Time to {name} {target['value']:.4f} ({what}; {target['source']}; tolerance "
        f"{target['tolerance']:.4f}), training clocks to the first evaluation at or above it: "
        + "; ".join(parts)
        + "."
        + note
    )


# What a pair's verdict says instead of a lead when its baseline row is flagged so (results.json "flags" kind): a
# difference against a constant guess or a guess unrelated to the labels says nothing of the method compared.
BASELINE_FLAGGED = {"chance": "baseline at chance", "constant": "baseline decides like a constant guess"}


def _pair_state(results: Mapping[str, Any], baseline: str, row: str | None = None) -> str | None:
    """``baseline not converged`` when the training a pair's baseline is read from (the pair's own in
    :data:`~ddcnn.report.stats.PAIRS`: ``global``, ``global_ensemble``, ``global_wide``, ... or every ``local`` net)
    did not converge; else, when the baseline's results ``row`` is flagged at chance or deciding like a constant guess
    (``results["flags"]``), what :data:`BASELINE_FLAGGED` says; else ``None``."""
    if baseline == "local":
        local = (results.get("convergence") or {}).get("local") or []
        state = BASELINE_NOT_CONVERGED if any(r.get("converged") is False for r in local) else None
    else:
        state = _baseline_state(results, baseline)
    if state is None and row is not None:
        state = baseline_flag(results, row)
    return state


def baseline_flag(results: Mapping[str, Any], row: str) -> str | None:
    """What a verdict against results ``row`` says instead of a lead when the row is flagged at chance or deciding
    like a constant guess (:data:`BASELINE_FLAGGED`), else ``None``."""
    kinds = [f.get("kind") for f in results.get("flags") or [] if f.get("method") == row]
    return next((BASELINE_FLAGGED[kind] for kind in kinds if kind in BASELINE_FLAGGED), None)


def image_pairs(
    results: Mapping[str, Any], correct: Mapping[str, torch.Tensor], n_test: int | None = None
) -> list[dict]:
    """Each paired difference of :data:`~ddcnn.report.stats.PAIRS` that a run holds, over its test images: the
    difference in points, McNemar's exact p and the 95% paired bootstrap interval with its verdict
    (:func:`~ddcnn.report.stats.image_paired_difference`, equivalence margin ±0.5 points), from ``correct``: per
    results key (``cnn_dnn``, ``global``, ``mean_prob``, ...), whether each test image was predicted right (the saved
    ``probs_test.pt``). A pair whose baseline did not converge keeps its figures, with the verdict
    ``baseline not converged``, and so does one whose baseline row is flagged at chance or deciding like a constant
    guess (``baseline at chance``, ``baseline decides like a constant guess``: call it after :func:`flag_rows`); the
    bootstrap is seeded (0), so a run's ``results.json`` is reproducible.

    Returns:
        One entry per pair: ``{"comparison", "method", "baseline", "baseline_converged", **figures}``.
    """
    out = []
    for what, a, b, baseline in PAIRS:
        if a not in correct or b not in correct:
            continue
        figures = image_paired_difference(correct[a].numpy(), correct[b].numpy())
        state = _pair_state(results, baseline, b)
        if state is not None:
            figures["verdict"] = state
        converged = _pair_state(results, baseline) is None
        out.append({"comparison": what, "method": a, "baseline": b, "baseline_converged": converged, **figures})
    return out


def _single_seed_lines(results: Mapping[str, Any]) -> list[str]:
    """The paired differences of one run: one seed, so no interval over seeds; each difference gets its interval
    over the run's test images (McNemar's exact p, the paired bootstrap), where the run saved its predictions."""
    acc = results.get("accuracy") or {}
    by_images = {entry["comparison"]: entry for entry in results.get("paired_test") or []}
    parts = []
    for what, a, b, baseline in PAIRS:
        if acc.get(a) is None or acc.get(b) is None:
            continue
        state = _pair_state(results, baseline, b)
        # against an unconverged or flagged baseline no lead is printed, not even one seed's (results.json keeps the
        # accuracies)
        if state is not None and state != "convergence unknown":
            parts.append(f"{what}: {state}")
            continue
        entry = by_images.get(what)
        figure = f"{100 * (acc[a] - acc[b]):+.2f} points"
        if entry is not None:
            figure += (
                f" (95% bootstrap interval over the {entry['n']} test images [{entry['low']:+.2f}, "
                f"{entry['high']:+.2f}]; McNemar p = {entry['p_mcnemar']:.3g} on {entry['b']} against "
                f"{entry['c']} discordant images: {entry['verdict']})"
            )
        parts.append(f"{what}: {figure}")
    if not parts:
        return []
    return [
        "- Test-accuracy differences on this run's one seed: " + "; ".join(parts) + ". One seed gives no interval "
        "over seeds (n<2); the intervals above are over this run's test images only (a paired bootstrap of 10,000 "
        "resamples; 'equivalent' only inside ±0.5 points, 'not distinguishable' when the interval holds 0 and reaches "
        "beyond it), and say nothing of another seed's initialisation or data draw: ddcnn-report over several seeds "
        "pairs them by seed and gives the 95% interval over seeds."
    ]


def results_markdown(results: dict) -> str:
    """A Markdown table of a run's results (one row per method, then one per local net)."""
    m, t = results["metrics"], results["time_s"]
    reused = results.get("reused") or {}
    lines = [
        f"# ddcnn results: {results['data']['name']}, {results['decomposition']['description']}",
        "",
        "| method | test accuracy | balanced acc. | AUC | sequential time (s) | projected time (s) | devices | speedup "
        "vs global, 1 device | parameters | converged |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    flagged = {f["method"] for f in results.get("flags") or [] if f["kind"] == "unconverged"}
    for row in results.get("methods") or method_rows(results):
        name = row["name"]
        if row["key"] == "global_ddp":
            name = f"{name} on {row['devices']} devices"
        if row.get("stage") in reused:
            name = f"{name} (reused)"
        # the row's own training and every one it builds on (results.json "flags": kind "unconverged")
        converged = "**no**" if row["key"] in flagged else _converged_cell(results, row.get("stage"))
        lines.append(
            f"| {name} | {_fmt(row['accuracy'])} | {_fmt(row.get('balanced_accuracy'))} | {_fmt(row.get('auc'))} | "
            f"{_fmt(row['sequential_time_s'], 1)} | {_fmt(row['projected_time_s'], 1)} | {_fmt(row['devices'])} | "
            f"{_fmt(row.get('speedup_1_device'), 2)} | {_fmt(row['params'])} | {converged} |"
        )
    for i, r in enumerate(m["local"]):
        lines.append(
            f"| local net {i} | {_fmt(r['accuracy'])} | {_fmt(r['balanced_accuracy'])} | {_fmt(r['auc'])} | "
            f"{_fmt(t['local'][i], 1)} | {_fmt(t['local'][i], 1)} | 1 | - | {_fmt(results['params'].get('local'))} | "
            f"{_converged_cell(results, f'local/{i}')} |"
        )
    lines += [
        "",
        f"- Projected time on N={results['decomposition']['num_subdomains']} devices (slowest local net + coarse "
        f"DNN): {_fmt(results['projected_time_s'], 1)} s; global CNN on one device: {_fmt(t.get('global'), 1)} s.",
        "- Sequential CNN-DNN time (all local nets one after another + coarse): "
        f"{_fmt(t.get('cnn_dnn_sequential'), 1)} s.",
        *_by_devices_lines(results),
        _devices_line(results.get("device_kinds") or {}),
        f"- Data: {results['data']['n_train']} train / {results['data']['n_val']} val / "
        f"{results['data']['n_test']} test samples of shape {results['data']['image_shape']}.",
        f"- {TIMING_RULE}",
    ]
    for stage, source in reused.items():
        lines.append(
            f"- Reused: the {stage} stage was trained once for these settings (any decomposition) by "
            f"{source.get('run_dir') or 'an earlier run'} and copied from the store ({source.get('entry')}); its time "
            "is that training's (store.reuse=false trains it in every run)."
        )
    for key in ("time_to_target", "time_to_target_reverse"):
        target = _time_to_target_line(results, key)
        if target:
            lines.append(target)
    lines += _single_seed_lines(results)
    note = _context_note(results.get("timing"))
    if note:
        lines.append(note)
    lines += flag_lines(results)
    lines.append("")
    return "\n".join(lines)


def _metrics_of(probs: torch.Tensor, labels: torch.Tensor, k: int) -> dict:
    return classification_metrics(probs.argmax(-1), labels, probs, k)


def _combiner_metrics(probs: torch.Tensor, labels: torch.Tensor, n: int, k: int) -> dict[str, dict]:
    vote_share = torch.zeros(len(labels), k).scatter_add_(1, probs.argmax(-1), torch.ones(probs.shape[:2]))
    return {
        "mean_prob": classification_metrics(mean_probability(probs), labels, probs.mean(1), k),
        "majority_vote": classification_metrics(majority_vote(probs), labels, vote_share / n, k),
    }


def device_counts(n: int) -> list[int]:
    """The device counts of every equal-device comparison: 1, 2 (what one machine runs DDP on) and N."""
    return sorted({1, min(2, n), n})


def equal_device_speedups(results: Mapping[str, Any]) -> dict[str, dict]:
    """``{str(P): {"baseline", "baseline_s", "cnn_dnn_s", "speedup"}}``: the CNN-DNN projected on P devices against a
    baseline that ran on P devices: the global CNN for P = 1, the DDP global CNN where it ran on exactly P devices.
    Device counts without such a baseline are left out: no speedup compares unequal device counts."""
    by_devices = results.get("projected_time_s_by_devices") or {}
    t = results.get("time_s") or {}
    ddp_devices = (results.get("devices") or {}).get("global_ddp")
    out: dict[str, dict] = {}
    for p, cnn_dnn_s in by_devices.items():
        if int(p) == 1:
            baseline = "global"
        elif ddp_devices is not None and int(ddp_devices) == int(p):
            baseline = "global_ddp"
        else:
            continue
        base_s = t.get(baseline)
        if base_s is None or not cnn_dnn_s:
            continue
        out[p] = {"baseline": baseline, "baseline_s": base_s, "cnn_dnn_s": cnn_dnn_s, "speedup": base_s / cnn_dnn_s}
    return out


def _ended(results: Mapping[str, Any]) -> dict[str, str | None]:
    """How each curve's trainings ended, by curve key: ``early_stopping`` when early stopping ended the training (for
    the CNN-DNN and the averaging combiner: any of its local nets, whose epochs make its curve), else ``budget``."""
    convergence = results.get("convergence") or {}
    local = convergence.get("local") or []
    local_end = "early_stopping" if any(r.get("stopped_by") == "early_stopping" for r in local) else "budget"
    out: dict[str, str | None] = {"cnn_dnn": local_end, "mean_prob": local_end}
    for stage, row in _table_rows():
        if stage is not None and isinstance(convergence.get(stage), Mapping):
            out[row.key] = convergence[stage].get("stopped_by")
    return out


def _cnn_dnn_converged(results: Mapping[str, Any]) -> bool | None:
    """Whether every training the CNN-DNN is made of (its local nets and the coarse DNN) converged (``None``: any
    not recorded)."""
    convergence = results.get("convergence") or {}
    records = [*(convergence.get("local") or []), convergence.get("coarse")]
    states = [r.get("converged") if isinstance(r, Mapping) else None for r in records]
    return None if None in states else all(states)


def _fixed_targets(results: dict) -> tuple[dict | None, dict | None]:
    """The fixed targets of ``docs/protocol.md`` §3: the global CNN's (forward) and the CNN-DNN's (reverse).

    With a ``val_target`` split both are accuracies there, which no choice saw; without one the forward target is the
    global CNN's best validation accuracy (:func:`~ddcnn.report.curves.target_accuracy`) and there is no reverse one.
    """
    reused = results.get("reused") or {}
    held = ((results.get("val_target") or {}).get("accuracy")) or {}
    n_target = results["data"].get("n_val_target")
    if n_target:
        forward = held_out_target(
            held.get("global"), n_target, "global CNN", baseline_converged(results), "global" in reused
        )
        reverse = held_out_target(held.get("cnn_dnn"), n_target, "CNN-DNN", _cnn_dnn_converged(results))
        return forward, reverse
    forward = target_accuracy(
        results["curves"], results["data"].get("n_val"), baseline_converged(results), "global" in reused
    )
    return forward, None


def _time_to_target(results: dict, n: int, target: dict | None) -> dict | None:
    """``time_to_target`` (:func:`ddcnn.report.curves.time_to_target`) of a run's results for ``target``, each
    method's entry with the devices its time is on and, for a reused global CNN, the run whose clock it carries."""
    reused = results.get("reused") or {}
    devices: dict[str, int | None] = {"cnn_dnn": n, "mean_prob": n}
    for row in results.get("methods") or []:
        devices.setdefault(row["key"], row.get("devices"))
    out = time_to_target(results["curves"], target, _ended(results), devices, n)
    if out is None:
        return None
    for stage, source in reused.items():
        key = registry.get(stage).row.key if registry.get(stage).row else stage
        if key in out:
            out[key]["reused_from"] = source.get("run_dir") or source.get("entry")
    out["comparable"] = bool((results.get("timing") or {}).get("comparable", True))
    return out


def evaluate_run(run, decomposition, data, settings: RunSettings | None = None) -> dict:
    """Collect the finished stages of a run into ``results.json`` / ``results.md`` and return the results.

    Stages that have not finished are reported as ``None``; missing local nets are an error. ``settings`` adds the
    run's model and seed.
    """
    n, k = decomposition.num_subdomains, data.num_classes
    c, local_meta, labels = _local_figures(run, n, k, data)
    _stage_figures(run, c, labels, k)
    results = _assembled(c, decomposition, data, n, k)
    if settings is not None:
        results["model"] = str(settings.model.get("_target_", ""))
        results["model_name"] = str(settings.model.get("name", results["model"]))
        results["seed"] = settings.seed
    if not results["timing"]["comparable"]:
        log.warning("evaluate: %s", _context_note(results["timing"]).lstrip("- ").replace("**", ""))
    _derived_figures(run, results, c, local_meta, n)
    correct = dict(c["correct"])
    main = f"cnn_dnn_{c['inputs']['coarse']}" if "coarse" in c["inputs"] else None
    if main in correct:
        correct["cnn_dnn"] = correct[main]
    rate = majority_rate(data.y["train"], labels)
    results["majority_rate"] = rate
    train_counts = torch.bincount(data.y["train"].long(), minlength=k)
    results["train_majority_rate"] = float(train_counts.max() / train_counts.sum())  # of the training split itself
    results["test_class_counts"] = torch.bincount(labels.long(), minlength=k).tolist()
    results["flags"] = flag_rows(results, rate, results["test_class_counts"])
    results["paired_test"] = image_pairs(results, correct)  # after the flags: a flagged baseline gives no verdict
    for flag in results["flags"]:
        log.warning("evaluate: %s", flag["message"])
    for advice in dict.fromkeys(flag["try"] for flag in results["flags"]):  # a fix shared by several rows, once
        log.warning("evaluate: try: %s", advice)
    atomic_write_json(run.root / "results.json", results)
    atomic_write_text(run.root / "results.md", results_markdown(results))
    return results


def _local_figures(run, n: int, k: int, data) -> tuple[dict[str, dict], list[dict], torch.Tensor]:
    """The local nets' (and the combiners') figures, times, parameters and timing contexts, in the tables
    :func:`_stage_figures` adds the other stages to; the local nets' meta files; the test labels."""
    probs, labels = run.local_outputs(n, "test", "probs")
    if not torch.equal(labels, data.y["test"]):
        raise ValueError(
            f"saved local test predictions in {run.root} do not match the current test data; rerun with force=true."
        )
    val_probs, val_labels = run.local_outputs(n, "val", "probs")
    metrics: dict[str, Any] = {"local": [_metrics_of(probs[:, i], labels, k) for i in range(n)]}
    metrics.update(_combiner_metrics(probs, labels, n, k))
    # per test image, whether a row predicted it right: the paired rows' intervals over test images
    correct: dict[str, torch.Tensor] = {"mean_prob": mean_probability(probs) == labels}
    val: dict[str, dict] = {"local": [_metrics_of(val_probs[:, i], val_labels, k) for i in range(n)]}
    val.update(_combiner_metrics(val_probs, val_labels, n, k))
    local_meta = [run.meta("local", i) for i in range(n)]
    convergence: dict[str, Any] = {"local": [convergence_of(m) for m in local_meta]}
    # each training's accuracy on its own training images: a row at chance did not learn, or does not generalise
    train_acc: dict[str, Any] = {
        "local": [training_accuracy(run.stage_dir("local", i), m) for i, m in enumerate(local_meta)]
    }
    train_probs, train_labels = run.local_outputs(n, "train", "probs")
    for key, figures in _combiner_metrics(train_probs, train_labels, n, k).items():
        train_acc[key] = {"epochs": None, "selected": figures["accuracy"]}
    # Training clocks only (no predictions): the times of the accuracy-versus-time curves.
    fit_times: dict[str, Any] = {"local": [m.get("fit_time_s", m["time_s"]) for m in local_meta]}
    fit_times["local_max"], fit_times["local_total"] = max(fit_times["local"]), sum(fit_times["local"])
    time_s: dict[str, Any] = {"local": [m["time_s"] for m in local_meta]}
    time_s["local_max"] = max(time_s["local"])
    time_s["local_total"] = sum(time_s["local"])
    if run.is_done("local_oof"):  # the out-of-fold trainings (coarse_oof): each sub-domain's device trains them too
        oof = run.meta("local_oof")
        convergence["local_oof"] = convergence_of(oof)
        for times, key in ((time_s, "time_s"), (fit_times, "fit_time_s")):
            per = oof.get("subdomain_time_s") or [oof[key] / n] * n
            times["local_oof"] = oof[key]
            times["local_oof_max"] = max(a + b for a, b in zip(times["local"], per, strict=True))
    params: dict[str, Any] = {"local": local_meta[0]["params"], "local_total": sum(m["params"] for m in local_meta)}
    contexts: dict[str, dict | None] = {f"local {i}": m.get("context") for i, m in enumerate(local_meta)}
    tables = {"metrics": metrics, "val": val, "convergence": convergence, "fit_times": fit_times, "time_s": time_s}
    tables |= {"params": params, "contexts": contexts, "correct": correct, "train_acc": train_acc}
    # stages whose row key depends on their input (the coarse DNNs), stages that trained on several devices at once
    # (global_ddp), start-up, stages copied from a training of an earlier run with the same settings, and the
    # accuracy on the val_target split (data.val_target_fraction) by row key
    tables |= {"inputs": {}, "devices": {}, "startup": {}, "reused": {}, "held_out": {}, "coarse_nets": {}}
    return tables, local_meta, labels


def _stage_figures(run, c: dict[str, dict], labels: torch.Tensor, k: int) -> None:
    """Every finished stage of the registry that has a results row, into the tables ``c``."""
    for stage in registry.STAGES:
        if stage.row is None:
            continue
        if not run.is_done(stage.name):
            c["time_s"].setdefault(stage.name, None)
            continue
        meta = run.meta(stage.name)
        saved = run.load_probs(stage.name, "test")
        if not torch.equal(saved["labels"], labels):
            raise ValueError(
                f"saved {stage.name} test predictions in {run.root} are for other data; rerun stage={stage.name} "
                f"with force=true."
            )
        key = stage.row.key
        if "{input}" in key:
            c["inputs"][stage.name] = meta.get("input", "probs")
            key = key.format(input=c["inputs"][stage.name])
        c["metrics"][key] = _metrics_of(saved["probs"], saved["labels"], k)
        c["correct"][key] = saved["probs"].argmax(-1) == saved["labels"]
        saved_val = run.load_probs(stage.name, "val")
        c["val"][key] = _metrics_of(saved_val["probs"], saved_val["labels"], k)
        c["train_acc"][key] = training_accuracy(run.stage_dir(stage.name), meta)
        target_file = run.stage_dir(stage.name) / f"probs_{TARGET_SPLIT}.pt"
        if target_file.is_file():
            saved_target = load_run_file(target_file)
            c["held_out"][key] = float((saved_target["probs"].argmax(-1) == saved_target["labels"]).float().mean())
        c["time_s"][stage.name] = meta["time_s"]
        c["fit_times"][stage.name] = meta.get("fit_time_s", meta["time_s"])
        c["convergence"][stage.name] = convergence_of(meta)
        if meta.get("coarse_net") is not None:  # the coarse net in use: the below-averaging flag names it
            c["coarse_nets"][stage.name] = meta["coarse_net"]
        c["params"][stage.name] = meta["params"]
        c["contexts"][stage.name] = meta.get("context")
        if meta.get("startup_s"):
            c["startup"][stage.name] = meta["startup_s"]
        if "num_devices" in meta:
            c["devices"][stage.name] = int(meta["num_devices"])
        if meta.get("reused_from"):
            c["reused"][stage.name] = meta["reused_from"]


def _assembled(c: dict[str, dict], decomposition, data, n: int, k: int) -> dict:
    """``results.json``'s figures from the tables ``c``: the CNN-DNN's row, accuracies, times and the projection."""
    metrics, val, time_s, params, inputs, held_out = (
        c[key] for key in ("metrics", "val", "time_s", "params", "inputs", "held_out")
    )
    main = f"cnn_dnn_{inputs['coarse']}" if "coarse" in inputs else None
    metrics["cnn_dnn"], val["cnn_dnn"] = (metrics.get(main), val.get(main)) if main else (None, None)
    if main in held_out:
        held_out["cnn_dnn"] = held_out[main]
    if main in c["train_acc"]:
        c["train_acc"]["cnn_dnn"] = c["train_acc"][main]
    metrics.setdefault("global", None)
    if time_s.get("coarse") is not None:
        params["cnn_dnn"] = params["local_total"] + params["coarse"]
        time_s["cnn_dnn_sequential"] = time_s["local_total"] + time_s["coarse"]
        projected = time_s["local_max"] + time_s["coarse"]
    else:
        time_s["cnn_dnn_sequential"] = None
        projected = time_s["local_max"]
    speedup = time_s["global"] / projected if time_s.get("global") else None
    accuracy: dict[str, Any] = {
        key: (metrics[key]["accuracy"] if metrics.get(key) else None)
        for key in ("global", "cnn_dnn", "mean_prob", "majority_vote", *METHODS)
    }
    accuracy["local"] = [m["accuracy"] for m in metrics["local"]]
    val_figures: dict[str, dict] = {}
    for figure in ("accuracy", "balanced_accuracy", "auc"):
        val_figures[figure] = {key: (v[figure] if v else None) for key, v in val.items() if key != "local"}
        val_figures[figure]["local"] = [v[figure] for v in val["local"]]
    contexts, reused = c["contexts"], c["reused"]
    compared = {s: x for s, x in contexts.items() if s.startswith("local ") or s in ("coarse", "global", "global_ddp")}
    device_kinds = {s: str(_context_value(x, "device_kind")) for s, x in contexts.items() if x}
    return {
        "accuracy": accuracy,
        "coarse_input": inputs,
        "metrics": metrics,
        "val": val_figures,
        **({"val_target": {"accuracy": held_out}} if held_out else {}),
        "time_s": time_s,
        "startup_s": c["startup"],
        "projected_time_s": projected,
        "projected_speedup": speedup,
        "params": params,
        "devices": c["devices"],
        "device_kinds": device_kinds,
        "reused": reused,
        "timing": timing_contexts(compared, reused),
        "timing_all_stages": timing_contexts(contexts, reused),
        "convergence": c["convergence"],
        "train_accuracy": c["train_acc"],
        "coarse_nets": c["coarse_nets"],
        "decomposition": {
            "grid": list(decomposition.grid),
            "overlap": list(decomposition.overlap),
            "image_shape": list(decomposition.image_shape),
            "sub_shape": list(decomposition.sub_shape),
            "num_subdomains": n,
            "description": decomposition.describe(),
        },
        "data": {"name": data.name, "image_shape": list(data.image_shape), "num_classes": k, **data.info},
    }


def _derived_figures(run, results: dict, c: dict[str, dict], local_meta: list[dict], n: int) -> None:
    """What ``results`` derives from its figures: method rows, prediction times, the projection by devices, speedups
    at equal devices, curves and the times to the fixed targets."""
    time_s, fit_times = c["time_s"], c["fit_times"]
    results["methods"] = method_rows(results)
    results["fit_time_s"] = fit_times
    # The inference of each training's outputs after its training clock stopped (saved predictions and net): for a
    # local net, the outputs the coarse DNN reads.
    results["predict_time_s"] = {
        "local": [max(0.0, float(m["time_s"]) - float(m.get("fit_time_s", m["time_s"]))) for m in local_meta]
    }
    results["projected_time_s_by_devices"] = (
        makespan_by_devices(time_s["local"], time_s["coarse"], device_counts(n))
        if time_s.get("coarse") is not None
        else None
    )
    results["speedup_equal_devices"] = equal_device_speedups(results)
    results["curves"] = run_curves(run, results)
    forward, reverse = _fixed_targets(results)
    results["time_to_target"] = _time_to_target(results, n, forward)
    results["time_to_target_reverse"] = _time_to_target(results, n, reverse)
    cnn_dnn_time = time_s["local_max"] + fit_times["coarse"] if fit_times.get("coarse") is not None else None
    results["speedup_at_equal_accuracy"] = speedup_at_equal_accuracy(
        results["curves"], cnn_dnn_time, results["time_to_target"]
    )


def _sum(t: dict, terms: tuple[str, ...] | None) -> float | None:
    if terms is None:
        return None
    values = [t.get(term) for term in terms]
    return None if any(v is None for v in values) else float(sum(values))


def method_rows(results: dict) -> list[dict]:
    """One row per finished method of a run's results: accuracy, times, speedup and parameters.

    Every row's times are sums of recorded times, as its registry entry says (:class:`ddcnn.registry.ResultRow`):

    - ``sequential_time_s``: everything the method needs, one stage after another on one device;
    - ``projected_time_s``: on the ``devices`` it can use, i.e. ``N`` for the decomposed methods (the local nets
      in parallel: the slowest local net, then the coarse DNN and any further training), 1 for the global CNN and
      the end-to-end CNN-DNN (trained as one model), ``P`` for the DDP baseline (its wall time on ``P`` devices);
    - ``speedup``: global CNN time over ``projected_time_s`` (unequal devices for the decomposed methods: a scaling
      figure, never printed as a verdict);
    - ``speedup_1_device``: global CNN time over ``sequential_time_s``: both on one device (``None`` for a method
      without a one-device time, DDP). The comparisons on 2 and N devices are ``results.json``
      ``speedup_equal_devices``.

    Works on ``results.json`` files written before the registry existed (their CNN-DNN row is the coarse DNN on
    ``coarse_input`` or, unknown, on probabilities).
    """
    m, t, p = results["metrics"], results["time_s"], results["params"]
    n = int(results["decomposition"]["num_subdomains"])
    inputs = dict(results.get("coarse_input") or {})
    if m.get("cnn_dnn") is not None:
        inputs.setdefault("coarse", "probs")
    metrics = dict(m)
    if "coarse" in inputs and metrics.get(f"cnn_dnn_{inputs['coarse']}") is None:
        metrics[f"cnn_dnn_{inputs['coarse']}"] = metrics.get("cnn_dnn")
    t_global = t.get("global")
    rows = []
    for stage, row in _table_rows():
        key = row.key
        if "{input}" in key:
            if stage not in inputs:
                continue
            key = key.format(input=inputs[stage])
        if metrics.get(key) is None:
            continue
        if row.devices == "N":
            devices = n
        elif isinstance(row.devices, str) and row.devices.startswith("meta:"):
            devices = (results.get("devices") or {}).get(stage)
        else:
            devices = int(row.devices)
        projected = _sum(t, row.projected)
        if stage is None:
            row_params = p.get("local_total")
        elif stage in COMBINER_STAGES:
            row_params = None if p.get(stage) is None else p.get("local_total", 0) + p[stage]
        else:
            row_params = p.get(stage)
        r = metrics[key]
        sequential = _sum(t, row.sequential)
        rows.append(
            {
                "key": key,
                "name": row.name.format(input=inputs.get(stage, "probs")),
                "stage": stage,
                "accuracy": r["accuracy"],
                "balanced_accuracy": r.get("balanced_accuracy"),
                "auc": r.get("auc"),
                "decision_share": r.get("decision_share"),
                "sequential_time_s": sequential,
                "projected_time_s": projected,
                "devices": devices,
                # the global CNN on one device over this method on its devices: a scaling figure, not an equal-device
                # comparison (kept for readers of older results; the protocol's figure is speedup_1_device)
                "speedup": (t_global / projected) if t_global and projected else None,
                "speedup_1_device": (t_global / sequential) if t_global and sequential else None,
                "params": row_params,
            }
        )
    order = list(METHODS)
    rows.sort(key=lambda r: order.index(r["key"]) if r["key"] in order else len(order))
    return rows
