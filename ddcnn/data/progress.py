"""Progress of long data work (preparing a dataset, preprocessing NIfTI volumes): a bar on a terminal, one line per
step in a file.

A SLURM output file, a CI log or ``> log`` would otherwise collect a progress bar's carriage-return redraws, one
unreadable line of thousands of updates. Off a terminal, :class:`Progress` writes a complete line at every tenth of
the work and at least every ``every_s`` seconds, and one when it finishes: a log record (``INFO``, logger
``ddcnn.data``) where logging is set up (``ddcnn-train``), else a line on stderr.
"""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["Progress", "on_terminal"]

log = logging.getLogger("ddcnn.data")


def _say(message: str, *args) -> None:
    if logging.getLogger().handlers or log.handlers:
        log.info(message, *args)
    else:  # logging is not set up (a script, a notebook): stderr, one line
        print(message % args, file=sys.stderr, flush=True)


def on_terminal() -> bool:
    """Whether stderr is a terminal (a bar can redraw itself there)."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


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
        self.bar = None
        self.enabled = bool(enabled) and self.total > 0
        if self.enabled and on_terminal():
            try:
                from tqdm.auto import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=self.total, desc=desc, unit=unit.rstrip("s") or unit, leave=False)

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
