"""Accuracy-versus-training-time curves of a run's methods, the time to a fixed target and the speedup at equal
accuracy.

Reads only the run directory: each full-image training's ``logs/metrics.csv`` (validation accuracy every epoch, test
accuracy at the snapshot epochs, ``time_s``: its training clock at the end of the epoch) and the coarse stage's
``curve.json`` (the CNN-DNN and the averaging combiner at the local nets' snapshot epochs, see
:mod:`ddcnn.stages.coarse`). A method's curve time is its own training clock plus the recorded time of what it builds
on, as its results row adds them up (the global CNN transferred from local nets starts after the slowest local net).
The CNN-DNN's points add up what it needs before it can predict: each local net's training clock at the snapshot
epoch plus the inference of its outputs (its recorded ``time_s - fit_time_s``: the predictions the coarse DNN reads),
the slowest of these, then the coarse fit's training clock.

**Time to a fixed target** (:func:`time_to_target`, ``results.json`` ``time_to_target``; the protocol of
``docs/protocol.md``, after MLPerf Training): the target is set by the global CNN alone, never by the CNN-DNN's own
selection: its accuracy on the held-out ``val_target`` split (:func:`held_out_target`, which no selection saw) minus one
binomial standard error of that split, or, without that split, its best validation accuracy minus one standard error
of the validation split. Each method's time
is its training clock at its first evaluation at or above the target, no interpolation; a method that never gets
there says why (``budget``: it trained every epoch; ``stopped``: early stopping ended it; ``no curve``).

**Speedup at equal accuracy** (``speedup_at_equal_accuracy``, kept for readers of older results): at the CNN-DNN's
final validation accuracy (the global CNN's time over the CNN-DNN's) and at the fixed target above.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ddcnn import registry
from ddcnn.parallel.schedule import lpt
from ddcnn.rundir import CURVE_FILE

__all__ = [
    "TARGET_TOLERANCE_SE",
    "run_curves",
    "time_to_accuracy",
    "target_accuracy",
    "held_out_target",
    "time_to_target",
    "speedup_at_equal_accuracy",
    "makespan_by_devices",
]

# The target's tolerance below the global CNN's best validation accuracy, in binomial standard errors of the
# validation split (sqrt(p(1-p)/n_val)): the protocol allows at most one.
TARGET_TOLERANCE_SE = 1.0

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
    if "val_target_acc" in rows[0]:
        out["val_target_acc"] = []
    for row in rows:
        if number(row.get("time_s")) is None or number(row.get("val_acc")) is None:
            continue
        out["epoch"].append(int(float(row["epoch"])) + 1)
        out["time_s"].append(number(row["time_s"]))
        out["val_acc"].append(number(row["val_acc"]))
        out["test_acc"].append(number(row.get("test_acc")))
        if "val_target_acc" in out:
            out["val_target_acc"].append(number(row.get("val_target_acc")))
    return out if out["epoch"] else None


def _offset(terms: tuple[str, ...], stage: str, times: Mapping[str, Any]) -> float | None:
    """The recorded time of the terms a method builds on (all but the stage itself)."""
    values = [times.get(term) for term in terms if term != stage]
    return None if None in values else sum((float(v) for v in values), 0.0)


def _local_ready(point: Mapping[str, Any], predict: list[float]) -> float:
    """When the slowest local net of a snapshot point has its outputs: training clock plus its output inference."""
    local = point.get("local_s")
    if local and len(local) == len(predict):
        return max(float(t) + p for t, p in zip(local, predict, strict=True))
    return float(point.get("local_max_s", point["time_s"])) + max(predict, default=0.0)


def _last_local_epoch(results: Mapping[str, Any]) -> int | None:
    """The last epoch any local net trained (their convergence records' ``epochs``), or ``None`` where unrecorded."""
    records = (results.get("convergence") or {}).get("local") or []
    epochs = [int(r["epochs"]) for r in records if isinstance(r, Mapping) and r.get("epochs")]
    return max(epochs) if epochs and len(epochs) == len(records) else None


def run_curves(run, results: Mapping[str, Any]) -> dict[str, dict[str, list]]:
    """``{method key: {"epoch", "time_s", "val_acc", "test_acc"}}`` of a run, as far as its files hold them.

    ``results`` are the run's results (``time_s``, ``fit_time_s``, ``predict_time_s``, ``val``, ``metrics``,
    ``coarse_input``) as :func:`ddcnn.report.results.evaluate_run` builds them. The CNN-DNN's curve (module doc) ends
    with the final CNN-DNN at the last epoch a local net trained, in place of the snapshot of that epoch or after the
    last snapshot where early stopping ended every net before the next snapshot epoch: the slowest local net's recorded
    time (training and output inference) plus the coarse DNN's training clock (``fit_time_s``). The CNN-DNN's points
    also carry ``local_s``: each local net's time to its outputs at that epoch (for the projection on P devices).
    """
    times = results.get("time_s") or {}
    fit_times = results.get("fit_time_s") or {}
    predict = list((results.get("predict_time_s") or {}).get("local") or [])
    curves: dict[str, dict[str, list]] = {}
    for stage in registry.STAGES:
        if stage.row is None or stage.name in _NOT_FROM_CSV or not run.is_done(stage.name):
            continue
        curve = _read_csv_curve(run.stage_dir(stage.name) / "logs" / "metrics.csv")
        offset = _offset(stage.row.projected, stage.name, times or fit_times)
        if curve is None or offset is None:
            continue
        curve["time_s"] = [offset + t for t in curve["time_s"]]
        curves[stage.row.key] = curve
    path = run.stage_dir("coarse") / CURVE_FILE
    if run.is_done("coarse") and path.is_file():
        saved = json.loads(path.read_text())
        for key in ("cnn_dnn", "mean_prob"):
            points = saved.get(key) or []
            ready = [_local_ready(p, predict) for p in points]
            if key == "cnn_dnn":  # the coarse fit's training clock (older curves recorded its wall time only)
                point_times = [
                    r + float(p.get("coarse_fit_s", p.get("coarse_s", 0.0))) for r, p in zip(ready, points, strict=True)
                ]
            else:
                point_times = ready
            curves[key] = {
                "epoch": [p["epoch"] for p in points],
                "time_s": point_times,
                "val_acc": [p["val_acc"] for p in points],
                "test_acc": [p.get("test_acc") for p in points],
                **(
                    {"val_target_acc": [p.get("val_target_acc") for p in points]}
                    if any("val_target_acc" in p for p in points)
                    else {}
                ),
                "local_s": [
                    [float(t) + q for t, q in zip(p["local_s"], predict, strict=True)]
                    if p.get("local_s") and len(p["local_s"]) == len(predict)
                    else None
                    for p in points
                ],
            }
        final_time = None
        if times.get("local_max") is not None and fit_times.get("coarse") is not None:
            final_time = float(times["local_max"]) + float(fit_times["coarse"])
        final_val = ((results.get("val") or {}).get("accuracy") or {}).get("cnn_dnn")
        final_test = (results.get("accuracy") or {}).get("cnn_dnn")
        if final_time is not None and final_val is not None and curves["cnn_dnn"]["epoch"]:
            # The final CNN-DNN (the local nets' selected weights, the coarse stage's own fit: the row results.md
            # reports) is the curve's point at the last epoch any local net trained: it takes the place of the
            # snapshot of that epoch (a local net stopped early stands in with its final outputs there), or, where
            # early stopping ended every net before the next snapshot epoch, comes after the last snapshot: one point
            # per epoch, each at its own epoch and time.
            curve = curves["cnn_dnn"]
            last = _last_local_epoch(results)
            if last is not None and last > curve["epoch"][-1]:
                for values in curve.values():
                    values.append(values[-1])  # a new point; its figures are set below
                curve["epoch"][-1] = last
            target = ((results.get("val_target") or {}).get("accuracy") or {}).get("cnn_dnn")
            local = times.get("local")
            final = {
                "time_s": final_time,
                "val_acc": final_val,
                "test_acc": final_test,
                "local_s": [float(t) for t in local] if local else None,
                **({"val_target_acc": target} if "val_target_acc" in curve else {}),
            }
            for key, value in final.items():
                curve[key][-1] = value
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


def makespan_by_devices(local_s: list[float], after_s: float, counts: list[int]) -> dict[str, float]:
    """``{str(P): seconds}``: ``local_s`` (one time per local net) placed longest first on P equal devices
    (:func:`ddcnn.parallel.schedule.lpt`, as ``ddcnn-scaling`` does), plus ``after_s`` (the coarse stage, on one
    device, after the last local net)."""
    costs = {i: float(t) for i, t in enumerate(local_s)}
    return {str(p): lpt(costs, [1.0] * p).makespan + float(after_s) for p in counts}


def target_accuracy(
    curves: Mapping[str, Mapping[str, list]], n_val: int | None, converged: bool | None, reused: bool = False
) -> dict | None:
    """The fixed target of :func:`time_to_target`: the global CNN's best validation accuracy minus
    :data:`TARGET_TOLERANCE_SE` binomial standard errors of the validation split (``n_val`` samples), or ``None``
    when the global CNN has no curve.

    ``converged`` is the global CNN's ``converged`` (``None``: not recorded); the source says whether the target comes
    from a converged baseline.
    """
    g = curves.get("global")
    values = [v for v in (g or {}).get("val_acc", []) if v is not None]
    if not values:
        return None
    best = max(values)
    se = math.sqrt(best * (1 - best) / n_val) if n_val else 0.0
    tolerance = TARGET_TOLERANCE_SE * se
    state = {True: "converged", False: "NOT converged", None: "convergence unknown"}[converged]
    source = (
        f"global CNN ({state}{', reused from the store' if reused else ''}): best validation accuracy {best:.4f} "
        f"minus {TARGET_TOLERANCE_SE:g} binomial standard error of the validation split (n_val={n_val or '?'})"
    )
    return {
        "value": best - tolerance,
        "source": source,
        "tolerance": tolerance,
        "best_val_acc": best,
        "n_val": n_val,
        "baseline_converged": converged,
    }


def held_out_target(
    accuracy: float | None, n: int | None, method: str, converged: bool | None, reused: bool = False
) -> dict | None:
    """A fixed target on the ``val_target`` split (``data.val_target_fraction``), which no choice of any method saw:
    ``method``'s accuracy there (its selected net) minus :data:`TARGET_TOLERANCE_SE` binomial standard errors of
    that split (``n`` samples); ``None`` without it. Every method's time to it is read on its ``val_target_acc``
    curve."""
    if accuracy is None or not n:
        return None
    se = math.sqrt(accuracy * (1 - accuracy) / n)
    tolerance = TARGET_TOLERANCE_SE * se
    state = {True: "converged", False: "NOT converged", None: "convergence unknown"}[converged]
    return {
        "value": accuracy - tolerance,
        "source": (
            f"{method} ({state}{', reused from the store' if reused else ''}): accuracy {accuracy:.4f} on the "
            f"held-out target split no choice saw, minus {TARGET_TOLERANCE_SE:g} binomial standard error of it "
            f"(n_val_target={n})"
        ),
        "tolerance": tolerance,
        "accuracy": accuracy,
        "n_val_target": n,
        "split": "val_target",
        "metric": "val_target_acc",
        "baseline_converged": converged,
    }


def _entry(
    curve: Mapping[str, list] | None, target: float, ended: str | None, devices: int | None, metric: str = "val_acc"
) -> dict:
    """One method's time to ``target`` on its ``metric`` curve: the first evaluation at or above it, or why it never
    got there."""
    if not curve or not curve.get("time_s") or metric not in curve:
        return {"time_s": None, "reached": False, "why_not": "no curve", "epoch": None, "devices": devices}
    for i, (t, acc) in enumerate(zip(curve["time_s"], curve[metric], strict=True)):
        if acc is not None and acc >= target - 1e-12:
            return {
                "time_s": float(t),
                "reached": True,
                "why_not": None,
                "epoch": curve["epoch"][i],
                "devices": devices,
            }
    why = "stopped" if ended == "early_stopping" else "budget"
    return {"time_s": None, "reached": False, "why_not": why, "epoch": None, "devices": devices}


def time_to_target(
    curves: Mapping[str, Mapping[str, list]],
    target: dict | None,
    ended: Mapping[str, str | None],
    devices: Mapping[str, int | None],
    num_subdomains: int,
) -> dict | None:
    """``{"target": target, <method key>: {"time_s", "reached", "why_not", "epoch", "devices"}}``, or ``None``
    without a target (module doc).

    Args:
        curves: :func:`run_curves`.
        target: :func:`target_accuracy`.
        ended: How each method's training ended (``"early_stopping"``, ``"budget"`` or ``None``), by curve key.
        devices: The devices each method's time is on (``N`` for the CNN-DNN, 1 for the global CNN, P for DDP).
        num_subdomains: N; the CNN-DNN's entry adds ``time_s_by_devices``: its time to the target with its N local
            nets placed on 1, 2 and N devices (the coarse fit of the point after them).
    """
    if target is None:
        return None
    out: dict[str, Any] = {"target": target}
    metric = target.get("metric", "val_acc")
    for key in dict.fromkeys(("global", "cnn_dnn", *curves)):
        entry = _entry(curves.get(key), target["value"], ended.get(key), devices.get(key), metric)
        curve = curves.get(key)
        if key == "cnn_dnn" and entry["reached"] and curve is not None:
            i = curve["time_s"].index(entry["time_s"])
            local = (curve.get("local_s") or [None] * len(curve["time_s"]))[i]
            if local:
                coarse = entry["time_s"] - max(local)
                counts = sorted({1, min(2, num_subdomains), num_subdomains})
                entry["time_s_by_devices"] = makespan_by_devices(local, coarse, counts)
        out[key] = entry
    return out


def speedup_at_equal_accuracy(
    curves: Mapping[str, Mapping[str, list]], cnn_dnn_time: float | None, to_target: Mapping | None = None
) -> dict | None:
    """The speedup at equal accuracy of the CNN-DNN over the global CNN, or ``None`` when either curve is missing.

    ``at_cnn_dnn_accuracy``: at the CNN-DNN's final validation accuracy (a target its own selection chose: shown for
    continuity, not a verdict); ``at_global_accuracy``: at the fixed target of ``to_target`` (:func:`time_to_target`;
    without it, at the global CNN's best validation accuracy).
    """
    g, c = curves.get("global"), curves.get("cnn_dnn")
    if not g or not c or cnn_dnn_time is None:
        return None
    target = c["val_acc"][-1]  # the final CNN-DNN's validation accuracy
    t_global = time_to_accuracy(g, target)
    if to_target:
        fixed = to_target["target"]["value"]
        t_global_own, t_cnn_dnn = to_target["global"]["time_s"], to_target["cnn_dnn"]["time_s"]
    else:
        fixed = max(v for v in g["val_acc"] if v is not None)
        t_global_own, t_cnn_dnn = time_to_accuracy(g, fixed), time_to_accuracy(c, fixed)
    return {
        "at_cnn_dnn_accuracy": {
            "target_val_acc": target,
            "global_s": t_global,
            "cnn_dnn_s": cnn_dnn_time,
            "reached": t_global is not None,
            "speedup": _ratio(t_global, cnn_dnn_time),
        },
        "at_global_accuracy": {
            "target_val_acc": fixed,
            "global_s": t_global_own,
            "cnn_dnn_s": t_cnn_dnn,
            "reached": t_cnn_dnn is not None and t_global_own is not None,
            "speedup": _ratio(t_global_own, t_cnn_dnn),
        },
    }
