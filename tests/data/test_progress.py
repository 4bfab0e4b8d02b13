"""The one progress helper (ddcnn/data/progress.py): a tqdm bar where asked (or on a terminal), lines elsewhere, and
lines with a warning where tqdm cannot be imported."""

from __future__ import annotations

import io
import logging
import sys

import pytest

import ddcnn.data.progress as progress
from ddcnn.data.progress import Progress, open_bar, track


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_where_asked_or_on_a_terminal_and_none_elsewhere(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file
    assert open_bar(5, "stage", "epoch") is None and open_bar(5, "stage", "epoch", enabled=False) is None
    bar = open_bar(5, "stage", "epoch", initial=2, enabled=True)  # trainer.enable_progress_bar=true: wherever it goes
    assert bar is not None and (bar.n, bar.total) == (2, 5)
    bar.close()
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = open_bar(5, "stage", "epoch")
    assert bar is not None
    bar.close()
    assert "\r" in sys.stderr.getvalue() and "stage" in sys.stderr.getvalue()


def test_without_tqdm_a_bar_becomes_lines_and_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # an install that lost it: `import tqdm` raises ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    monkeypatch.setattr(progress, "_warned_no_tqdm", False)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with caplog.at_level(logging.INFO, logger="ddcnn.data"):
        assert open_bar(5, "stage", "epoch", enabled=True) is None
        assert list(track(range(20), "loading", "volumes")) == list(range(20))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tqdm, a dependency of ddcnn, cannot be imported" in warnings[0]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines[-1].startswith("loading: done, 20 volumes") and len(lines) == 10  # nine tenths, then done
    assert "\r" not in sys.stderr.getvalue()


@pytest.mark.parametrize("n", [3, 30])
def test_track_yields_every_item_and_shows_only_many(n, caplog):
    with caplog.at_level(logging.INFO, logger="ddcnn.data"):
        assert list(track(list(range(n)), "writing", "volumes")) == list(range(n))
    assert ("writing: done" in caplog.text) == (n >= 10)


def test_progress_closes_its_bar_when_the_work_fails(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with pytest.raises(RuntimeError), Progress("preparing", 10, "samples") as work:
        bar = work.bar
        raise RuntimeError("the source failed")
    assert bar is not None and bar.disable  # tqdm marks a closed bar disabled
