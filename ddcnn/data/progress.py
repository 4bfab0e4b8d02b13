"""Progress of long work (preparing a dataset, NIfTI volumes, the epochs of a training): a bar on a terminal, complete
lines in a file. The one place ddcnn makes a progress bar (:func:`open_bar`, tqdm's).

A SLURM output file, a CI log or ``> log`` would otherwise collect a progress bar's carriage-return redraws, one
unreadable line of thousands of updates. Off a terminal, :class:`Progress` writes a complete line at every tenth of
the work and at least every ``every_s`` seconds, and one when it finishes: a log record (``INFO``, logger
``ddcnn.data``) where logging is set up (``ddcnn-train``), else a line on stderr. The training's epoch reporter
(:class:`ddcnn.engine.loggers.EpochReporter`) takes its bar from :func:`open_bar` and writes its own epoch lines.

tqdm is a dependency of ddcnn; where it cannot be imported all the same (an install that lost it), a bar becomes
those lines, with one warning that says why.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

__all__ = ["Progress", "on_terminal", "open_bar", "track"]

log = logging.getLogger("ddcnn.data")
_T = TypeVar("_T")
_warned_no_tqdm = False


def _say(message: str, *args) -> None:
    if logging.getLogger().handlers or log.handlers:
        log.info(message, *args)
    else:  # logging is not set up (a script, a notebook): stderr, one line
        print(message % args, file=sys.stderr, flush=True)


def on_terminal() -> bool:
    """Whether stderr is a terminal (a bar can redraw itself there)."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def open_bar(total: int, desc: str, unit: str, initial: int = 0, enabled: bool | None = None) -> Any | None:
    """A tqdm bar of ``total`` units (``tqdm.auto``: a widget in a notebook), or ``None`` where the caller writes lines.

    Args:
        total: Units of work in all.
        desc: What is being done (the bar's label).
        unit: The name of one unit (``epoch``, ``volume``).
        initial: Units done before the bar starts (a resumed training's epochs).
        enabled: ``True``: a bar wherever stderr goes; ``False``: none; ``None``: a bar on a terminal only.
    """
    global _warned_no_tqdm
    if not (on_terminal() if enabled is None else enabled):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError as err:
        if not _warned_no_tqdm:
            _warned_no_tqdm = True
            log.warning("no progress bar: tqdm, a dependency of ddcnn, cannot be imported (%s); pip install tqdm", err)
        return None
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=False)


class Progress:
    """Counts work done towards ``total`` units and shows it.

    Args:
        desc: What is being done, e.g. ``preparing adrenal3d_64``.
        total: Units of work in all.
        unit: Their name (``samples``, ``volumes``).
        enabled: ``False`` shows nothing.
        every_s: Off a terminal, the longest time between two lines.
        nbytes: Bytes that ``total`` units amount to (shown beside the count).
    """

    def __init__(
        self,
        desc: str,
        total: int,
        unit: str = "samples",
        enabled: bool = True,
        every_s: float = 30.0,
        nbytes: int | None = None,
    ) -> None:
        self.desc, self.total, self.unit, self.nbytes = desc, max(int(total), 0), unit, nbytes
        self.done = 0
        self.every_s = float(every_s)
        self.start = self.last = time.monotonic()
        self.next_step = 1
        self.enabled = bool(enabled) and self.total > 0
        self.bar = open_bar(self.total, desc, unit.rstrip("s") or unit) if self.enabled else None

    def update(self, n: int = 1) -> None:
        self.done += int(n)
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        step = self.done * 10 // self.total if self.total else 10
        if (step >= self.next_step and self.done < self.total) or now - self.last >= self.every_s:
            self.next_step = step + 1
            self._line(now)

    def _line(self, now: float) -> None:
        self.last = now
        size = ""
        if self.nbytes:
            size = f", {self.nbytes * self.done / max(self.total, 1) / 1e6:.0f}/{self.nbytes / 1e6:.0f} MB"
        pct = 100 * self.done // max(self.total, 1)
        _say(
            "%s: %d%% (%d/%d %s%s) in %.0f s", self.desc, pct, self.done, self.total, self.unit, size, now - self.start
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.enabled:
            _say("%s: done, %d %s in %.1f s", self.desc, self.done, self.unit, time.monotonic() - self.start)
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self.bar is not None:
            self.bar.close()


def track(items: Sequence[_T], desc: str, unit: str, enabled: bool = True, min_items: int = 10) -> Iterator[_T]:
    """Iterates ``items`` showing progress (:class:`Progress`) when there are at least ``min_items`` of them (fewer
    pass in a blink; a bar or lines would only clutter the log)."""
    if not enabled or len(items) < min_items:
        yield from items
        return
    with Progress(desc, len(items), unit) as progress:
        for item in items:
            yield item
            progress.update()
