"""The ``evaluate`` stage: one table of every method of a run, as ``results.json`` and ``results.md``.

Reads only the run directory and the registry's data (:mod:`ddcnn.registry`): which stages exist, what their rows
are called and which recorded times add up to each row's time. Besides the per-key dictionaries (``accuracy``,
``metrics``, ``val``, ``time_s``, ``params``), ``results.json`` holds ``methods``: one row per finished method
(:func:`method_rows`) with its test accuracy, sequential training time, projected time on the devices it can use,
speedup against the global CNN and parameter count, and ``timing``: in which execution context each time was
measured and whether the compared times share one. The comparison report across runs (:mod:`ddcnn.report.compare`)
reads those rows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from ddcnn import registry
from ddcnn.io import atomic_write_json, atomic_write_text
from ddcnn.metrics import at_chance, majority_rate
from ddcnn.registry import ResultRow
from ddcnn.report.combiners import majority_vote, mean_probability
from ddcnn.report.curves import run_curves, speedup_at_equal_accuracy

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
# the index: two workers on cuda:0 and cuda:1 of one model are alike), device count, threads, trainings side by side.
CONTEXT_KEYS = ("device_kind", "num_devices", "torch_threads", "concurrent_trainings", "host")


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
    """Accuracy, balanced accuracy and (when scores are given and both classes occur) ROC AUC.

    For two classes the AUC uses the score of class 1; for more it is the one-vs-rest macro average.
    """
    from sklearn.metrics import balanced_accuracy_score, roc_auc_score

    y, p = labels.numpy(), pred.numpy()
    out: dict[str, float | None] = {
        "accuracy": float((p == y).mean()),
        "balanced_accuracy": float(balanced_accuracy_score(y, p)),
        "auc": None,
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


def timing_contexts(contexts: dict[str, dict | None]) -> dict:
    """Whether the times of ``contexts`` (stage -> recorded context) were measured alike: same device kind, device
    count, threads, trainings side by side and host, except for threads a stage records as chosen by design
    (``threads_by_design``, the coarse DNN's ``coarse.num_threads``).

    Returns:
        ``{"contexts": {stage: {...}}, "comparable": bool, "differences": {key: {value: [stages]}}}``; stages without
        a recorded context (older runs) are listed under ``unknown``.
    """
    known = {k: {f: _context_value(c, f) for f in CONTEXT_KEYS} for k, c in contexts.items() if c}
    by_design = {k for k, c in contexts.items() if c and c.get("threads_by_design")}
    differences: dict[str, dict[str, list[str]]] = {}
    for field in CONTEXT_KEYS:
        values: dict[str, list[str]] = {}
        for stage, c in known.items():
            if field == "torch_threads" and stage in by_design:
                continue  # chosen as part of the method (the coarse DNN's coarse.num_threads), not a difference
            values.setdefault(str(c[field]), []).append(stage)
        if len(values) > 1:
            differences[field] = values
    unknown = sorted(k for k, c in contexts.items() if not c)
    return {"contexts": known, "comparable": not differences, "differences": differences, "unknown": unknown}


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


def flag_rows(results: dict, rate: float, counts: Sequence[int]) -> list[dict]:
    """Rows a reader must not take at face value: at chance (every figure of the row within noise of a guess
    unrelated to the labels: accuracy against the majority-class ``rate``, then ROC AUC against 0.5 or balanced
    accuracy against ``1/K``; see :func:`ddcnn.metrics.at_chance`), or a combiner of the local nets far below
    averaging them. ``counts`` are the test split's class sizes. Each flag says what to try."""
    flags = []
    n_test = sum(int(c) for c in counts)
    mean = (results.get("accuracy") or {}).get("mean_prob")
    for row in results.get("methods") or []:
        acc, key, name = row["accuracy"], row["key"], row["name"]
        auc, balanced = row.get("auc"), row.get("balanced_accuracy")
        coarse = row.get("stage") in COMBINER_STAGES
        if at_chance(acc, rate, counts, auc=auc, balanced_accuracy=balanced):
            hint = (
                "The coarse DNN did not learn: read the fit record in its meta.json (kept, restarts, refits); the "
                "default coarse.net (input_norm=standardize, skip=mean_prob) cannot end below averaging the local nets."
                if coarse
                else "The network did not learn: lower optimizer.lr, train longer (trainer.max_epochs) and check the "
                "labels and data.num_classes."
            )
            also = (
                f" and its AUC {auc:.4f} is within noise of 0.5"
                if auc is not None
                else f" and its balanced accuracy {balanced:.4f} is within noise of 1/K"
                if balanced is not None
                else ""
            )
            flags.append(
                {
                    "method": key,
                    "kind": "chance",
                    "message": f"{name}: test accuracy {acc:.4f} is at chance (majority-class rate {rate:.4f}){also}.",
                    "try": hint,
                }
            )
            continue
        se = math.sqrt(max(acc * (1 - acc), 1e-6) / max(n_test, 1))
        if coarse and mean is not None and acc < mean - max(_BELOW_AVERAGING, 3 * se):
            flags.append(
                {
                    "method": key,
                    "kind": "below_averaging",
                    "message": f"{name}: test accuracy {acc:.4f} is far below averaging the local nets ({mean:.4f}).",
                    "try": "Use the default coarse.net (its averaging skip keeps it at or above averaging on "
                    "validation); with few validation samples per class prefer coarse.monitor=val_loss.",
                }
            )
    return flags


def _equal_accuracy_line(equal: dict | None) -> str | None:
    if not equal:
        return None
    parts = []
    for key, what in (("at_cnn_dnn_accuracy", "the CNN-DNN's"), ("at_global_accuracy", "the global CNN's")):
        e = equal[key]
        where = f"{what} validation accuracy {e['target_val_acc']:.4f}"
        if not e["reached"]:
            who = "global CNN" if key == "at_cnn_dnn_accuracy" else "CNN-DNN"
            parts.append(f"at {where}: not reached by the {who}")
        else:
            parts.append(
                f"at {where}: {e['speedup']:.2f}x (global CNN {e['global_s']:.1f} s, CNN-DNN {e['cnn_dnn_s']:.1f} s)"
            )
    return (
        "- Speedup at equal accuracy (training clocks, first epoch at or above the target): " + "; ".join(parts) + "."
    )


def results_markdown(results: dict) -> str:
    """A Markdown table of a run's results (one row per method, then one per local net)."""
    m, t = results["metrics"], results["time_s"]
    reused = results.get("reused") or {}
    lines = [
        f"# ddcnn results: {results['data']['name']}, {results['decomposition']['description']}",
        "",
        "| method | test accuracy | balanced acc. | AUC | sequential time (s) | projected time (s) | devices | speedup "
        "| parameters |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results.get("methods") or method_rows(results):
        name = row["name"]
        if row["key"] == "global_ddp":
            name = f"{name} on {row['devices']} devices"
        if row.get("stage") in reused:
            name = f"{name} (reused)"
        lines.append(
            f"| {name} | {_fmt(row['accuracy'])} | {_fmt(row.get('balanced_accuracy'))} | {_fmt(row.get('auc'))} | "
            f"{_fmt(row['sequential_time_s'], 1)} | {_fmt(row['projected_time_s'], 1)} | {_fmt(row['devices'])} | "
            f"{_fmt(row['speedup'], 2)} | {_fmt(row['params'])} |"
        )
    for i, r in enumerate(m["local"]):
        lines.append(
            f"| local net {i} | {_fmt(r['accuracy'])} | {_fmt(r['balanced_accuracy'])} | {_fmt(r['auc'])} | "
            f"{_fmt(t['local'][i], 1)} | {_fmt(t['local'][i], 1)} | 1 | - | {_fmt(results['params'].get('local'))} |"
        )
    lines += [
        "",
        f"- Projected time on N={results['decomposition']['num_subdomains']} devices (slowest local net + coarse "
        f"DNN): {_fmt(results['projected_time_s'], 1)} s; global CNN on one device: {_fmt(t.get('global'), 1)} s; "
        f"projected speedup: {_fmt(results['projected_speedup'], 2)}x.",
        "- Sequential CNN-DNN time (all local nets one after another + coarse): "
        f"{_fmt(t.get('cnn_dnn_sequential'), 1)} s.",
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
    equal = _equal_accuracy_line(results.get("speedup_at_equal_accuracy"))
    if equal:
        lines.append(equal)
    for flag in results.get("flags") or []:
        lines.append(f"- **Check this row:** {flag['message']} {flag['try']}")
    note = _context_note(results.get("timing"))
    if note:
        lines.append(note)
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


def evaluate_run(run, decomposition, data, cfg: DictConfig | None = None) -> dict:
    """Collect the finished stages of a run into ``results.json`` / ``results.md`` and return the results.

    Stages that have not finished are reported as ``None``; missing local nets are an error.
    """
    n, k = decomposition.num_subdomains, data.num_classes
    probs, labels = run.local_outputs(n, "test", "probs")
    if not torch.equal(labels, data.y["test"]):
        raise ValueError(
            f"saved local test predictions in {run.root} do not match the current test data; rerun with force=true."
        )
    val_probs, val_labels = run.local_outputs(n, "val", "probs")
    metrics: dict[str, Any] = {"local": [_metrics_of(probs[:, i], labels, k) for i in range(n)]}
    metrics.update(_combiner_metrics(probs, labels, n, k))
    val: dict[str, dict] = {"local": [_metrics_of(val_probs[:, i], val_labels, k) for i in range(n)]}
    val.update(_combiner_metrics(val_probs, val_labels, n, k))
    local_meta = [run.meta("local", i) for i in range(n)]
    # Training clocks only (no predictions): the times of the accuracy-versus-time curves.
    fit_times: dict[str, Any] = {"local": [m.get("fit_time_s", m["time_s"]) for m in local_meta]}
    fit_times["local_max"], fit_times["local_total"] = max(fit_times["local"]), sum(fit_times["local"])
    time_s: dict[str, Any] = {"local": [m["time_s"] for m in local_meta]}
    time_s["local_max"] = max(time_s["local"])
    time_s["local_total"] = sum(time_s["local"])
    if run.is_done("local_oof"):  # the out-of-fold trainings (coarse_oof): each sub-domain's device trains them too
        oof = run.meta("local_oof")
        for times, key in ((time_s, "time_s"), (fit_times, "fit_time_s")):
            per = oof.get("subdomain_time_s") or [oof[key] / n] * n
            times["local_oof"] = oof[key]
            times["local_oof_max"] = max(a + b for a, b in zip(times["local"], per, strict=True))
    params: dict[str, Any] = {"local": local_meta[0]["params"], "local_total": sum(m["params"] for m in local_meta)}
    contexts: dict[str, dict | None] = {f"local {i}": m.get("context") for i, m in enumerate(local_meta)}
    inputs: dict[str, str] = {}  # stages whose row key depends on their input (the coarse DNNs)
    devices: dict[str, int] = {}  # stages that trained on several devices at once (global_ddp)
    startup: dict[str, float] = {}
    reused: dict[str, dict] = {}  # stages copied from a training of an earlier run with the same settings
    for stage in registry.STAGES:
        if stage.row is None:
            continue
        if not run.is_done(stage.name):
            time_s.setdefault(stage.name, None)
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
            inputs[stage.name] = meta.get("input", "probs")
            key = key.format(input=inputs[stage.name])
        metrics[key] = _metrics_of(saved["probs"], saved["labels"], k)
        saved_val = run.load_probs(stage.name, "val")
        val[key] = _metrics_of(saved_val["probs"], saved_val["labels"], k)
        time_s[stage.name] = meta["time_s"]
        fit_times[stage.name] = meta.get("fit_time_s", meta["time_s"])
        params[stage.name] = meta["params"]
        contexts[stage.name] = meta.get("context")
        if meta.get("startup_s"):
            startup[stage.name] = meta["startup_s"]
        if "num_devices" in meta:
            devices[stage.name] = int(meta["num_devices"])
        if meta.get("reused_from"):
            reused[stage.name] = meta["reused_from"]
    main = f"cnn_dnn_{inputs['coarse']}" if "coarse" in inputs else None
    metrics["cnn_dnn"], val["cnn_dnn"] = (metrics.get(main), val.get(main)) if main else (None, None)
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
    compared = {s: c for s, c in contexts.items() if s.startswith("local ") or s in ("coarse", "global")}
    device_kinds = {s: str(_context_value(c, "device_kind")) for s, c in contexts.items() if c}
    results = {
        "accuracy": accuracy,
        "coarse_input": inputs,
        "metrics": metrics,
        "val": val_figures,
        "time_s": time_s,
        "startup_s": startup,
        "projected_time_s": projected,
        "projected_speedup": speedup,
        "params": params,
        "devices": devices,
        "device_kinds": device_kinds,
        "reused": reused,
        "timing": timing_contexts(compared),
        "timing_all_stages": timing_contexts(contexts),
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
    if cfg is not None:
        results["model"] = str(cfg.model.get("_target_", ""))
        results["model_name"] = str(cfg.model.get("name", results["model"]))
        results["seed"] = int(cfg.seed)
    if not results["timing"]["comparable"]:
        log.warning("evaluate: %s", _context_note(results["timing"]).lstrip("- ").replace("**", ""))
    results["methods"] = method_rows(results)
    results["fit_time_s"] = fit_times
    results["curves"] = run_curves(run, results)
    cnn_dnn_time = fit_times["local_max"] + fit_times["coarse"] if fit_times.get("coarse") is not None else None
    results["speedup_at_equal_accuracy"] = speedup_at_equal_accuracy(results["curves"], cnn_dnn_time)
    rate = majority_rate(data.y["train"], labels)
    results["majority_rate"] = rate
    results["test_class_counts"] = torch.bincount(labels.long(), minlength=k).tolist()
    results["flags"] = flag_rows(results, rate, results["test_class_counts"])
    for flag in results["flags"]:
        log.warning("evaluate: %s %s", flag["message"], flag["try"])
    atomic_write_json(run.root / "results.json", results)
    atomic_write_text(run.root / "results.md", results_markdown(results))
    return results


def _term(t: dict, term: str) -> float | None:
    return t.get(term)


def _sum(t: dict, terms: tuple[str, ...] | None) -> float | None:
    if terms is None:
        return None
    values = [_term(t, term) for term in terms]
    return None if any(v is None for v in values) else float(sum(values))


def method_rows(results: dict) -> list[dict]:
    """One row per finished method of a run's results: accuracy, times, speedup and parameters.

    Every row's times are sums of recorded times, as its registry entry says (:class:`ddcnn.registry.ResultRow`):

    - ``sequential_time_s``: everything the method needs, one stage after another on one device;
    - ``projected_time_s``: on the ``devices`` it can use, i.e. ``N`` for the decomposed methods (the local nets
      in parallel: the slowest local net, then the coarse DNN and any further training), 1 for the global CNN and
      the end-to-end CNN-DNN (trained as one model), ``P`` for the DDP baseline (its wall time on ``P`` devices);
    - ``speedup``: global CNN time over ``projected_time_s``.

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
        rows.append(
            {
                "key": key,
                "name": row.name.format(input=inputs.get(stage, "probs")),
                "stage": stage,
                "accuracy": r["accuracy"],
                "balanced_accuracy": r.get("balanced_accuracy"),
                "auc": r.get("auc"),
                "sequential_time_s": _sum(t, row.sequential),
                "projected_time_s": projected,
                "devices": devices,
                "speedup": (t_global / projected) if t_global and projected else None,
                "params": row_params,
            }
        )
    order = list(METHODS)
    rows.sort(key=lambda r: order.index(r["key"]) if r["key"] in order else len(order))
    return rows
