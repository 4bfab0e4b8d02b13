"""results.json / results.md: rows a reader must not take at face value are flagged (flag_rows), and the execution
context of every compared time with the rule they are measured by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddcnn.pipeline import train
from ddcnn.report.results import TIMING_RULE, _devices_line, _equal_accuracy_line, flag_rows, timing_contexts


def _results(rows: dict[str, tuple], mean: float = 0.9) -> dict:
    """Rows ``key: (stage, accuracy[, auc[, balanced accuracy]])``."""
    methods = []
    for key, (stage, acc, *more) in rows.items():
        auc, balanced = (more + [None, None])[:2]
        methods.append(
            {"key": key, "name": key, "stage": stage, "accuracy": acc, "auc": auc, "balanced_accuracy": balanced}
        )
    return {"methods": methods, "accuracy": {"mean_prob": mean}}


TEN_CLASSES_ONE_AT_30 = [300] + [78] * 9  # 1002 test samples


def test_a_row_at_chance_is_flagged_with_what_to_try():
    # 10 classes but one holds 30% of the samples: 0.31 is at chance although far above 1/K.
    results = _results({"cnn_dnn_probs": ("coarse", 0.31), "global": ("global", 0.95), "mean_prob": (None, 0.9)})
    flags = flag_rows(results, rate=0.30, counts=TEN_CLASSES_ONE_AT_30)
    assert [(f["method"], f["kind"]) for f in flags] == [("cnn_dnn_probs", "chance")]
    assert "majority-class rate 0.3000" in flags[0]["message"] and "meta.json" in flags[0]["try"]


def test_an_imbalanced_well_ranked_binary_row_is_not_at_chance():
    # AdrenalMNIST3D's test split (229 + 69 volumes, majority rate 0.768): "within 3 standard errors of the majority
    # rate" spans 0.70-0.84, where these measured rows (seed 3 of bench/coarse.py's adrenal28 row) lie although their
    # scores separate the classes (AUC 0.80-0.89). They must not be flagged; rows whose AUC (or, without scores,
    # balanced accuracy) is also within noise of chance must.
    counts, rate = [229, 69], 229 / 298
    measured = {
        "global": ("global", 0.8054, 0.8750, 0.5898),
        "mean_prob": ("mean_prob", 0.8289, 0.8902, 0.6608),
        "majority_vote": ("majority_vote", 0.8289, 0.8079, 0.6659),
        "cnn_dnn_val": ("coarse", 0.8255, 0.7979, 0.6637),
    }
    assert flag_rows(_results(measured, mean=0.8289), rate=rate, counts=counts) == []
    at_chance = {
        "unranked": ("global", 0.7785, 0.55, 0.52),  # AUC within 3 standard errors (0.12) of 0.5
        "no_scores": ("global", 0.7785, None, 0.52),  # balanced accuracy within 3 standard errors (0.10) of 1/2
    }
    flags = flag_rows(_results({**measured, **at_chance}, mean=0.8289), rate=rate, counts=counts)
    assert [(f["method"], f["kind"]) for f in flags] == [("unranked", "chance"), ("no_scores", "chance")]
    assert "AUC 0.5500 is within noise of 0.5" in flags[0]["message"]
    assert "balanced accuracy 0.5200 is within noise of 1/K" in flags[1]["message"]


def test_a_coarse_row_far_below_averaging_is_flagged_and_noise_is_not():
    results = _results({"cnn_dnn_probs": ("coarse", 0.80), "stacker": ("stacker", 0.895)}, mean=0.90)
    flags = flag_rows(results, rate=0.1, counts=[200] * 10)
    assert [(f["method"], f["kind"]) for f in flags] == [("cnn_dnn_probs", "below_averaging")]
    # A global CNN below averaging is a result, not a failure of the combiner: not flagged.
    assert flag_rows(_results({"global": ("global", 0.5)}, mean=0.9), rate=0.1, counts=[200] * 10) == []


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
