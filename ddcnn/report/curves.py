"""Accuracy-versus-training-time curves of a run's methods and the speedup at equal accuracy.

Reads only the run directory: each full-image training's ``logs/metrics.csv`` (validation accuracy every epoch, test
accuracy at the snapshot epochs, ``time_s``: its training clock at the end of the epoch) and the coarse stage's
``curve.json`` (the CNN-DNN and the averaging combiner at the local nets' snapshot epochs, see
:mod:`ddcnn.stages.coarse`). A method's curve time is its own clock plus the recorded times of what it builds on,
as its results row adds them up (the global CNN transferred from local nets starts after the slowest local net).

**Speedup at equal accuracy** (the MLPerf / DAWNBench notion of training time: time to a target accuracy): the time
the global CNN needs to reach the CNN-DNN's validation accuracy, over the CNN-DNN's time, training clocks only, the
first epoch at or above the target (no interpolation). ``reached: false`` (no speedup) when the global CNN never
gets there within its epochs. The reverse is given too: the time each needs to reach the global CNN's best
validation accuracy, ``reached: false`` when the CNN-DNN never does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ddcnn import registry
from ddcnn.rundir import CURVE_FILE

__all__ = ["run_curves", "time_to_accuracy", "speedup_at_equal_accuracy"]

# Curves of the coarse DNNs and combiners come from the coarse stage's curve.json, not from a metrics.csv.
_NOT_FROM_CSV = ("coarse", "coarse_alt", "coarse_oof", "coarse_val", "stacker")


def _read_csv_curve(path) -> dict[str, list] | None:
    import csv

    if not path.is_file():
        return None
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows or "time_s" not in rows[0] or "val_acc" not in rows[0]:
        return None  # a training logged by an older ddcnn (no training clock per epoch)

    def number(value: str | None) -> float | None:
        return float(value) if value not in (None, "") else None

    out: dict[str, list] = {"epoch": [], "time_s": [], "val_acc": [], "test_acc": []}
    for row in rows:
        if number(row.get("time_s")) is None or number(row.get("val_acc")) is None:
            continue
        out["epoch"].append(int(float(row["epoch"])) + 1)
        out["time_s"].append(number(row["time_s"]))
        out["val_acc"].append(number(row["val_acc"]))
        out["test_acc"].append(number(row.get("test_acc")))
    return out if out["epoch"] else None


def _offset(terms: tuple[str, ...], stage: str, times: Mapping[str, Any]) -> float | None:
    """The recorded time of the terms a method builds on (all but the stage itself)."""
    total = 0.0
    for term in terms:
        if term == stage:
            continue
        value = times.get(term)
        if value is None:
            return None
        total += float(value)
    return total


def run_curves(run, results: Mapping[str, Any]) -> dict[str, dict[str, list]]:
    """``{method key: {"epoch", "time_s", "val_acc", "test_acc"}}`` of a run, as far as its files hold them.

    ``results`` are the run's results (``time_s``, ``val``, ``metrics``, ``coarse_input``) as
    :func:`ddcnn.report.results.evaluate_run` builds them; the CNN-DNN's curve ends with the final CNN-DNN (its
    training clocks: the slowest local net's and the coarse DNN's ``fit_time_s``).
    """
    times = results.get("time_s") or {}
    fit_times = results.get("fit_time_s") or {}
    curves: dict[str, dict[str, list]] = {}
    for stage in registry.STAGES:
        if stage.row is None or stage.name in _NOT_FROM_CSV or not run.is_done(stage.name):
            continue
        curve = _read_csv_curve(run.stage_dir(stage.name) / "logs" / "metrics.csv")
        offset = _offset(stage.row.projected, stage.name, fit_times or times)
        if curve is None or offset is None:
            continue
        curve["time_s"] = [offset + t for t in curve["time_s"]]
        curves[stage.row.key] = curve
    path = run.stage_dir("coarse") / CURVE_FILE
    if run.is_done("coarse") and path.is_file():
        saved = json.loads(path.read_text())
        for key in ("cnn_dnn", "mean_prob"):
            points = saved.get(key) or []
            curves[key] = {
                "epoch": [p["epoch"] for p in points],
                "time_s": [p["time_s"] for p in points],
                "val_acc": [p["val_acc"] for p in points],
                "test_acc": [p.get("test_acc") for p in points],
            }
        final_time = _offset(("local_max", "coarse"), "", fit_times)
        final_val = ((results.get("val") or {}).get("accuracy") or {}).get("cnn_dnn")
        final_test = (results.get("accuracy") or {}).get("cnn_dnn")
        if final_time is not None and final_val is not None and curves["cnn_dnn"]["epoch"]:
            curve = curves["cnn_dnn"]
            curve["epoch"].append(curve["epoch"][-1])
            curve["time_s"].append(final_time)
            curve["val_acc"].append(final_val)
            curve["test_acc"].append(final_test)
    return curves


def time_to_accuracy(curve: Mapping[str, list] | None, target: float) -> float | None:
    """The time of the first point at or above ``target`` validation accuracy, or ``None`` (never reached)."""
    if not curve:
        return None
    for t, acc in zip(curve["time_s"], curve["val_acc"], strict=True):
        if acc is not None and acc >= target - 1e-12:
            return float(t)
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b and math.isfinite(a) else None


def speedup_at_equal_accuracy(curves: Mapping[str, Mapping[str, list]], cnn_dnn_time: float | None) -> dict | None:
    """The speedup at equal accuracy of the CNN-DNN over the global CNN, both ways (module doc), or ``None`` when
    either curve is missing."""
    g, c = curves.get("global"), curves.get("cnn_dnn")
    if not g or not c or cnn_dnn_time is None:
        return None
    target = c["val_acc"][-1]  # the final CNN-DNN's validation accuracy
    t_global = time_to_accuracy(g, target)
    best_global = max(v for v in g["val_acc"] if v is not None)
    t_global_own = time_to_accuracy(g, best_global)
    t_cnn_dnn = time_to_accuracy(c, best_global)
    return {
        "at_cnn_dnn_accuracy": {
            "target_val_acc": target,
            "global_s": t_global,
            "cnn_dnn_s": cnn_dnn_time,
            "reached": t_global is not None,
            "speedup": _ratio(t_global, cnn_dnn_time),
        },
        "at_global_accuracy": {
            "target_val_acc": best_global,
            "global_s": t_global_own,
            "cnn_dnn_s": t_cnn_dnn,
            "reached": t_cnn_dnn is not None,
            "speedup": _ratio(t_global_own, t_cnn_dnn),
        },
    }
