"""Rows a reader must not take at face value are flagged (ddcnn/report/results.py: flag_rows)."""

from __future__ import annotations

from ddcnn.report.results import _equal_accuracy_line, flag_rows


def _results(rows: dict[str, tuple[str, float]], mean: float = 0.9) -> dict:
    methods = [{"key": key, "name": key, "stage": stage, "accuracy": acc} for key, (stage, acc) in rows.items()]
    return {"methods": methods, "accuracy": {"mean_prob": mean}}


def test_a_row_at_chance_is_flagged_with_what_to_try():
    # 10 classes but one holds 30% of the samples: 0.31 is at chance although far above 1/K.
    results = _results({"cnn_dnn_probs": ("coarse", 0.31), "global": ("global", 0.95), "mean_prob": (None, 0.9)})
    flags = flag_rows(results, rate=0.30, n_test=1000)
    assert [(f["method"], f["kind"]) for f in flags] == [("cnn_dnn_probs", "chance")]
    assert "majority-class rate 0.3000" in flags[0]["message"] and "meta.json" in flags[0]["try"]


def test_a_coarse_row_far_below_averaging_is_flagged_and_noise_is_not():
    results = _results({"cnn_dnn_probs": ("coarse", 0.80), "stacker": ("stacker", 0.895)}, mean=0.90)
    flags = flag_rows(results, rate=0.1, n_test=2000)
    assert [(f["method"], f["kind"]) for f in flags] == [("cnn_dnn_probs", "below_averaging")]
    # A global CNN below averaging is a result, not a failure of the combiner: not flagged.
    assert flag_rows(_results({"global": ("global", 0.5)}, mean=0.9), rate=0.1, n_test=2000) == []


def test_the_equal_accuracy_line_says_not_reached():
    equal = {
        "at_cnn_dnn_accuracy": {"target_val_acc": 0.95, "reached": False, "speedup": None},
        "at_global_accuracy": {
            "target_val_acc": 0.97,
            "reached": True,
            "speedup": 2.0,
            "global_s": 20.0,
            "cnn_dnn_s": 10.0,
        },
    }
    line = _equal_accuracy_line(equal)
    assert "0.9500: not reached by the global CNN" in line and "0.9700: 2.00x" in line
