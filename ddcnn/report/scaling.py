"""The scaling table of a finished run: predicted wall time and speedup of the CNN-DNN on P devices.

Reads the measured training time of every local net (``local/<NN>/meta.json``), of the coarse DNN and of the
global CNN from a run directory, places the local nets on each device set with the LPT rule
(:func:`ddcnn.parallel.schedule.scaling_rows`) and compares with the global CNN on one device. This is how
a user sizes a cluster job before submitting it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddcnn.parallel.schedule import ScalingRow, default_device_counts, scaling_rows
from ddcnn.rundir import RunDir

__all__ = ["RunTimes", "run_times", "scaling_table"]


@dataclass
class RunTimes:
    """Measured seconds of one run's stages (``None`` for a stage that has not finished)."""

    local_s: dict[int, float]
    coarse_s: float | None
    global_s: float | None
    devices: list[str]


def _num_subdomains(run: RunDir) -> int | None:
    path = run.root / "fingerprint.json"
    if not path.is_file():
        return None
    grid = json.loads(path.read_text()).get("settings", {}).get("decomposition", {}).get("grid")
    if not grid:
        return None
    return math.prod(int(g) for g in grid)


def run_times(run_dir: str | Path) -> RunTimes:
    """The measured times of a run directory.

    Raises:
        FileNotFoundError: When the directory holds no run or some local nets have not finished.
    """
    run = RunDir(run_dir)
    if not (run.root / "local").is_dir():
        raise FileNotFoundError(
            f"{run.root} holds no local nets; give the run directory of a finished ddcnn-train run."
        )
    n = _num_subdomains(run)
    found = sorted(int(p.name) for p in (run.root / "local").iterdir() if p.name.isdigit())
    indices = list(range(n)) if n is not None else found
    missing = [i for i in indices if not run.is_done("local", i)]
    if missing or not indices:
        raise FileNotFoundError(
            f"local nets {missing or 'all'} have not finished in {run.root}; the scaling table needs the measured "
            f"time of every local net (run the local stage first)."
        )
    metas = {i: run.meta("local", i) for i in indices}
    stage_s = {s: (run.meta(s)["time_s"] if run.is_done(s) else None) for s in ("coarse", "global")}
    devices = sorted({str(m.get("device", "cpu")) for m in metas.values()})
    return RunTimes({i: float(m["time_s"]) for i, m in metas.items()}, stage_s["coarse"], stage_s["global"], devices)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def scaling_table(
    run_dir: str | Path,
    device_counts: Sequence[int] | None = None,
    mixed: Sequence[float] | None = None,
    startup_s: float = 0.0,
) -> tuple[str, list[ScalingRow]]:
    """The Markdown scaling table of a finished run, and its rows.

    Args:
        run_dir: A run directory whose local nets have finished (coarse and global are used when present).
        device_counts: The numbers of equal devices to predict for; default 1, 2, 4, ... up to N.
        mixed: Relative speeds of a mixed device set (1.0 = the device the run was measured on).
        startup_s: Fixed start-up added to each prediction (process start, data loading).
    """
    times = run_times(run_dir)
    n = len(times.local_s)
    counts = list(device_counts) if device_counts else default_device_counts(n)
    rows = scaling_rows(times.local_s, times.coarse_s, times.global_s, counts, mixed, startup_s)
    total = sum(times.local_s.values())
    lines = [
        f"# ddcnn scaling prediction: {Path(run_dir)}",
        "",
        f"{n} local nets measured on {', '.join(times.devices)}: {total:.1f} s in all, longest "
        f"{max(times.local_s.values()):.1f} s; coarse DNN {_s(times.coarse_s)} s; global CNN on one device "
        f"{_s(times.global_s)} s" + (f"; start-up {startup_s:.1f} s added to each row" if startup_s else "") + ".",
        "",
        "| devices (count x relative speed) | local stage (s) | CNN-DNN wall time (s) | speedup vs global CNN on 1 "
        "device | parallel efficiency |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        speedup = "-" if r.speedup is None else f"{r.speedup:.2f}x"
        lines.append(f"| {r.label} | {r.local_s:.1f} | {r.total_s:.1f} | {speedup} | {100 * r.efficiency:.0f}% |")
    if times.global_s is not None:
        lines.append(f"| global CNN, 1 x 1.0 | - | {times.global_s:.1f} | 1.00x | - |")
    lines += [
        "",
        "Local nets are placed longest first onto the device that finishes them earliest (LPT); a device of "
        "relative speed s trains a net in (measured time) / s. The coarse DNN runs after the last local net, on "
        "one device. Wall time = start-up + local stage + coarse DNN.",
        "",
    ]
    return "\n".join(lines), rows
