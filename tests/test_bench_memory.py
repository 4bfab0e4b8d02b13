"""bench/size_cost.py and bench/memory_plan.py in their --quick modes (planned only, or small sizes)."""

from __future__ import annotations

import pytest

from tests.conftest import load_script


def test_size_cost_flop_ratios_are_the_issues(tmp_path) -> None:
    """#47's table, 3D vgg_small: 32³ at 2x2x2 is 8x the FLOPs of one local net without overlap, 4.6x with overlap 2
    (17³ sub-domains that pooling rounds up); the local net keeps 3.2-4.4 MiB for backward against 26 MiB."""
    bench = load_script("bench/size_cost.py", "size_cost")
    rows = {
        (r["spatial_dims"], r["size"], r["overlap"]): r
        for r in bench.main(["--quick", "--out", str(tmp_path / "s.json")])
    }
    assert rows[3, 32, 0]["flop_ratio"] == pytest.approx(8.0, rel=0.01)
    assert rows[3, 32, 2]["flop_ratio"] == pytest.approx(4.64, rel=0.01)
    assert rows[3, 32, 0]["saved_global_mib"] == pytest.approx(25.9, rel=0.02)
    assert rows[2, 64, 0]["flop_ratio"] == pytest.approx(4.0, rel=0.01)
    assert (tmp_path / "s.json").is_file()


def test_the_cost_table_in_docs_is_generated_from_the_committed_run() -> None:
    """docs/cost.md's table is what docs/cost.json (a run of bench/size_cost.py) gives, never typed by hand; that run
    timed its steps as training runs them (freed host memory kept) and names the second run it was compared with."""
    import json

    bench = load_script("bench/size_cost.py", "size_cost")
    assert bench.check_doc() == []
    record = json.loads(bench.RECORD.read_text())
    assert record["host_allocator"] == "glibc, freed memory kept" and record["clock"] == "process CPU time"
    timed = [r for r in record["rows"] if r["time_ratio"] is not None]
    assert len(timed) >= 16 and all(r["time_ratio"] > 1 for r in timed)
    assert record["agreement"]["max_differ"] is not None


def test_the_allocators_table_in_docs_is_generated_from_the_committed_run() -> None:
    """docs/cost.md's host-allocator table is what docs/host_memory.json (a run of bench/host_memory.py) gives; kept,
    the 3D global CNN's step costs less than as glibc comes, and so does its ratio to the local net."""
    import json

    bench = load_script("bench/host_memory.py", "host_memory")
    assert bench.check_doc() == []
    rows = {r["net"]: r for r in json.loads(bench.RECORD.read_text())}
    assert [r[0] for r in bench.ROWS] == list(rows)
    g, loc = rows[bench.ROWS[4][0]], rows[bench.ROWS[5][0]]
    assert g["ratio"] > 1 and g["glibc"]["cpu_s"] / loc["glibc"]["cpu_s"] > g["kept"]["cpu_s"] / loc["kept"]["cpu_s"]


def test_two_runs_of_the_cost_curve_are_compared_row_by_row() -> None:
    """--compare: per row timed in both runs, the larger step-time ratio over the smaller less one; the worst named."""
    bench = load_script("bench/size_cost.py", "size_cost")

    def r(size: int, ratio: float | None) -> dict:
        return {"spatial_dims": 2, "size": size, "grid": "2x2", "overlap": 0, "time_ratio": ratio}

    agreement = bench.compare([r(64, 5.0), r(128, 3.0), r(256, None)], {"rows": [r(64, 4.0), r(128, 3.3), r(256, 2)]})
    assert [round(d["differ"], 6) for d in agreement["rows"]] == [0.25, 0.1]
    assert agreement["max_differ"] == pytest.approx(0.25) and agreement["max_row"] == [2, 64, "2x2", 0]
    assert bench._side([16, 16, 32], 3) == "16²x32" and bench._side([33, 33], 2) == "33²"


@pytest.mark.slow
def test_memory_plan_bench_meets_its_targets_on_small_nets() -> None:
    result = load_script("bench/memory_plan.py", "memory_plan").main(["--quick", "--repeats", "1"])
    assert all(r["within_target"] for r in result["plan_vs_measured"])
    assert result["preflight"]["plan"]["global"]["method"] == "meta"
    (cut,) = result["checkpointing"]
    assert cut["planned_checkpointed_activation_bytes"] < cut["planned_activation_bytes"]


def test_coarse_cost_fits_the_coarse_dnn_as_its_stage_does_at_each_size(make_cfg, tmp_path) -> None:
    """bench/coarse_cost.py (#47 item 4): the coarse fit per training size of a finished run, its share of the slowest
    local net scaled to that size, and at the run's own size the fit the coarse stage kept."""
    import json

    from ddcnn.pipeline import train

    cfg = make_cfg("decomposition.grid=[1,2]", "report.curves.enabled=false")
    train(cfg)
    run_dir = tmp_path / "run"
    bench = load_script("bench/coarse_cost.py", "coarse_cost")
    result = bench.measure(run_dir, [100, 200], repeats=1)
    rows = result["rows"]
    assert [r["n_train"] for r in rows][:2] == [100, 200] and rows[-1]["n_train"] == result["n_train"]
    local = max(result["local_fit_s"])
    for r in rows:
        assert r["share"] == pytest.approx(r["fit_s"] / (local * r["n_train"] / result["n_train"]))
        assert r["plan"]["batch_size"] >= 32 and r["kept"] in ("trained", "linear", "averaging")
    stage = json.loads((run_dir / "coarse" / "meta.json").read_text())
    assert rows[-1]["kept"] == stage["fit"]["kept"]  # the whole split: the stage's own fit, same seed and settings
    assert result["exponent"] is not None and result["projected_60k"]["share"] > 0


def test_precise_bn_bench_times_both_trainings_side_by_side(capsys) -> None:
    bench = load_script("bench/precise_bn.py", "precise_bn")
    bench.main(["--rounds", "1", "--epochs", "1", "--train", "40", "--batches", "1"])
    out = capsys.readouterr().out
    assert "round 1: precise_bn=0:" in out and "round 1: precise_bn=1:" in out
    assert "ratio" in out and "(recomputed from 1 of 2 batches)" in out
