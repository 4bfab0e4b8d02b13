"""The ``evaluate`` stage: one table of every method of a run, as ``results.json`` and ``results.md``."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from ddcnn.report.combiners import majority_vote, mean_probability

log = logging.getLogger(__name__)

__all__ = ["classification_metrics", "evaluate_run", "results_markdown"]


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
    results = {
        "accuracy": accuracy,
        "metrics": metrics,
        "time_s": time_s,
        "projected_time_s": projected,
        "projected_speedup": speedup,
        "params": params,
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
        results["seed"] = int(cfg.seed)
    atomic_write_json(run.root / "results.json", results)
    atomic_write_text(run.root / "results.md", results_markdown(results))
    return results
