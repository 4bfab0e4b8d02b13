"""Accuracy-versus-time curves and the speedup at equal accuracy (ddcnn/report/curves.py), on run directories built
by hand: the global CNN's metrics.csv and the coarse stage's curve.json hold exactly the numbers the test chooses."""

from __future__ import annotations

import csv
import json

import pytest

from ddcnn.report.curves import run_curves, speedup_at_equal_accuracy, time_to_accuracy
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
    assert curves["cnn_dnn"]["time_s"] == [5.0, 10.5, 11.0]  # snapshots, then the final CNN-DNN (10 + 1 s)
    assert curves["cnn_dnn"]["val_acc"][-1] == 0.95 and curves["mean_prob"]["epoch"] == [1, 2]
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
