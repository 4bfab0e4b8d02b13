"""The ``evaluate`` stage: one table of every method of a run, as ``results.json`` and ``results.md``.

Besides the per-key dictionaries (``accuracy``, ``metrics``, ``time_s``, ``params``), ``results.json`` holds
``methods``: one row per finished method (:func:`method_rows`) with its test accuracy, sequential training time,
projected time on the devices it can use, speedup against the global CNN and parameter count. The comparison
report across runs (:mod:`ddcnn.report.compare`) reads those rows.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from ddcnn.report.combiners import majority_vote, mean_probability
from ddcnn.training.pipeline import OPTIONAL_STAGES

log = logging.getLogger(__name__)

__all__ = ["METHODS", "classification_metrics", "evaluate_run", "method_rows", "results_markdown"]

# Every method a run can report, in table order: key -> display name. The optional stages are those of
# ddcnn.training.methods; the CNN-DNN appears once per coarse-DNN input that was trained.
METHODS: dict[str, str] = {
    "global": "global CNN",
    "mean_prob": "mean probability",
    "majority_vote": "majority vote",
    "cnn_dnn_probs": "CNN-DNN (coarse DNN on probs)",
    "cnn_dnn_logits": "CNN-DNN (coarse DNN on logits)",
    "e2e": "CNN-DNN end to end",
    "transfer": "CNN-DNN transfer (local nets + coarse DNN, trained further)",
    "global_transfer": "global CNN transfer (init. from local nets)",
    "global_ddp": "global CNN, DDP",
}
# Optional stages whose test predictions the evaluate stage reads (coarse_alt is reported per input kind): the
# pipeline's list, so that a new stage cannot be trained and then left out of the results.
_OPTIONAL = OPTIONAL_STAGES


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


def results_markdown(results: dict) -> str:
    """A Markdown table of a run's results (one row per method)."""
    m = results["metrics"]
    t = results["time_s"]
    lines = [
        f"# ddcnn results: {results['data']['name']}, {results['decomposition']['description']}",
        "",
        "| method | test accuracy | balanced acc. | AUC | training time (s) | parameters |",
        "|---|---|---|---|---|---|",
    ]
    rows = [
        ("global CNN", "global", t.get("global"), results["params"].get("global")),
        ("CNN-DNN (coarse DNN)", "cnn_dnn", t.get("cnn_dnn_sequential"), results["params"].get("cnn_dnn")),
        ("mean probability", "mean_prob", t.get("local_total"), results["params"].get("local_total")),
        ("majority vote", "majority_vote", t.get("local_total"), results["params"].get("local_total")),
    ]
    # The optional methods (ddcnn.training.methods), each with its sequential time (see method_rows).
    main_key = f"cnn_dnn_{results.get('coarse_input', {}).get('coarse', 'probs')}"
    for row in results.get("methods", []):
        if row["key"] == "global_ddp":  # its wall time on P devices: it has no one-device time
            rows.append(
                (f"{row['name']} on {row['devices']} devices", row["key"], row["projected_time_s"], row["params"])
            )
        elif row["key"] in ("cnn_dnn_probs", "cnn_dnn_logits", "e2e", "transfer", "global_transfer") and (
            row["key"] != main_key
        ):
            rows.append((row["name"], row["key"], row["sequential_time_s"], row["params"]))
    for name, key, seconds, params in rows:
        if key in m and m[key] is not None:
            r = m[key]
            lines.append(
                f"| {name} | {_fmt(r['accuracy'])} | {_fmt(r['balanced_accuracy'])} | {_fmt(r['auc'])} | "
                f"{_fmt(seconds, 1)} | {_fmt(params)} |"
            )
    for i, r in enumerate(m["local"]):
        lines.append(
            f"| local net {i} | {_fmt(r['accuracy'])} | {_fmt(r['balanced_accuracy'])} | {_fmt(r['auc'])} | "
            f"{_fmt(t['local'][i], 1)} | {_fmt(results['params'].get('local'))} |"
        )
    lines += [
        "",
        f"- Projected time on N={results['decomposition']['num_subdomains']} devices (slowest local net + coarse "
        f"DNN): {_fmt(results['projected_time_s'], 1)} s; global CNN on one device: {_fmt(t.get('global'), 1)} s; "
        f"projected speedup: {_fmt(results['projected_speedup'], 2)}x.",
        "- Sequential CNN-DNN time (all local nets one after another + coarse): "
        f"{_fmt(t.get('cnn_dnn_sequential'), 1)} s.",
        f"- Data: {results['data']['n_train']} train / {results['data']['n_val']} val / "
        f"{results['data']['n_test']} test samples of shape {results['data']['image_shape']}.",
        "",
    ]
    return "\n".join(lines)


def evaluate_run(run, decomposition, data, cfg: DictConfig | None = None) -> dict:
    """Collect the finished stages of a run into ``results.json`` / ``results.md`` and return the results.

    Missing optional stages (global, coarse) are reported as ``None``; missing local nets are an error.
    """
    from ddcnn.training.rundir import atomic_write_json, atomic_write_text
    from ddcnn.training.stages import local_features

    n, k = decomposition.num_subdomains, data.num_classes
    probs, labels = local_features(run, n, "test", "probs")
    if not torch.equal(labels, data.y["test"]):
        raise ValueError(
            f"saved local test predictions in {run.root} do not match the current test data; rerun with force=true."
        )
    metrics: dict[str, Any] = {
        "local": [classification_metrics(probs[:, i].argmax(-1), labels, probs[:, i], k) for i in range(n)],
        "mean_prob": classification_metrics(mean_probability(probs), labels, probs.mean(1), k),
        "majority_vote": None,
    }
    vote_share = torch.zeros(len(labels), k).scatter_add_(1, probs.argmax(-1), torch.ones(probs.shape[:2]))
    metrics["majority_vote"] = classification_metrics(majority_vote(probs), labels, vote_share / n, k)
    local_meta = [run.meta("local", i) for i in range(n)]
    time_s: dict[str, Any] = {"local": [m["time_s"] for m in local_meta]}
    time_s["local_max"] = max(time_s["local"])
    time_s["local_total"] = sum(time_s["local"])
    params: dict[str, Any] = {"local": local_meta[0]["params"], "local_total": sum(m["params"] for m in local_meta)}
    for stage, key in (("coarse", "cnn_dnn"), ("global", "global")):
        if run.is_done(stage):
            saved = run.load_probs(stage, "test")
            metrics[key] = classification_metrics(saved["probs"].argmax(-1), saved["labels"], saved["probs"], k)
            meta = run.meta(stage)
            time_s[stage] = meta["time_s"]
            params[stage] = meta["params"]
        else:
            metrics[key] = None
            time_s[stage] = None
    # The coarse DNN's input decides which CNN-DNN row the main coarse stage fills; coarse_alt fills the other.
    coarse_input = {"coarse": run.meta("coarse").get("input", "probs")} if run.is_done("coarse") else {}
    devices: dict[str, int] = {}  # stages that trained on several devices at once (global_ddp)
    if "coarse" in coarse_input:
        metrics[f"cnn_dnn_{coarse_input['coarse']}"] = metrics["cnn_dnn"]
    for stage in _OPTIONAL:
        if not run.is_done(stage):
            continue
        saved, meta = run.load_probs(stage, "test"), run.meta(stage)
        if not torch.equal(saved["labels"], labels):
            raise ValueError(
                f"saved {stage} test predictions in {run.root} are for other data; rerun stage={stage} with force=true."
            )
        key = stage
        if stage == "coarse_alt":
            coarse_input["coarse_alt"] = meta["input"]
            key = f"cnn_dnn_{meta['input']}"
        metrics[key] = classification_metrics(saved["probs"].argmax(-1), saved["labels"], saved["probs"], k)
        time_s[stage] = meta["time_s"]
        params[stage] = meta["params"]
        if "num_devices" in meta:
            devices[stage] = int(meta["num_devices"])
    if time_s["coarse"] is not None:
        params["cnn_dnn"] = params["local_total"] + params["coarse"]
        time_s["cnn_dnn_sequential"] = time_s["local_total"] + time_s["coarse"]
        projected = time_s["local_max"] + time_s["coarse"]
    else:
        time_s["cnn_dnn_sequential"] = None
        projected = time_s["local_max"]
    speedup = time_s["global"] / projected if time_s["global"] else None
    accuracy = {
        key: (metrics[key]["accuracy"] if metrics[key] else None)
        for key in ("global", "cnn_dnn", "mean_prob", "majority_vote")
    }
    accuracy["local"] = [m["accuracy"] for m in metrics["local"]]
    for key in METHODS:
        if key not in accuracy:
            accuracy[key] = metrics[key]["accuracy"] if metrics.get(key) else None
    results = {
        "accuracy": accuracy,
        "coarse_input": coarse_input,
        "metrics": metrics,
        "time_s": time_s,
        "projected_time_s": projected,
        "projected_speedup": speedup,
        "params": params,
        "devices": devices,
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
    results["methods"] = method_rows(results)
    atomic_write_json(run.root / "results.json", results)
    atomic_write_text(run.root / "results.md", results_markdown(results))
    return results


def method_rows(results: dict) -> list[dict]:
    """One row per finished method of a run's results: accuracy, times, speedup and parameters.

    Times are training times measured on this run's device, in seconds:

    - ``sequential_time_s``: everything the method needs, one stage after another on one device;
    - ``projected_time_s``: on the ``devices`` it can use, i.e. ``N`` for the decomposed methods (the local nets
      in parallel: the slowest local net, then the coarse DNN and any further training), 1 for the global CNN and
      the end-to-end CNN-DNN (trained as one model);
    - ``speedup``: global CNN time over ``projected_time_s``.

    Works on ``results.json`` files written before the optional methods existed (their CNN-DNN row is the coarse
    DNN on ``coarse_input`` or, unknown, on probabilities).
    """
    m, t, p = results["metrics"], results["time_s"], results["params"]
    n = int(results["decomposition"]["num_subdomains"])
    inputs = results.get("coarse_input") or {}
    local_total, local_max, t_global = t.get("local_total"), t.get("local_max"), t.get("global")
    coarse_s = {inputs.get("coarse", "probs"): ("coarse", t.get("coarse"), p.get("coarse"))}
    if "coarse_alt" in inputs:
        coarse_s[inputs["coarse_alt"]] = ("coarse_alt", t.get("coarse_alt"), p.get("coarse_alt"))
    main = coarse_s[inputs.get("coarse", "probs")]

    def add(*values):
        return None if any(v is None for v in values) else sum(values)

    timing: dict[str, tuple] = {
        "global": (t_global, t_global, 1, p.get("global")),
        "mean_prob": (local_total, local_max, n, p.get("local_total")),
        "majority_vote": (local_total, local_max, n, p.get("local_total")),
        "e2e": (t.get("e2e"), t.get("e2e"), 1, p.get("e2e")),
        "transfer": (
            add(local_total, main[1], t.get("transfer")),
            add(local_max, main[1], t.get("transfer")),
            n,
            p.get("transfer"),
        ),
        "global_transfer": (
            add(local_total, t.get("global_transfer")),
            add(local_max, t.get("global_transfer")),
            n,
            p.get("global_transfer"),
        ),
        # Measured on its P devices at once: no one-device time exists.
        "global_ddp": (
            None,
            t.get("global_ddp"),
            (results.get("devices") or {}).get("global_ddp"),
            p.get("global_ddp"),
        ),
    }
    for kind, (_, seconds, coarse_params) in coarse_s.items():
        timing[f"cnn_dnn_{kind}"] = (
            add(local_total, seconds),
            add(local_max, seconds),
            n,
            add(p.get("local_total"), coarse_params),
        )
    metrics = dict(m)
    main_key = f"cnn_dnn_{inputs.get('coarse', 'probs')}"
    if metrics.get(main_key) is None and metrics.get("cnn_dnn") is not None:
        metrics[main_key] = metrics["cnn_dnn"]
    rows = []
    for key, name in METHODS.items():
        if metrics.get(key) is None or key not in timing:
            continue
        sequential, projected, devices, params = timing[key]
        r = metrics[key]
        rows.append(
            {
                "key": key,
                "name": name,
                "accuracy": r["accuracy"],
                "balanced_accuracy": r.get("balanced_accuracy"),
                "auc": r.get("auc"),
                "sequential_time_s": sequential,
                "projected_time_s": projected,
                "devices": devices,
                "speedup": (t_global / projected) if t_global and projected else None,
                "params": params,
            }
        )
    return rows
