"""results.json / results.md: the execution context of every compared time, and the rule they are measured by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddcnn.pipeline import train
from ddcnn.report.results import TIMING_RULE, timing_contexts


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
