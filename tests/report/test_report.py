"""``ddcnn-report`` on a tiny sweep: every row and column, mean ± std over seeds, CSV, plots, baseline rows."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
from omegaconf import OmegaConf

from ddcnn.pipeline import train
from ddcnn.report.cli import report_main
from ddcnn.report.compare import (
    CSV_COLUMNS,
    PAIRED_COLUMNS,
    comparison_rows,
    find_runs,
    load_baseline_rows,
    load_run,
    paired_markdown,
    paired_rows,
    table_markdown,
    write_report,
)
from ddcnn.report.results import METHODS
from ddcnn.report.stats import t_quantile_975
from ddcnn.rundir import RunDir
from ddcnn.settings import RunSettings
from tests.conftest import compose_config, mark_converged

DEFAULT_METHODS = ("global", "mean_prob", "majority_vote", "cnn_dnn_probs", "cnn_dnn_logits", "cnn_dnn_val", "stacker")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A sweep folder as ``ddcnn-train -m`` leaves it: a 1x2 grid with two seeds (one with every method), 2x2 with
    one (small grids keep the test fast; the report does not care about the size)."""
    root = tmp_path_factory.mktemp("multirun")
    jobs = {
        "0_1x2_s0": ["seed=0", "methods=all", "decomposition.grid=[1,2]"],
        "1_1x2_s1": ["seed=1", "decomposition.grid=[1,2]"],
        "2_2x2_s0": ["seed=0"],
    }
    for name, overrides in jobs.items():
        # The per-run figures and the export are another stage's business; the report needs results.json only.
        # The ensemble (of methods=all) at 2 global CNNs, set in every run so that no setting splits the seeds' groups.
        settings = [*overrides, "++report.plots=false", "++report.export=false", "methods.global_ensemble.k=2"]
        train(compose_config(settings, root / name))
        # Its 1-epoch trainings are too short to judge (unconverged, test_results.py checks that end to end); the
        # verdicts need converged baselines, so they are recorded as converged and the run evaluated again.
        mark_converged(root / name)
        train(compose_config([*settings, "stage=evaluate"], root / name))
    # A job that started (config.yaml and fingerprint.json written) but never got to evaluate.
    RunDir(root / "3_1x2_s2").claim(RunSettings.from_config(compose_config(["seed=2"], root / "3_1x2_s2")).identity())
    return root


@pytest.fixture(scope="module")
def report(sweep, tmp_path_factory):
    baselines = tmp_path_factory.mktemp("baselines")
    (baselines / "simple.json").write_text(json.dumps([{"name": "BPT-CNN (async)", "accuracy": 0.5, "time_s": 3.0}]))
    (baselines / "bench.json").write_text(
        json.dumps({"rows": [{"method": "filter-parallel", "accuracy": 0.4, "wall_time_s": 2.0, "processes": 2}]})
    )
    out = sweep / "report"
    files = [arg for name in ("simple.json", "bench.json") for arg in ("--baselines", str(baselines / name))]
    report_main(["--sweep", str(sweep), *files])
    return out


def test_sweep_finds_finished_runs_and_names_unfinished_ones(sweep):
    finished, unfinished = find_runs(sweep)
    assert [p.name for p in finished] == ["0_1x2_s0", "1_1x2_s1", "2_2x2_s0"]
    assert [p.name for p in unfinished] == ["3_1x2_s2"]


def test_table_has_every_row_and_column(report):
    with open(report / "digits.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames) == CSV_COLUMNS
        rows = list(reader)
    by_grid = {g: [r["method_key"] for r in rows if r["grid"] == g] for g in ("1x2", "2x2")}
    assert by_grid["1x2"] == list(METHODS)  # every method, in table order
    assert by_grid["2x2"] == list(DEFAULT_METHODS)
    for r in rows:
        assert r["backbone"] == "vgg_tiny" and r["overlap"] == "2" and r["dataset"] == "digits"
        for column in ("accuracy_mean", "sequential_time_s", "projected_time_s", "speedup", "params"):
            if column == "sequential_time_s" and r["method_key"] == "global_ddp":
                assert r[column] == ""  # trained on 2 devices at once: there is no one-device time
                continue
            assert float(r[column]) >= 0, (r["method_key"], column)
    md = (report / "digits.md").read_text()
    header = md.splitlines()[2]
    for column in ("method", "seeds", "test accuracy (%)", "sequential time (s)", "projected time (s)"):
        assert f"| {column} |" in header
    assert "| speedup vs global, 1 device | speedup vs DDP, P devices | speedup to target, 1 device |" in header
    # The methods=all run trained DDP on 2 devices: its CNN-DNN is compared with it on 2 devices.
    run = load_run(report.parent / "0_1x2_s0")
    t, by_devices = run.results["time_s"], run.results["projected_time_s_by_devices"]
    cnn_dnn = next(r for r in rows if r["grid"] == "1x2" and r["method_key"] == "cnn_dnn_probs")
    assert cnn_dnn["ddp_devices"] == "2"
    assert float(cnn_dnn["speedup_vs_ddp"]) == pytest.approx(t["global_ddp"] / by_devices["2"], rel=1e-6)
    for name in METHODS.values():
        assert f"| {name} |" in md
    report_md = (report / "report.md").read_text()
    assert "## digits" in report_md and "## External baselines" in report_md


def test_two_seeds_are_averaged_with_their_standard_deviation(sweep, report):
    runs = [load_run(sweep / name) for name in ("0_1x2_s0", "1_1x2_s1")]
    row = next(r for r in comparison_rows(runs)["digits"] if r["method_key"] == "cnn_dnn_probs")
    acc = [r.results["accuracy"]["cnn_dnn"] for r in runs]
    assert row["seeds"] == 2
    assert row["accuracy_mean"] == pytest.approx(np.mean(acc))
    assert row["accuracy_std"] == pytest.approx(np.std(acc, ddof=1))
    # The imbalanced-data metrics are averaged the same way (3D experiments are judged on AUC).
    auc = [r.results["metrics"]["cnn_dnn"]["auc"] for r in runs]
    bal = [r.results["metrics"]["cnn_dnn"]["balanced_accuracy"] for r in runs]
    assert row["auc_mean"] == pytest.approx(np.mean(auc)) and row["auc_std"] == pytest.approx(np.std(auc, ddof=1))
    assert row["balanced_accuracy_mean"] == pytest.approx(np.mean(bal))
    header = (report / "digits.md").read_text().splitlines()[2]
    assert "| test accuracy (%) | balanced acc. (%) | AUC (%) |" in header
    assert "±" in next(line for line in (report / "digits.md").read_text().splitlines() if "| majority vote |" in line)
    e2e = next(r for r in comparison_rows(runs)["digits"] if r["method_key"] == "e2e")
    assert e2e["seeds"] == 1 and e2e["accuracy_std"] is None


def test_plots_exist_and_are_not_empty(report):
    names = [
        "digits_accuracy_vs_grid.png",
        "digits_time_vs_grid.png",
        "digits_vgg_tiny_1x2_o2_subdomains.png",
        "digits_vgg_tiny_2x2_o2_subdomains.png",
    ]
    for name in names:
        data = (report / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_baseline_rows_from_either_format(report):
    with open(report / "baselines.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["name"], float(r["accuracy"]), float(r["time_s"])) for r in rows] == [
        ("BPT-CNN (async)", 0.5, 3.0),
        ("filter-parallel", 0.4, 2.0),
    ]
    assert rows[1]["processes"] == "2"


def test_bad_baseline_rows_are_named(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"name": "x", "accuracy": 0.1}]))
    with pytest.raises(ValueError, match="row 0 needs name, accuracy and time_s"):
        load_baseline_rows(path)


def test_three_dimensional_grid_gets_one_panel_per_layer(sweep, tmp_path):
    """A 2x2x2 run's local accuracies are drawn as two 2x2 layers (results.json edited to a 3D grid)."""
    run_dir = tmp_path / "run3d"
    shutil.copytree(sweep / "1_1x2_s1", run_dir, ignore=shutil.ignore_patterns("local", "coarse*", "global"))
    results = json.loads((run_dir / "results.json").read_text())
    results["decomposition"]["grid"] = [2, 2, 2]
    results["accuracy"]["local"] = [0.1 * i for i in range(8)]
    (run_dir / "results.json").write_text(json.dumps(results))
    written = write_report([load_run(run_dir)], tmp_path / "out")
    maps = [p for p in written["plots"] if p.name.endswith("_subdomains.png")]
    assert [p.name for p in maps] == ["digits_vgg_tiny_2x2x2_o2_subdomains.png"]
    assert maps[0].stat().st_size > 5000


def test_runs_without_results_are_refused_by_name(sweep, capsys):
    with pytest.raises(SystemExit) as exit_info:
        report_main([str(sweep / "3_1x2_s2"), "--out", str(sweep / "bad")])
    assert exit_info.value.code == 2
    assert "['results.json'] missing" in capsys.readouterr().err


def test_runs_with_other_settings_are_not_averaged_together(sweep, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(sweep / "1_1x2_s1", other, ignore=shutil.ignore_patterns("local", "coarse*", "global", "plots"))
    cfg = OmegaConf.load(other / "config.yaml")
    cfg.trainer.max_epochs = 5
    OmegaConf.save(cfg, other / "config.yaml")
    runs = [load_run(sweep / "0_1x2_s0"), load_run(other)]
    split = [r for r in comparison_rows(runs)["digits"] if r["method_key"] == "cnn_dnn_probs"]
    assert sorted(r["settings"] for r in split) == ["trainer.max_epochs=1", "trainer.max_epochs=5"]
    assert "| settings |" in table_markdown(split)
    merged = comparison_rows(runs, ignore=["trainer.max_epochs"])["digits"]
    merged = [r for r in merged if r["method_key"] == "cnn_dnn_probs"]
    assert len(merged) == 1 and merged[0]["seeds"] == 2 and merged[0]["settings"] == ""


def _as_data(sweep, tmp_path, name: str, data: dict) -> object:
    """A copy of a finished run whose config.yaml says it read other data (``data``: keys of its data node)."""
    folder = tmp_path / name
    shutil.copytree(sweep / "1_1x2_s1", folder, ignore=shutil.ignore_patterns("local", "coarse*", "global", "plots"))
    cfg = OmegaConf.load(folder / "config.yaml")
    for key, value in data.items():
        OmegaConf.update(cfg, f"data.{key}", value, force_add=True)
    OmegaConf.save(cfg, folder / "config.yaml")
    return load_run(folder)


def test_two_image_folders_of_the_same_settings_are_two_datasets_named_by_their_folder(sweep, tmp_path):
    """Issue #45: two different image folders sharing every setting were pooled into one row ("seeds 1",
    45.43 ± 17.11) under the name "image_folder"."""
    runs = [
        _as_data(
            sweep,
            tmp_path,
            f"run_{folder}",
            {"name": "image_folder", "root": f"/data/{folder}", "source.root": f"/data/{folder}"},
        )  # fmt: skip
        for folder in ("faces", "flowers")
    ]
    tables = comparison_rows(runs)
    assert sorted(tables) == ["image_folder (faces)", "image_folder (flowers)"]
    for rows in tables.values():
        assert all(r["runs"] == 1 and r["accuracy_std"] is None for r in rows)
    assert sorted(paired_rows(runs)) == sorted(tables)
    written = write_report(runs, tmp_path / "out", plots=False)
    report_md = (tmp_path / "out" / "report.md").read_text()
    assert "## image_folder (faces)" in report_md and "## image_folder (flowers)" in report_md
    assert {p.name for p in written["csv"]} >= {"image_folder_faces.csv", "image_folder_flowers.csv"}
    # two folders of one name elsewhere: the path tells them apart
    other = _as_data(sweep, tmp_path, "run_other", {"name": "image_folder", "source.root": "/elsewhere/faces"})
    assert sorted(comparison_rows([runs[0], other])) == [
        "image_folder (/data/faces)",
        "image_folder (/elsewhere/faces)",
    ]
    # one archive copied to two places is one dataset, and an archive keeps its name alone
    copies = [
        _as_data(sweep, tmp_path, f"copy_{i}", {"name": "mnist", "path": f"/{where}/mnist.npz"})
        for i, where in enumerate(("a", "b"))
    ]
    assert list(comparison_rows(copies)) == ["mnist"]
    # a torchvision dataset's root is where a machine stores it ($DDCNN_DATA), not what the data are
    stored = [
        _as_data(
            sweep,
            tmp_path,
            f"cifar_{where}",
            {"name": "cifar10", "root": f"/{where}/data", "source._target_": "ddcnn.data.sources.torchvision_dataset"},
        )
        for where in ("a", "b")
    ]
    assert list(comparison_rows(stored)) == ["cifar10"]


def test_differences_are_paired_by_seed_with_their_interval_and_verdict(sweep, report):
    runs = {name: load_run(sweep / name) for name in ("0_1x2_s0", "1_1x2_s1")}
    d = [100 * (r.results["accuracy"]["cnn_dnn"] - r.results["accuracy"]["global"]) for r in runs.values()]
    with open(report / "digits_paired.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames) == PAIRED_COLUMNS
        rows = list(reader)
    row = next(r for r in rows if r["grid"] == "1x2" and r["comparison"] == "CNN-DNN − global CNN")
    assert row["n"] == "2" and row["seeds"] == "0 1"
    half = t_quantile_975(1) * np.std(d, ddof=1) / np.sqrt(2)
    assert float(row["mean_points"]) == pytest.approx(np.mean(d))
    assert float(row["ci_low_points"]) == pytest.approx(np.mean(d) - half)
    assert float(row["ci_high_points"]) == pytest.approx(np.mean(d) + half)
    expected = "better" if np.mean(d) - half > 0 else "worse" if np.mean(d) + half < 0 else "within noise"
    # the fixture's global CNNs (a few steps) may be at chance: no lead against those seeds, the figures stay
    at_chance = [r.seed for r in runs.values() if any(f["method"] == "global" for f in r.results["flags"])]
    if at_chance:
        expected = f"baseline at chance (seed{'s' if len(at_chance) > 1 else ''} {', '.join(map(str, at_chance))})"
    assert row["verdict"] == expected and row["baseline_converged"] == "yes"
    # One seed (the 2x2 grid): a difference, no interval, no verdict.
    single = next(r for r in rows if r["grid"] == "2x2" and r["comparison"] == "CNN-DNN − mean probability")
    assert single["n"] == "1" and single["ci_low_points"] == ""
    assert single["verdict"] in ("n<2: no interval", "baseline at chance (seed 0)")  # (the fixture's few steps)
    md = (report / "digits.md").read_text()
    assert "Paired differences (test accuracy, points):" in md and "| CNN-DNN − global CNN | 2 |" in md


def _edited(sweep, tmp_path, name, edit):
    """A copy of sweep run ``name`` (results.json and config.yaml only) with its results.json edited by ``edit``."""
    copy = tmp_path / name
    shutil.copytree(sweep / name, copy, ignore=shutil.ignore_patterns("local", "coarse*", "global*", "plots", "e2e"))
    results = json.loads((copy / "results.json").read_text())
    edit(results)
    (copy / "results.json").write_text(json.dumps(results))
    return load_run(copy)


def test_an_unconverged_baseline_gets_no_verdict_and_other_timing_is_marked(sweep, tmp_path):
    """Two seeds whose results.json say the global CNN did not converge in one of them (as the evaluate stage writes
    it from the stage's meta.json, with its flag), and whose timing was taken under another load in one."""

    def unconverged(results):
        results["convergence"]["global"] = {"converged": False, "reasons": ["stopped early"], "stopped_by": "budget"}
        results["flags"] = [{"method": "global", "kind": "unconverged", "message": "m", "try": "t"}]
        results["timing"]["comparable"], results["timing"]["differences"] = True, {}  # whatever this machine's load

    def loaded(results):
        results["timing"]["comparable"] = False
        results["timing"]["differences"] = {"load": {"3.0 besides its own": ["global"], "0.0 besides its own": []}}

    runs = [_edited(sweep, tmp_path, "0_1x2_s0", unconverged), _edited(sweep, tmp_path, "1_1x2_s1", loaded)]
    pairs = paired_rows(runs)["digits"]
    versus_global = [r for r in pairs if r["baseline_key"] == "global"]
    assert versus_global and all(r["verdict"] == "baseline not converged" for r in versus_global)
    assert all(r["baseline_converged"] == "no" for r in versus_global)
    assert "better" not in paired_markdown(versus_global)
    rows = {r["method_key"]: r for r in comparison_rows(runs)["digits"]}
    assert rows["global"]["unconverged_runs"] == "1/2" and rows["cnn_dnn_probs"]["unconverged_runs"] is None
    # The load differed in one run: the rows stay one group (the seeds still pair) but are marked.
    cnn_dnn = rows["cnn_dnn_probs"]
    assert cnn_dnn["seeds"] == 2 and cnn_dnn["timing_comparable"] == "no in 1/2 runs (load)"
    table = table_markdown(list(rows.values()))
    line = next(line for line in table.splitlines() if "| global CNN |" in line)
    assert line.endswith("| **1/2** |") and "no in 1/2 runs (load)" in table  # the unconverged-runs column


def test_the_speedup_to_the_fixed_target_compares_one_device_with_one_device(sweep, tmp_path):
    """results.json of two seeds edited to hold a time to the fixed target (runs with report.curves on write it): the
    global CNN's time over the CNN-DNN's with its local nets one after another, never its N-device time."""

    def reached(global_s, one_device_s, n_devices_s):
        def edit(results):
            results["time_to_target"] = {
                "target": {"value": 0.9, "source": "s", "tolerance": 0.01, "baseline_converged": True},
                "global": {"time_s": global_s, "reached": True, "why_not": None, "epoch": 3, "devices": 1},
                "cnn_dnn": {
                    "time_s": n_devices_s,
                    "reached": one_device_s is not None,
                    "why_not": None if one_device_s is not None else "budget",
                    "epoch": 2,
                    "devices": 2,
                    "time_s_by_devices": {"1": one_device_s, "2": n_devices_s} if one_device_s is not None else None,
                },
            }

        return edit

    def comparable(edit):  # whatever the load of the machine that trained the sweep
        def both(results):
            edit(results)
            results["timing"]["comparable"], results["timing"]["differences"] = True, {}

        return both

    runs = [
        _edited(sweep, tmp_path, "0_1x2_s0", comparable(reached(30.0, 15.0, 8.0))),
        _edited(sweep, tmp_path, "1_1x2_s1", comparable(reached(30.0, None, None))),
    ]
    row = next(r for r in comparison_rows(runs)["digits"] if r["method_key"] == "cnn_dnn_probs")
    assert row["speedup_to_target_mean"] == pytest.approx(2.0) and row["target_reached"] == "1/2"
    assert "| 2.00x (1/2) |" in table_markdown([row])

    # Issue #44 item 5: speedups are summarised by their geometric mean with a t-interval on the log scale (2x and
    # 0.5x average to 1x, not 1.25x), over the runs whose timing is comparable only.
    runs = [
        _edited(sweep, tmp_path / "geometric", "0_1x2_s0", comparable(reached(30.0, 15.0, 8.0))),
        _edited(sweep, tmp_path / "geometric", "1_1x2_s1", comparable(reached(30.0, 60.0, 30.0))),
    ]
    row = next(r for r in comparison_rows(runs)["digits"] if r["method_key"] == "cnn_dnn_probs")
    half = 12.7062047 * np.std([np.log(2), np.log(0.5)], ddof=1) / np.sqrt(2)  # t(0.975, 1)
    assert row["speedup_to_target_mean"] == pytest.approx(1.0) and row["target_reached"] == "2/2"
    assert (row["speedup_to_target_low"], row["speedup_to_target_high"]) == pytest.approx((np.exp(-half), np.exp(half)))

    def loaded(edit):
        def both(results):
            edit(results)
            results["timing"]["comparable"] = False
            results["timing"]["differences"] = {"reused": ["global"]}

        return both

    runs[1] = _edited(sweep, tmp_path / "reused", "1_1x2_s1", loaded(reached(30.0, 60.0, 30.0)))
    row = next(r for r in comparison_rows(runs)["digits"] if r["method_key"] == "cnn_dnn_probs")
    assert row["speedup_to_target_mean"] == pytest.approx(2.0) and row["target_not_comparable"] == 1
    assert "| 2.00x (2/2; 1 not comparable, left out) |" in table_markdown([row])


def test_a_split_seed_that_follows_the_seed_keeps_the_seeds_in_one_group():
    """``data.split_seed: null`` records each run's own seed: one setting, not a difference between the seeds of a
    configuration; runs of one fixed draw (the old default 0) are one group too, and a mix of the two is not."""
    from pathlib import Path

    from ddcnn.report.compare import Run, _varying_settings

    def run(seed: int, split_seed: int) -> Run:
        config = {"seed": seed, "data": {"split_seed": split_seed}}
        return Run(Path(f"run{seed}"), {}, config, "digits", "vgg_tiny", (2, 2), (0, 0), seed)

    assert _varying_settings([run(0, 0), run(1, 1), run(2, 2)]) == []
    assert _varying_settings([run(0, 0), run(1, 0), run(2, 0)]) == []
    assert _varying_settings([run(0, 0), run(1, 1), run(2, 0)]) == ["data.split_seed"]


def test_seeds_trained_by_two_versions_of_ddcnn_with_the_same_settings_are_one_configuration():
    """A run recorded before a setting existed trained with what its absence meant (``engine.precise_bn`` 0,
    ``engine.min_steps`` 0, ``global_lr_scale`` 1, an added default such as ``coarse.linear.enabled``, a key under
    its old name): it is the same configuration as a later seed that records those values, so a page whose seeds
    straddle a release pairs them in one row; a seed that trained otherwise still splits, labelled with the value
    each run trained with."""
    from pathlib import Path

    from ddcnn.report.compare import Run, _settings_label, _varying_settings

    def run(seed: int, **recorded) -> Run:
        config = {"seed": seed, "data": {"split_seed": seed}, "trainer": {}, "engine": {}, "coarse": {"linear": {}}}
        for dotted, value in recorded.items():
            section, key = dotted.split("__")
            node = config[section] if section != "coarse_linear" else config["coarse"]["linear"]
            node[key] = value
        return Run(Path(f"run{seed}"), {}, config, "mnist", "vgg_small", (2, 2), (2, 2), seed)

    older = run(0, trainer__monitor="val_acc")
    newer = run(1, engine__monitor="val_acc", engine__precise_bn=0, engine__min_steps=0, coarse_linear__enabled=True)
    newer.config["global_lr_scale"] = 1.0
    assert _varying_settings([older, newer]) == []

    other = run(2, engine__monitor="val_acc", engine__precise_bn=10)
    assert _varying_settings([older, newer, other]) == ["engine.precise_bn"]
    assert [_settings_label(r, ["engine.precise_bn"]) for r in (older, newer, other)] == [
        "engine.precise_bn=0",
        "engine.precise_bn=0",
        "engine.precise_bn=10",
    ]
    # a key no record explains stays a difference, named as unset where a run lacks it
    assert _varying_settings([older, run(3, engine__monitor="val_acc", engine__ema=0.99)]) == ["engine.ema"]
    assert _settings_label(older, ["engine.ema"]) == "engine.ema=<unset>"
