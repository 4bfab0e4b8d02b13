"""experiments/user_data.py: the default recipe's check on datasets of other shapes (issue #45) and its page."""

from __future__ import annotations

import json

from tests.conftest import load_script

user_data = load_script("experiments/user_data.py", "user_data")


def test_the_page_table_is_what_the_recorded_runs_give():
    """docs/user_data.md's table is generated from docs/user_data.json (the runs' summaries), never typed by hand."""
    assert user_data.check_doc() == []
    rows = json.loads(user_data.RECORD.read_text())
    assert {r["dataset"] for r in rows} >= {"digits", "lfw_faces", "kanji_fonts", "icons_rgb"}


def test_a_training_that_did_not_converge_is_named_with_its_cause_and_the_verdict_as_results_md_gives_it():
    row = {
        "dataset": "toy",
        "splits": {"train": 100, "val": 20, "test": 40},
        "trainings": [
            {"training": "local 0", "epochs": 12, "converged": True, "cause": None},
            {"training": "global", "epochs": 100, "converged": False, "cause": "still_improving"},
        ],
        "cnn_dnn": 0.9,
        "global": 0.8,
        "verdict": {"difference": 10.0, "low": 2.5, "high": 17.5, "verdict": "baseline not converged"},
        "flags": 1,
        "wall_s": 10.0,
        "cpu_s": 9.0,
    }
    line = user_data.table([row])[2]
    assert "| 1 of 2 | global (still_improving) | 12-100 | 90.00 | 80.00 |" in line
    assert "+10.00 [+2.50, +17.50]: baseline not converged" in line
