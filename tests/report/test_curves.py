"""Accuracy-versus-time curves, the time to a fixed target and the speedup at equal accuracy (ddcnn/report/curves.py),
on run directories built by hand: the global CNN's metrics.csv and the coarse stage's curve.json hold exactly the
numbers the test chooses."""

from __future__ import annotations

import csv
import json
import math

import pytest

from ddcnn.report.curves import (
    makespan_by_devices,
    run_curves,
    speedup_at_equal_accuracy,
    target_accuracy,
    time_to_accuracy,
    time_to_target,
)
from ddcnn.rundir import CURVE_FILE, RunDir


def _metrics_csv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, ["epoch", "step", "lr", "train_loss", "train_acc", "val_loss", "val_acc", "time_s"])
        writer.writeheader()
        for epoch, (t, acc) in enumerate(rows):
            writer.writerow({"epoch": epoch, "step": epoch + 1, "val_acc": acc, "val_loss": 1 - acc, "time_s": t})


def _run(tmp_path, global_rows, cnn_dnn_points, local_fit=(8.0, 10.0), coarse_fit=1.0):
    """A finished run: 2 local nets, a coarse DNN with its curve, and a global CNN with its metrics.csv."""
    run = RunDir(tmp_path)
    for i, fit in enumerate(local_fit):
        run.make_stage_dir("local", i)
        run.mark_done("local", i, {"time_s": fit + 0.5, "fit_time_s": fit})
    folder = run.make_stage_dir("coarse")
    curve = [
        {"epoch": e, "time_s": t, "val_acc": a, "test_acc": a - 0.01} for e, (t, a) in enumerate(cnn_dnn_points, 1)
    ]
    (folder / CURVE_FILE).write_text(json.dumps({"input": "probs", "cnn_dnn": curve, "mean_prob": curve}))
    run.mark_done("coarse", None, {"time_s": coarse_fit + 0.1, "fit_time_s": coarse_fit})
    run.make_stage_dir("global")
    _metrics_csv(run.stage_dir("global") / "logs" / "metrics.csv", global_rows)
    run.mark_done("global", None, {"time_s": global_rows[-1][0] + 1, "fit_time_s": global_rows[-1][0]})
    return run


def _results(run, final_val, final_test=0.9):
    fit = {"local_max": 10.0, "local_total": 18.0, "coarse": 1.0, "global": 40.0}
    return {
        "fit_time_s": fit,
        "time_s": fit,
        "val": {"accuracy": {"cnn_dnn": final_val}},
        "accuracy": {"cnn_dnn": final_test},
    }


def test_the_global_cnn_needs_longer_to_the_cnn_dnns_accuracy(tmp_path):
    # The global CNN reaches 0.95 after 30 s; the CNN-DNN ends at 0.95 after 10 s (slowest local) + 1 s (coarse).
    run = _run(tmp_path, [(10.0, 0.80), (20.0, 0.93), (30.0, 0.95), (40.0, 0.97)], [(5.0, 0.90), (10.5, 0.94)])
    results = _results(run, final_val=0.95)
    curves = run_curves(run, results)
    assert curves["global"]["time_s"] == [10.0, 20.0, 30.0, 40.0]  # the global CNN builds on nothing
    # The snapshot of epoch 1, then the final CNN-DNN (10 + 1 s) in place of the snapshot of the last epoch (2): issue
    # #45 found the last epoch drawn twice, the snapshot and the final CNN-DNN appended after it.
    assert curves["cnn_dnn"]["time_s"] == [5.0, 11.0] and curves["cnn_dnn"]["epoch"] == [1, 2]
    assert curves["cnn_dnn"]["val_acc"] == [0.90, 0.95] and curves["cnn_dnn"]["test_acc"] == [0.89, 0.9]
    assert all(len(v) == 2 for v in curves["cnn_dnn"].values()) and curves["mean_prob"]["epoch"] == [1, 2]
    # Early stopping ended the local nets at epochs 5 and 4, after the last snapshot epoch (2) and before the next: the
    # snapshot of epoch 2 keeps its place and time, the final CNN-DNN is a point of its own at epoch 5 (it used to
    # overwrite the snapshot's time, so a target first reached at epoch 2 read as reached at the end).
    results["convergence"] = {"local": [{"epochs": 5}, {"epochs": 4}]}
    late = run_curves(run, results)["cnn_dnn"]
    assert late["epoch"] == [1, 2, 5] and late["time_s"] == [5.0, 10.5, 11.0] and late["val_acc"] == [0.90, 0.94, 0.95]
    assert time_to_accuracy(late, 0.94) == 10.5
    results["convergence"] = {"local": [{"epochs": 2}, {"epochs": 1}]}  # the last snapshot is the last epoch
    assert run_curves(run, results)["cnn_dnn"]["epoch"] == [1, 2]
    del results["convergence"]
    equal = speedup_at_equal_accuracy(curves, 11.0)
    at_cnn_dnn = equal["at_cnn_dnn_accuracy"]
    assert at_cnn_dnn["reached"] and at_cnn_dnn["global_s"] == 30.0  # the first epoch at or above 0.95
    assert at_cnn_dnn["speedup"] == pytest.approx(30.0 / 11.0)
    # The other way round: the global CNN's best (0.97) is never reached by the CNN-DNN.
    at_global = equal["at_global_accuracy"]
    assert at_global["target_val_acc"] == 0.97 and not at_global["reached"] and at_global["speedup"] is None


def test_not_reached_when_the_global_cnn_never_gets_there(tmp_path):
    run = _run(tmp_path, [(10.0, 0.80), (20.0, 0.85)], [(4.0, 0.90), (10.0, 0.96)])
    curves = run_curves(run, _results(run, final_val=0.96))
    at_cnn_dnn = speedup_at_equal_accuracy(curves, 11.0)["at_cnn_dnn_accuracy"]
    assert not at_cnn_dnn["reached"] and at_cnn_dnn["global_s"] is None and at_cnn_dnn["speedup"] is None
    # ... and the CNN-DNN reaches the global CNN's best (0.85) at its first snapshot.
    at_global = speedup_at_equal_accuracy(curves, 11.0)["at_global_accuracy"]
    assert at_global["reached"] and at_global["cnn_dnn_s"] == 4.0 and at_global["speedup"] == pytest.approx(20 / 4)


def test_time_to_accuracy_takes_the_first_point_at_or_above_without_interpolation():
    curve = {"time_s": [1.0, 2.0, 3.0], "val_acc": [0.5, 0.7, 0.9]}
    assert time_to_accuracy(curve, 0.7) == 2.0
    assert time_to_accuracy(curve, 0.71) == 3.0
    assert time_to_accuracy(curve, 0.95) is None


def test_a_run_without_curves_has_no_speedup_at_equal_accuracy(tmp_path):
    run = RunDir(tmp_path)
    assert run_curves(run, {"time_s": {}, "fit_time_s": {}}) == {}
    assert speedup_at_equal_accuracy({}, 3.0) is None


# --- time to a fixed target (docs/protocol.md) ----------------------------------------------------------------
def _snapshot_run(tmp_path, global_rows, points, predict=(0.5, 0.5), local_time=(10.0, 12.0), coarse_fit=1.0):
    """A run whose coarse curve records each local net's clock (``local_s``) and the coarse fit's training clock
    (``coarse_fit_s``) at every snapshot, as the coarse stage writes them; each local net spent ``predict`` seconds on
    its outputs after its training clock stopped."""
    run = RunDir(tmp_path)
    for i, (t, p) in enumerate(zip(local_time, predict, strict=True)):
        run.make_stage_dir("local", i)
        run.mark_done("local", i, {"time_s": t + p, "fit_time_s": t})
    folder = run.make_stage_dir("coarse")
    curve = [
        {"epoch": e, "local_s": local, "local_max_s": max(local), "coarse_s": 9.0, "coarse_fit_s": fit, "val_acc": a}
        for e, (local, fit, a) in enumerate(points, 1)
    ]
    for point in curve:
        point["time_s"] = point["local_max_s"] + point["coarse_s"]  # what the stage writes: wall time of the fit
    (folder / CURVE_FILE).write_text(json.dumps({"input": "probs", "cnn_dnn": curve, "mean_prob": curve}))
    run.mark_done("coarse", None, {"time_s": coarse_fit + 0.2, "fit_time_s": coarse_fit})
    run.make_stage_dir("global")
    _metrics_csv(run.stage_dir("global") / "logs" / "metrics.csv", global_rows)
    run.mark_done("global", None, {"time_s": global_rows[-1][0] + 1, "fit_time_s": global_rows[-1][0]})
    times = {"local": [t + p for t, p in zip(local_time, predict, strict=True)], "coarse": coarse_fit + 0.2}
    times |= {"local_max": max(times["local"]), "global": global_rows[-1][0] + 1}
    fit = {"local_max": max(local_time), "coarse": coarse_fit, "global": global_rows[-1][0]}
    return run, {"time_s": times, "fit_time_s": fit, "predict_time_s": {"local": list(predict)}}


def test_time_to_target_is_set_by_the_global_cnn_and_counts_the_cnn_dnns_inference_and_coarse_clock(tmp_path):
    # Global CNN: best validation accuracy 0.90 on 400 validation samples; one standard error is 0.015, so the
    # target is 0.885, which its epoch 3 (0.89) reaches after 30 s.
    global_rows = [(10.0, 0.70), (20.0, 0.80), (30.0, 0.89), (40.0, 0.90)]
    # The CNN-DNN's snapshots: 0.80 at epoch 1, 0.886 at epoch 2, when the local nets' clocks are 6 and 8 s; the
    # last (epoch 3, at the end of the local nets' training) is the final CNN-DNN's place.
    points = [([3.0, 4.0], 0.4, 0.80), ([6.0, 8.0], 0.6, 0.886), ([10.0, 12.0], 1.0, 0.5)]
    run, results = _snapshot_run(tmp_path, global_rows, points, predict=(0.5, 0.25))
    for cnn_dnn_val in (0.95, 0.70):  # the CNN-DNN's own (selected) validation accuracy never moves the target
        results["val"] = {"accuracy": {"cnn_dnn": cnn_dnn_val}}
        results["accuracy"] = {"cnn_dnn": 0.9}
        curves = run_curves(run, results)
        target = target_accuracy(curves, n_val=400, converged=True)
        assert target["value"] == pytest.approx(0.90 - math.sqrt(0.9 * 0.1 / 400))
        assert target["tolerance"] == pytest.approx(0.015) and "global CNN (converged)" in target["source"]
        ttt = time_to_target(curves, target, {"global": "budget", "cnn_dnn": "budget"}, {"global": 1, "cnn_dnn": 2}, 2)
        assert ttt["global"] == {"time_s": 30.0, "reached": True, "why_not": None, "epoch": 3, "devices": 1}
        # Epoch 2: slowest local net with its inference max(6 + 0.5, 8 + 0.25) = 8.25 s, then the coarse fit's
        # training clock 0.6 s (not its wall time, 9 s): 8.85 s.
        assert ttt["cnn_dnn"]["reached"] and ttt["cnn_dnn"]["epoch"] == 2
        assert ttt["cnn_dnn"]["time_s"] == pytest.approx(8.85)
        # On one device the two local nets run one after the other: 6.5 + 8.25 + 0.6.
        assert ttt["cnn_dnn"]["time_s_by_devices"] == pytest.approx({"1": 15.35, "2": 8.85})
    # The old key reads the fixed target from the new code.
    equal = speedup_at_equal_accuracy(curves, 12.45, ttt)
    assert equal["at_global_accuracy"]["target_val_acc"] == pytest.approx(target["value"])
    assert equal["at_global_accuracy"]["speedup"] == pytest.approx(30.0 / 8.85)


def test_a_target_not_reached_says_whether_the_budget_or_early_stopping_ended_the_training(tmp_path):
    global_rows = [(10.0, 0.80), (20.0, 0.95)]
    points = [([3.0, 4.0], 0.4, 0.80), ([6.0, 8.0], 0.6, 0.85)]
    run, results = _snapshot_run(tmp_path, global_rows, points)
    results["val"], results["accuracy"] = {"accuracy": {"cnn_dnn": 0.86}}, {"cnn_dnn": 0.86}
    curves = run_curves(run, results)
    target = target_accuracy(curves, n_val=1000, converged=False)
    assert "NOT converged" in target["source"] and target["baseline_converged"] is False
    devices = {"global": 1, "cnn_dnn": 2}
    budget = time_to_target(curves, target, {"cnn_dnn": "budget", "mean_prob": "budget"}, devices, 2)
    assert budget["cnn_dnn"] == {"time_s": None, "reached": False, "why_not": "budget", "epoch": None, "devices": 2}
    stopped = time_to_target(curves, target, {"cnn_dnn": "early_stopping"}, devices, 2)
    assert stopped["cnn_dnn"]["why_not"] == "stopped" and not stopped["cnn_dnn"]["reached"]
    assert time_to_target({"global": curves["global"]}, target, {}, devices, 2)["cnn_dnn"]["why_not"] == "no curve"
    assert target_accuracy({}, n_val=100, converged=True) is None


def test_the_cnn_dnn_on_p_devices_is_its_local_nets_placed_longest_first_then_the_coarse_dnn():
    # 4 local nets of 10, 10, 10 and 30 s: one device 60 s, two devices 30 s (30 | 10+10+10), four devices 30 s.
    assert makespan_by_devices([10.0, 10.0, 10.0, 30.0], 2.0, [1, 2, 4]) == pytest.approx(
        {"1": 62.0, "2": 32.0, "4": 32.0}
    )
    # 5 nets of 3, 3, 2, 2, 2 s on two devices: LPT gives 3+2+2 | 3+2 = 7 s (the optimum is 6: LPT's 4/3 bound).
    assert makespan_by_devices([3.0, 3.0, 2.0, 2.0, 2.0], 0.0, [2]) == {"2": 7.0}
