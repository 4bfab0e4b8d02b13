"""results.json / results.md: rows a reader must not take at face value are flagged (flag_rows), and the execution
context of every compared time with the rule they are measured by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddcnn.pipeline import train
from ddcnn.report.results import TIMING_RULE, _devices_line, _equal_accuracy_line, flag_rows, timing_contexts


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


def test_times_of_different_contexts_are_flagged_with_what_differs():
    a = {"device": "cpu", "torch_threads": 1, "concurrent_trainings": 2, "host": "h"}
    b = {**a, "torch_threads": 2, "concurrent_trainings": 1}
    timing = timing_contexts({"local 0": a, "local 1": a, "global": b, "coarse": None})
    assert not timing["comparable"]
    assert set(timing["differences"]) == {"torch_threads", "concurrent_trainings"}
    assert timing["differences"]["torch_threads"] == {"1": ["local 0", "local 1"], "2": ["global"]}
    assert timing["unknown"] == ["coarse"]
    assert timing_contexts({"local 0": a, "global": a})["comparable"]


@pytest.mark.slow
def test_a_run_with_workers_says_its_times_come_from_different_contexts(make_cfg):
    cfg = make_cfg("parallel.workers=2", "parallel.threads_per_worker=1", "decomposition.grid=[1,2]")
    results = train(cfg)
    meta = json.loads((Path(cfg.paths.run_dir) / "local" / "00" / "meta.json").read_text())
    assert meta["context"]["concurrent_trainings"] == 2 and meta["context"]["torch_threads"] == 1
    assert {"host", "torch", "device"} <= set(meta["context"])
    assert not results["timing"]["comparable"] and "concurrent_trainings" in results["timing"]["differences"]
    md = (Path(cfg.paths.run_dir) / "results.md").read_text()
    assert "different execution contexts" in md and TIMING_RULE in md


def test_a_default_run_never_says_its_times_come_from_different_contexts(make_cfg):
    """The coarse DNN trains on one thread by design (coarse.num_threads): not a difference to warn about."""
    cfg = make_cfg()
    results = train(cfg)
    coarse = json.loads((Path(cfg.paths.run_dir) / "coarse" / "meta.json").read_text())["context"]
    assert coarse["threads_by_design"] == "coarse.num_threads" and coarse["torch_threads"] == 1
    assert results["timing"]["comparable"], results["timing"]["differences"]
    assert "different execution contexts" not in (Path(cfg.paths.run_dir) / "results.md").read_text()
    assert set(results["device_kinds"].values()) == {"cpu"} and "local 0" in results["device_kinds"]
    assert "- Device: every stage trained on cpu." in (Path(cfg.paths.run_dir) / "results.md").read_text()


def test_a_table_that_mixes_device_kinds_says_which_stages_ran_where():
    line = _devices_line({"local 0": "cuda (H200)", "local 1": "cuda (H200)", "global": "cpu"})
    assert line.startswith("- **Devices of different kinds**")
    assert "cpu: global" in line and "cuda (H200): local 0, local 1" in line


def test_threads_chosen_by_design_are_not_a_difference_but_other_threads_and_devices_are():
    local = {
        "device": "cuda:1",
        "device_kind": "cuda (H200)",
        "torch_threads": 2,
        "concurrent_trainings": 1,
        "host": "h",
    }
    coarse = {
        **local,
        "device": "cpu",
        "device_kind": "cpu",
        "torch_threads": 1,
        "threads_by_design": "coarse.num_threads",
    }
    other_gpu = {**local, "device": "cuda:0"}  # another index of the same kind of device
    timing = timing_contexts({"local 0": local, "local 1": other_gpu, "global": local})
    assert timing["comparable"]
    assert set(timing_contexts({"local 0": local, "coarse": coarse})["differences"]) == {"device_kind"}
    assert set(timing_contexts({"local 0": local, "global": {**local, "torch_threads": 4}})["differences"]) == {
        "torch_threads"
    }
    old = {"device": "cpu", "torch_threads": 2, "concurrent_trainings": 1, "host": "h"}  # recorded before device_kind
    assert timing_contexts({"local 0": old, "global": {**old, "device_kind": "cpu", "num_devices": 1}})["comparable"]
