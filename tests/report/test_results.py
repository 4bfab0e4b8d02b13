"""results.json / results.md: rows a reader must not take at face value are flagged (flag_rows: at chance, far below
averaging, unconverged), the execution context of every compared time with the rule they are measured by, and the
protocol's figures (time to a fixed target, equal-device speedups, one seed's differences without a verdict)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ddcnn.pipeline import train
from ddcnn.report.results import (
    TIMING_RULE,
    _devices_line,
    _time_to_target_line,
    flag_lines,
    flag_rows,
    results_markdown,
    timing_contexts,
)
from tests.conftest import mark_converged


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


def test_the_below_averaging_advice_names_what_was_in_use():
    """Issue #45: "use the default coarse.net" was printed where the default net was in use, and for the convex
    stacker, which has no coarse net."""
    rows = {"cnn_dnn_probs": ("coarse", 0.80), "stacker": ("stacker", 0.80)}
    results = _results(rows, mean=0.90)
    results["coarse_nets"] = {
        "coarse": {"_target_": "ddcnn.models.coarse.CoarseMLP", "input_norm": "standardize", "skip": "mean_prob"}
    }
    tries = {f["method"]: f["try"] for f in flag_rows(results, rate=0.1, counts=[200] * 10)}
    assert "Use the default coarse.net" not in tries["cnn_dnn_probs"] and "was in use" in tries["cnn_dnn_probs"]
    assert tries["cnn_dnn_probs"].endswith("coarse.monitor=val_loss.")
    assert "coarse.net" not in tries["stacker"].replace("no coarse net", "") and "no coarse net" in tries["stacker"]
    results["coarse_nets"]["coarse"] |= {"skip": "none"}  # the paper's plain MLP: pointed to the default
    tries = {f["method"]: f["try"] for f in flag_rows(results, rate=0.1, counts=[200] * 10)}
    assert "coarse.net.skip=mean_prob" in tries["cnn_dnn_probs"]


def test_an_unconverged_flag_gives_each_trainings_recorded_cause_and_fix():
    results = _results({"global": ("global", 0.9)}, mean=0.9)
    record = {"converged": False, "reasons": ["overfitting: ..."], "stopped_by": "budget", "cause": "overfitting"}
    results["convergence"] = {"global": record | {"advice": "overfitting (...): early stopping, engine.patience=3"}}
    flag = next(f for f in flag_rows(results, rate=0.1, counts=[200] * 10) if f["kind"] == "unconverged")
    assert (
        flag["try"]
        == "Try: overfitting (...): early stopping, engine.patience=3. Until then no verdict against it holds."
    )
    results["convergence"] = {"global": record}  # a record of an older ddcnn: the general advice
    flag = next(f for f in flag_rows(results, rate=0.1, counts=[200] * 10) if f["kind"] == "unconverged")
    assert flag["try"].startswith("Train it to convergence")


def _with_local(results: dict, local: list[float], val: list[float] | None = None) -> dict:
    """``results`` with local nets of test accuracies ``local`` (validation ``val``), fed into every combiner row."""
    results["metrics"] = {"local": [{"accuracy": a, "auc": None, "balanced_accuracy": None} for a in local]}
    results["val"] = {"accuracy": {"local": val if val is not None else local}}
    return results


def test_a_local_net_at_chance_is_flagged_with_its_index_accuracy_rate_and_the_rows_it_feeds():
    """Issue #45 item 6: only rows got a chance flag; a local net at chance was averaged in silently."""
    rows = {"mean_prob": (None, 0.9), "cnn_dnn_probs": ("coarse", 0.9), "global": ("global", 0.95)}
    results = _with_local(_results(rows), [0.92, 0.10, 0.91], val=[0.93, 0.09, 0.90])
    results["train_accuracy"] = {"local": [None, {"epochs": 0.12, "selected": 0.10}, None]}
    results |= {"train_majority_rate": 0.10, "data": {"n_train": 1000}}
    flags = [f for f in flag_rows(results, rate=0.10, counts=[200] * 10) if f["kind"] == "chance"]
    assert [f["method"] for f in flags] == ["local/1"]
    flag = flags[0]
    assert (flag["subdomain"], flag["accuracy"], flag["val_accuracy"], flag["majority_rate"]) == (1, 0.10, 0.09, 0.10)
    assert flag["feeds"] == ["mean_prob", "cnn_dnn_probs"]  # every row built on the local nets, not the global CNN
    assert flag["learning"] == "did not learn" and "decomposition.overlap" in flag["try"]
    md = "\n".join(flag_lines({**results, "flags": flags}))
    line = next(x for x in md.splitlines() if x.startswith("- **local net 1**"))
    assert "test accuracy 0.1000 (validation 0.0900) is at chance (majority-class rate 0.1000)" in line
    assert "It feeds 2 rows: **mean_prob**, **cnn_dnn_probs**" in line


def test_a_net_at_chance_that_fits_its_training_images_does_not_generalise():
    """Issue #45 item 6: a torchvision mobilenet_v2 global CNN at the majority rate on validation and test with
    training accuracy 0.72 was reported as "did not learn"."""
    results = _results({"global": ("global", 0.231)})
    results |= {"train_majority_rate": 0.231, "data": {"n_train": 2000}}
    for figures in ({"epochs": 0.72, "selected": None}, {"epochs": 0.70, "selected": 0.72}):
        results["train_accuracy"] = {"global": figures}
        flag = flag_rows(results, rate=0.231, counts=[231, 769])[0]
        assert flag["kind"] == "chance" and flag["learning"] == "does not generalise"
        assert "does not generalise (training 72.0% vs test 23.1%: a gap of 48.9 points)" in flag["message"]
        assert "did not learn" not in flag["message"] and flag["gap_points"] == pytest.approx(48.9)
        assert "optimizer.weight_decay" in flag["try"] and "lower optimizer.lr" not in flag["try"]
    # training mode only: the selected weights at chance on their own training images in evaluation mode say so
    results["train_accuracy"] = {"global": {"epochs": 0.72, "selected": 0.231}}
    flag = flag_rows(results, rate=0.231, counts=[231, 769])[0]
    assert (
        "training 72.0% vs test 23.1%" in flag["message"] and "score 23.1% on the training images in" in flag["message"]
    )
    # the training accuracy stayed at chance too: did not learn
    results["train_accuracy"] = {"global": {"epochs": 0.235, "selected": 0.231}}
    flag = flag_rows(results, rate=0.231, counts=[231, 769])[0]
    assert flag["learning"] == "did not learn" and "did not learn (training accuracy at most 23.5%" in flag["message"]
    assert "lower optimizer.lr" in flag["try"]
    # nothing recorded: said so, not guessed
    del results["train_accuracy"]
    flag = flag_rows(results, rate=0.231, counts=[231, 769])[0]
    assert flag["learning"] == "unknown" and "no training accuracy was recorded" in flag["message"]
    assert "did not learn (" not in flag["message"] and "does not generalise (" not in flag["message"]


def test_a_row_that_ranks_the_classes_but_answers_one_class_decides_like_a_constant_and_gives_no_verdict():
    """Issue #45: a net at the majority rate whose scores still rank the classes (AUC far above 0.5) clears the
    at-chance test; its accuracy is a constant guess's all the same, so it is flagged and no lead is printed against
    it. A weak net that does decide (AdrenalMNIST3D's measured global CNN, 0.81 against 0.77) is not flagged."""
    counts, rate = [229, 69], 229 / 298
    rows = {
        "global": ("global", 229 / 298, 0.86, 0.5),
        "cnn_dnn_probs": ("coarse", 0.8255, 0.80, 0.66),
        "mean_prob": (None, 0.8289, 0.89, 0.66),
    }
    results = _results(rows, mean=0.8289)
    results["methods"][0]["decision_share"] = 1.0  # every decision "normal"
    results["methods"][1]["decision_share"] = 0.85
    results["methods"][2]["decision_share"] = 0.86
    results["convergence"] = {"global": {"converged": True, "epochs": 9, "stopped_by": "early_stopping"}}
    flags = flag_rows(results, rate=rate, counts=counts)
    assert [(f["method"], f["kind"]) for f in flags] == [("global", "constant")]
    assert "100.0% of its test decisions are one class" in flags[0]["message"]
    assert "engine.patience=12" in flags[0]["try"] and "after 9 epochs" in flags[0]["try"]
    results["flags"] = flags
    md = "\n".join(flag_lines(results))
    assert "**Decides like a constant guess**" in md and "no verdict on accuracy against it" in md
    # the measured adrenal row that decides (balanced accuracy 0.59) stays unflagged with any share below 98%
    results["methods"][0].update(accuracy=0.8054, auc=0.875, balanced_accuracy=0.5898, decision_share=0.93)
    assert flag_rows(results, rate=rate, counts=counts) == []


def test_no_lead_is_printed_against_a_baseline_at_chance_or_deciding_like_a_constant():
    import torch

    from ddcnn.report.results import _single_seed_lines, image_pairs

    results = _results({"cnn_dnn_probs": ("coarse", 0.9), "global": ("global", 0.5), "mean_prob": (None, 0.85)})
    results["accuracy"] = {"cnn_dnn": 0.9, "global": 0.5, "mean_prob": 0.665}
    results["convergence"] = {"global": {"converged": True}, "local": [{"converged": True}]}
    correct = {
        "cnn_dnn": torch.arange(200) % 10 != 0,
        "global": torch.arange(200) % 2 == 0,
        "mean_prob": torch.arange(200) % 3 != 0,
    }
    for kind, said in (("chance", "baseline at chance"), ("constant", "baseline decides like a constant guess")):
        results["flags"] = [{"method": "global", "kind": kind}]
        pairs = {p["baseline"]: p for p in image_pairs(results, correct)}
        assert pairs["global"]["verdict"] == said and pairs["global"]["baseline_converged"] is True
        assert pairs["global"]["difference"] == pytest.approx(40.0)  # the figure stays in results.json
        assert pairs["mean_prob"]["verdict"] == "better"  # an unflagged baseline keeps its verdict
        results["paired_test"] = list(pairs.values())
        line = "\n".join(_single_seed_lines(results))
        assert f"CNN-DNN − global CNN: {said};" in line and "+40.00" not in line
        assert "CNN-DNN − mean probability: +23.50 points" in line


def test_a_pairs_baseline_convergence_is_its_own_trainings_not_the_local_nets():
    """CNN-DNN − ensemble of global CNNs and − the wide global CNN are judged on the ensemble's members and the wide
    CNN's training (PAIRS' fourth field), as the multi-seed tables do, not on the local nets'."""
    import torch

    from ddcnn.report.results import image_pairs

    results = _results({"cnn_dnn_probs": ("coarse", 0.9), "global": ("global", 0.8)})
    results["accuracy"] = {"cnn_dnn": 0.9, "global_ensemble": 0.8, "global_wide": 0.8, "mean_prob": 0.8}
    correct = {key: torch.arange(200) % (10 if key == "cnn_dnn" else 5) != 0 for key in results["accuracy"]}
    results["convergence"] = {
        "local": [{"converged": True}],
        "global_ensemble": {"converged": False},
        "global_wide": {"converged": True},
    }
    pairs = {p["baseline"]: p for p in image_pairs(results, correct)}
    assert pairs["global_ensemble"]["verdict"] == "baseline not converged"
    assert pairs["global_ensemble"]["baseline_converged"] is False
    assert pairs["global_wide"]["verdict"] == "better" and pairs["mean_prob"]["verdict"] == "better"
    # and the other way round: unconverged local nets leave the wide CNN's verdict alone
    results["convergence"] |= {"local": [{"converged": False}], "global_ensemble": {"converged": True}}
    pairs = {p["baseline"]: p for p in image_pairs(results, correct)}
    assert pairs["global_wide"]["verdict"] == "better" and pairs["global_ensemble"]["verdict"] == "better"
    assert pairs["mean_prob"]["verdict"] == "baseline not converged"


def test_results_md_explains_a_flag_once_and_gives_each_row_its_reason():
    """Issue #45 item 7: one long paragraph repeated for each of 7 rows (about 9 KB for a demo). Every fact stays:
    which nets, which cause, which fix, which rows."""
    keys = ["mean_prob", "majority_vote", "cnn_dnn_probs", "cnn_dnn_logits", "cnn_dnn_val", "stacker"]
    stages = [None, None, "coarse", "coarse_alt", "coarse_val", "stacker"]
    results = _results(
        {key: (stage, 0.95) for key, stage in zip(keys, stages, strict=True)} | {"global": ("global", 0.96)}
    )
    overfit = "overfitting (validation loss rising while the training loss falls): engine.patience=3"
    capped = "still improving at the cap: trainer.max_epochs=30"
    local = [
        {"converged": False, "reasons": ["validation loss rose (+22.1%)"], "advice": overfit},
        {"converged": False, "reasons": ["validation loss rose (+3.6%)"], "advice": overfit},
        {"converged": False, "reasons": ["training loss still fell (-7.2%)"], "advice": capped},
        {"converged": True, "reasons": []},
    ]
    results["convergence"] = {
        "local": local,
        "global": {"converged": False, "reasons": ["too short"], "advice": capped},
    }
    results["flags"] = flag_rows(results, rate=0.1, counts=[200] * 10)
    assert len(results["flags"]) == 7
    md = "\n".join(flag_lines(results))
    for text in (overfit, capped, "validation loss rose (+22.1%)", "validation loss rose (+3.6%)", "too short"):
        assert md.count(text) == 1, text
    assert md.count("no verdict against it holds") == 1
    assert "- Try: local nets 0, 1: " + overfit in md and f"; local net 2 and global CNN: {capped}." in md
    assert "- **global**: its own training." in md  # (rows named by their key here)
    rows = "**mean_prob**, **majority_vote**, **cnn_dnn_probs**, **cnn_dnn_logits**, **cnn_dnn_val**, **stacker**"
    assert f"- {rows}: built on local nets 0, 1, 2." in md
    assert "local net 3" not in md  # it converged
    assert len(md) < 1500


def test_the_time_to_target_line_says_why_a_target_was_not_reached():
    ttt = {
        "target": {
            "value": 0.95,
            "source": "global CNN (converged): ...",
            "tolerance": 0.01,
            "baseline_converged": True,
        },
        "global": {"time_s": 20.0, "reached": True, "why_not": None, "epoch": 4, "devices": 1},
        "cnn_dnn": {"time_s": None, "reached": False, "why_not": "stopped", "epoch": None, "devices": 4},
        "mean_prob": {"time_s": None, "reached": False, "why_not": "budget", "epoch": None, "devices": 4},
        "comparable": True,
    }
    line = _time_to_target_line({"time_to_target": ttt})
    assert "fixed target 0.9500" in line and "global CNN 20.0 s on 1 device (epoch 4)" in line
    assert "CNN-DNN: not reached (early stopping ended it)" in line
    assert "mean probability: not reached (its epochs ran out)" in line
    ttt["target"]["baseline_converged"] = False
    assert "baseline not converged" in _time_to_target_line({"time_to_target": ttt})


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
    # The load of a shared test machine is outside this test's control: any other difference is a failure.
    assert set(results["timing"]["differences"]) <= {"load"}, results["timing"]["differences"]
    if "load" not in results["timing"]["differences"]:
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


def test_times_under_another_load_of_another_code_or_reused_from_another_run_are_not_comparable():
    base = {"device": "cpu", "torch_threads": 2, "concurrent_trainings": 1, "host": "h", "cpu_count": 4, "code": "a"}
    quiet = {**base, "load_avg": [2.1, 2.0, 1.5]}  # its own 2 threads: nothing else ran
    assert timing_contexts({"local 0": quiet, "global": {**quiet, "load_avg": [2.9, 2.5, 2.0]}})["comparable"]
    # The global CNN timed beside another job of 2 threads (load 4.1 for its own 2): not comparable, and it says so.
    busy = {**quiet, "load_avg": [4.1, 3.0, 2.0]}
    timing = timing_contexts({"local 0": quiet, "local 1": quiet, "global": busy})
    assert not timing["comparable"] and set(timing["differences"]) == {"load"}
    assert timing["differences"]["load"] == {
        "0.1 besides its own": ["local 0", "local 1"],
        "2.1 besides its own": ["global"],
    }
    # Two local nets of a run with 2 workers of 1 thread each: the load of 2 is their own.
    workers = {**base, "torch_threads": 1, "concurrent_trainings": 2, "load_avg": [2.0, 2.0, 2.0]}
    assert timing_contexts({"local 0": workers, "local 1": workers})["excess_load"] == {"local 0": 0.0, "local 1": 0.0}
    # Other code (a stage resumed after the package changed), another host: not comparable.
    assert set(timing_contexts({"local 0": quiet, "global": {**quiet, "code": "b"}})["differences"]) == {"code"}
    # A stage resumed on another machine of the same name whose CPU kernels use other instructions (AVX-512 and an
    # AVX2-only EPYC: both "AMD EPYC", "vm"); records from before the field have it on no stage and stay comparable.
    isa = {**quiet, "cpu_capability": "AVX512"}
    other = timing_contexts({"local 0": isa, "global": {**isa, "cpu_capability": "AVX2"}})
    assert set(other["differences"]) == {"cpu_capability"} and not other["comparable"]
    assert timing_contexts({"local 0": isa, "global": isa})["comparable"]
    # A stage timed in a process whose allocator returned freed memory to the OS (up to 2x the time on the CPU).
    kept = {**quiet, "host_allocator": "glibc, freed memory kept"}
    mixed = timing_contexts({"local 0": kept, "global": {**kept, "host_allocator": "glibc"}})
    assert set(mixed["differences"]) == {"host_allocator"} and not mixed["comparable"]
    # A stage copied from another run's training carries that run's clock.
    reused = timing_contexts({"local 0": quiet, "global": quiet}, {"global": {"run_dir": "/runs/earlier"}})
    assert not reused["comparable"]
    assert reused["differences"]["reused"] == {
        "trained by /runs/earlier": ["global"],
        "trained in this run": ["local 0"],
    }
    # DDP on 2 devices: its device count is the method's; each rank is compared with the global CNN's one device.
    ddp = {**quiet, "num_devices": 2, "load_avg": [4.1, 4.0, 4.0]}  # 2 ranks of 2 threads: a load of 4 is its own
    assert timing_contexts({"global": quiet, "global_ddp": ddp})["comparable"]
    assert set(
        timing_contexts({"global": quiet, "global_ddp": {**ddp, "torch_threads": 1, "load_avg": [2.1, 2.0, 2.0]}})[
            "differences"
        ]
    ) == {"torch_threads"}


def _set_convergence(meta_path: Path, converged: bool, reasons: list[str]) -> None:
    """Write proto-engine's convergence record into a finished stage's meta.json (what the engine records)."""
    meta = json.loads(meta_path.read_text())
    meta["converged"] = converged
    meta["convergence"] = {"converged": converged, "reasons": reasons, "stopped_by": "early_stopping"}
    meta_path.write_text(json.dumps(meta))


def test_an_unconverged_global_cnn_is_flagged_and_no_lead_over_it_is_printed(make_cfg, caplog):
    """A tiny real run whose global CNN's meta.json says ``converged: false`` (written here into the run's record, as
    the engine writes it), evaluated again: its row is flagged, the differences and speedups against it say "baseline
    not converged", the fixed target says so, and the log carries the flag."""
    cfg = make_cfg("decomposition.grid=[1,2]", "report.curves.enabled=true")
    first = train(cfg)
    # End to end: one epoch is too short to judge; the engine records it and the report flags it.
    flagged = {f["method"]: f["message"] for f in first["flags"] if f["kind"] == "unconverged"}
    assert "global" in flagged and "too short to judge" in flagged["global"]
    root = Path(cfg.paths.run_dir)
    mark_converged(root)
    _set_convergence(root / "global" / "meta.json", False, ["stopped at epoch 1 of 4 (before the minimum 2)"])
    with caplog.at_level(logging.WARNING, logger="ddcnn.report.results"):
        results = train(make_cfg("decomposition.grid=[1,2]", "report.curves.enabled=true", "stage=evaluate"))
    flags = [f for f in results["flags"] if f["kind"] == "unconverged"]
    assert [f["method"] for f in flags] == ["global"]
    assert "stopped at epoch 1 of 4" in flags[0]["message"] and "trainer.max_epochs" in flags[0]["try"]
    assert any("trained without converging" in r.getMessage() for r in caplog.records)
    md = (root / "results.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| global CNN |"))
    assert row.endswith("| **no** |")  # the converged column
    assert "**Trained without converging**" in md and "- global CNN did not converge: stopped at epoch 1 of 4" in md
    assert "- **global CNN**: its own training." in md
    assert "CNN-DNN − global CNN: baseline not converged" in md  # no difference printed, even on one seed
    assert "global DDP − global CNN" not in md  # (no DDP in this run)
    assert "CNN-DNN − mean probability: " in md and "points" in md  # the local nets did converge: its figure stays
    assert "baseline not converged (no speedup against it is given)" in md  # the equal-device speedup against it
    # no verdict against the unconverged baseline: "better" only where a pair's baseline converged (the local nets)
    against_global = [e for e in results["paired_test"] if e["baseline"] == "global"]
    assert against_global and all(e["verdict"] == "baseline not converged" for e in against_global)
    assert all(
        "better" not in line.lower() for line in md.splitlines() if not line.startswith("- Test-accuracy differences")
    )
    assert results["time_to_target"]["target"]["baseline_converged"] is False
    assert "NOT converged" in results["time_to_target"]["target"]["source"]


def test_an_unconverged_local_net_flags_every_row_built_on_it(make_cfg):
    """A tiny real run whose local net 1 says ``converged: false`` (written into its meta.json, as the engine
    records it): the CNN-DNN rows and the combiners are flagged, the global CNN is not."""
    cfg = make_cfg("decomposition.grid=[1,2]")
    train(cfg)
    mark_converged(Path(cfg.paths.run_dir))
    _set_convergence(Path(cfg.paths.run_dir) / "local" / "01" / "meta.json", False, ["training loss still falling"])
    results = train(make_cfg("decomposition.grid=[1,2]", "stage=evaluate"))
    flagged = {f["method"] for f in results["flags"] if f["kind"] == "unconverged"}
    assert {"cnn_dnn_probs", "mean_prob", "majority_vote"} <= flagged and "global" not in flagged
    assert "local net 1 (training loss still falling)" in next(
        f["message"] for f in results["flags"] if f["method"] == "cnn_dnn_probs"
    )
    assert results["convergence"]["local"][1]["converged"] is False
    assert results["convergence"]["global"]["converged"] is True


def test_one_runs_results_give_equal_device_figures_and_no_verdict(make_cfg):
    cfg = make_cfg("decomposition.grid=[2,2]")
    results = train(cfg)
    t = results["time_s"]
    by_devices = results["projected_time_s_by_devices"]
    assert set(by_devices) == {"1", "2", "4"}
    assert by_devices["1"] == pytest.approx(t["local_total"] + t["coarse"])  # every local net one after another
    assert by_devices["4"] == pytest.approx(t["local_max"] + t["coarse"])  # one device per local net
    assert by_devices["4"] <= by_devices["2"] <= by_devices["1"]
    # Only P = 1 has a baseline on as many devices (no DDP ran): no speedup of 4 devices against 1.
    assert set(results["speedup_equal_devices"]) == {"1"}
    assert results["speedup_equal_devices"]["1"]["speedup"] == pytest.approx(t["global"] / by_devices["1"])
    rows = {r["key"]: r for r in results["methods"]}
    assert rows["cnn_dnn_probs"]["speedup_1_device"] == pytest.approx(t["global"] / (t["local_total"] + t["coarse"]))
    md = results_markdown(results)
    assert "4 devices: no baseline ran on 4 devices" in md and "One seed gives no interval over seeds" in md


def test_one_runs_paired_rows_get_mcnemar_and_a_bootstrap_interval_over_its_test_images(make_cfg):
    """Every paired difference of a run is recomputed from the saved per-image test predictions: the difference
    equals the accuracies', the discordant counts McNemar's test reads match the saved predictions, and results.md
    prints the p-value and the interval."""
    import torch

    from ddcnn.io import load_run_file
    from ddcnn.report.stats import mcnemar_exact

    cfg = make_cfg("decomposition.grid=[1,2]")
    results = train(cfg)
    run_dir = Path(cfg.paths.run_dir)
    entries = {e["comparison"]: e for e in results["paired_test"]}
    assert {"CNN-DNN − global CNN", "CNN-DNN − mean probability"} <= set(entries)
    acc = results["accuracy"]
    entry = entries["CNN-DNN − global CNN"]
    assert entry["difference"] == pytest.approx(100 * (acc["cnn_dnn"] - acc["global"]), abs=1e-4)
    coarse, glob = (load_run_file(run_dir / stage / "probs_test.pt") for stage in ("coarse", "global"))
    right = [saved["probs"].argmax(-1) == saved["labels"] for saved in (coarse, glob)]
    by_hand = mcnemar_exact(right[0].numpy(), right[1].numpy())
    assert (entry["b"], entry["c"], entry["p_mcnemar"]) == (by_hand["b"], by_hand["c"], by_hand["p"])
    assert entry["n"] == len(coarse["labels"]) and entry["low"] <= entry["difference"] <= entry["high"]
    assert entry["verdict"] in ("better", "worse", "equivalent", "not distinguishable", "baseline not converged")
    md = (run_dir / "results.md").read_text()
    if entry["verdict"] != "baseline not converged":
        assert f"McNemar p = {entry['p_mcnemar']:.3g}" in md and "95% bootstrap interval over the" in md
    assert torch.equal(coarse["labels"], glob["labels"])


def test_a_global_cnn_copied_from_another_run_keeps_its_clock_and_marks_the_timing(make_cfg):
    """A tiny real run whose global CNN's meta.json says it was copied from another run's training (``reused_from``,
    as ddcnn/stages/reuse.py writes it), evaluated again: its time to the target names the run whose clock it carries,
    and the run's timing is not comparable."""
    cfg = make_cfg("decomposition.grid=[1,2]", "report.curves.enabled=true")
    train(cfg)
    path = Path(cfg.paths.run_dir) / "global" / "meta.json"
    meta = json.loads(path.read_text())
    meta["reused_from"] = {"key": "k", "entry": "/store/global/k", "run_dir": "/runs/earlier", "host": "h"}
    path.write_text(json.dumps(meta))
    results = train(make_cfg("decomposition.grid=[1,2]", "report.curves.enabled=true", "stage=evaluate"))
    assert not results["timing"]["comparable"]
    assert results["timing"]["differences"]["reused"]["trained by /runs/earlier"] == ["global"]
    assert results["time_to_target"]["global"]["reused_from"] == "/runs/earlier"
    assert results["time_to_target"]["comparable"] is False
    assert "reused from the store" in results["time_to_target"]["target"]["source"]
    md = (Path(cfg.paths.run_dir) / "results.md").read_text()
    assert "different execution contexts" in md and "reused: the clock of /runs/earlier" in md
