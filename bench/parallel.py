"""Process parallelism of the local stage: P=2 workers against P=1, process start-up included.

Trains the same N local nets (MNIST subset, 4x4 decomposition) three ways, each as a fresh
``ddcnn-train stage=local`` command timed from launch to exit:

- P=1: in this process, one thread;
- P=2: two worker processes with one thread each (``parallel.workers=2``);
- P=1 with two threads (both cores through threads).

Prints the wall times and ``speedup P2/P1: <x>`` (one device against two; target >= 1.8), P2 against P=1
with two threads (target >= 1.0: process parallelism must not lose to threads), and the ``ddcnn-scaling``
prediction of the P=2 wall time from the P=1 run's measured per-net times against the measured one
(target: within 15%). On a machine with fewer free cores than 2 the ratios mean little: run it quiet.

    python bench/parallel.py                 # several minutes per way on a quiet 2-core machine
    python bench/parallel.py --quick         # a smoke run (ratios dominated by start-up)

The P=2 command pays process start-up twice in a row, the P=1 command once: the parent starts (Python, torch,
the data; it never imports Lightning, which it does not need), then its workers start side by side (Python, torch,
Lightning; the data come from the parent through shared memory) and calibrate. That fixed cost is why the workload
must be minutes long for the ratio to approach 2 (with start-ups S1, S2 and P=1 training time W:
ratio = (S1 + W) / (S2 + W/2)).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, SHARED_DATA

from ddcnn.report.scaling import run_times, scaling_table


def ddcnn_train(run_dir: Path, overrides: list[str], threads: int) -> float:
    """Wall seconds of one ``ddcnn-train`` command (a fresh process: start-up and data loading included)."""
    exe = Path(sys.executable).parent / "ddcnn-train"
    cmd = [str(exe), "stage=local", f"paths.run_dir={run_dir}", f"hydra.run.dir={run_dir}/hydra", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="mnist", help="mnist (../shared/data/mnist.npz) or digits")
    parser.add_argument("--grid", default="4x4", help="decomposition config (N local nets)")
    parser.add_argument("--model", default="vgg_small")
    parser.add_argument("--train-subset", type=int, default=8000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny workload: checks the script, not the ratios")
    parser.add_argument("--keep", type=Path, help="keep the run directories here")
    args = parser.parse_args()
    if args.data == "mnist" and not (SHARED_DATA / "mnist.npz").is_file():
        sys.exit(f"{SHARED_DATA / 'mnist.npz'} is missing; use --data digits")
    if args.quick:
        args.train_subset, args.epochs = 1000, 1
    common = [
        f"data={args.data}",
        f"decomposition={args.grid}",
        f"model={args.model}",
        f"trainer.max_epochs={args.epochs}",
        f"data.train_subset={args.train_subset}",
        f"data.test_subset={max(500, args.train_subset // 5)}",
        # MNIST's validation split is carved from all 60000 training images: 2% = 1200 (evaluated every epoch).
        f"data.val_fraction={0.02 if args.data == 'mnist' else 0.15}",
        "trainer.enable_progress_bar=false",
    ]
    ways = {
        "P=1, 1 thread": (["parallel.workers=1", "parallel.threads_per_worker=1"], 1),
        "P=2, 1 thread each": (["parallel.workers=2", "parallel.threads_per_worker=1"], 1),
        "P=1, 2 threads": (["parallel.workers=1", "parallel.threads_per_worker=2"], 2),
    }
    with tempfile.TemporaryDirectory(prefix="ddcnn-bench-parallel-") as tmp:
        base = args.keep or Path(tmp)
        walls, dirs = {}, {}
        for i, (name, (overrides, threads)) in enumerate(ways.items()):
            dirs[name] = base / f"run{i}"
            walls[name] = ddcnn_train(dirs[name], common + overrides, threads)
            print(f"{name:20s} {walls[name]:7.1f} s", flush=True)

        p1, p2, p1t2 = (walls[k] for k in ways)
        times = run_times(dirs["P=1, 1 thread"])
        n = len(times.local_s)
        # Start-up of the P=1 command (process, imports, data): its wall time minus the nets' own times. The P=2
        # command's critical path holds about one such start-up: its parent loads torch and the data but not
        # Lightning, its workers load torch and Lightning but not the data (and start side by side).
        startup = p1 - sum(times.local_s.values())
        _, rows = scaling_table(dirs["P=1, 1 thread"], [2], startup_s=startup)
        predicted = rows[0].total_s
        report = json.loads((dirs["P=2, 1 thread each"] / "parallel.json").read_text())
        print()
        print(
            f"workload: {n} local nets ({args.grid}, {args.model}, {args.data} train_subset={args.train_subset}, "
            f"{args.epochs} epochs); P=1 trains them in {sum(times.local_s.values()):.1f} s after {startup:.1f} s "
            f"of start-up"
        )
        print(f"speedup P2/P1: {p1 / p2:.2f}  (target >= 1.8)")
        print(f"P2 vs P1 with 2 threads: {p1t2 / p2:.2f}  (target >= 1.0)")
        print(f"ddcnn-scaling {dirs['P=1, 1 thread']} --devices 2 --startup-s {startup:.1f}:")
        print(
            f"ddcnn-scaling prediction for P=2: {predicted:.1f} s, measured {p2:.1f} s, error "
            f"{100 * (predicted - p2) / p2:+.1f}%  (target within 15%)"
        )
        for w in report["workers"]:
            calibrated = "-" if w["predicted_s"] is None else f"{w['predicted_s']:.1f}"
            print(
                f"  {w['describe']}: start-up {w['startup_s']:.1f} s, {len(w['subdomains'])} nets, calibrated "
                f"prediction {calibrated} s, actual {w['actual_s']:.1f} s"
            )


if __name__ == "__main__":
    main()
