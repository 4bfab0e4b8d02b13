"""``ddcnn-report``: the comparison report of finished runs (thin: the logic is in :mod:`ddcnn.report.compare`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddcnn.report.compare import find_runs, load_baseline_rows, load_run, write_report

__all__ = ["report_main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddcnn-report",
        description="One table per dataset (Markdown and CSV) and plots, from finished ddcnn-train runs.",
        epilog="Examples: ddcnn-report runs/mnist/2x2_o2_vgg_small/2025-01-01_12-00-00 ...  |  "
        "ddcnn-report --sweep multirun/2025-01-01_12-00-00 --out report/",
    )
    parser.add_argument("runs", nargs="*", type=Path, help="run directories (each with results.json, config.yaml)")
    parser.add_argument(
        "--sweep", action="append", type=Path, default=[], help="a folder searched for run directories (repeatable)"
    )
    parser.add_argument("--out", type=Path, help="output folder (default: SWEEP/report, or ./report)")
    parser.add_argument(
        "--baselines", action="append", type=Path, default=[], help="JSON rows of other methods (repeatable)"
    )
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="KEY",
        help="a setting whose differences between runs do not split groups (repeatable), e.g. trainer.precision",
    )
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    return parser


def report_main(argv: list[str] | None = None) -> None:
    """``ddcnn-report RUN_DIR... | --sweep MULTIRUN_DIR [--out DIR] [--baselines FILE]``."""
    args = _parser().parse_args(argv)
    if not args.runs and not args.sweep:
        _parser().error("give run directories or --sweep MULTIRUN_DIR")
    try:
        paths = list(args.runs)
        for sweep in args.sweep:
            finished, unfinished = find_runs(sweep)
            if unfinished:
                print(
                    f"ddcnn-report: {len(unfinished)} run(s) under {sweep} have not been evaluated and are left out: "
                    + ", ".join(str(p) for p in unfinished),
                    file=sys.stderr,
                )
            paths += finished
        runs = [load_run(p) for p in dict.fromkeys(paths)]
        baselines = [row for path in args.baselines for row in load_baseline_rows(path)]
        out = args.out or (args.sweep[0] / "report" if args.sweep else Path("report"))
        written = write_report(runs, out, baselines, plots=not args.no_plots, ignore=args.ignore)
    except (ValueError, OSError) as err:
        print(f"ddcnn-report: error: {err}", file=sys.stderr)
        sys.exit(2)
    print((out / "report.md").read_text())
    print(f"ddcnn-report: {len(runs)} runs -> {', '.join(str(p) for files in written.values() for p in files)}")
