"""Process parallelism of the local stage: P=2 workers against P=1, process start-up included.

Trains the same N local nets (MNIST subset, 4x4 decomposition) three ways, each as a fresh
``ddcnn-train stage=local`` command timed from launch to exit:

- P=1: in this process, one thread;
- P=2: two worker processes with one thread each (``parallel.workers=2``);
- P=1 with two threads (both cores through threads).

Each way runs ``--repeats`` times (default 2) in mirrored order (A B C, then C B A): the speed of a shared VM
drifts by 10-20% over minutes, and the mirrored order cancels a steady drift. Ratios are of the mean wall times.

Prints the wall times and ``speedup P2/P1: <x>`` (one device against two; target >= 1.8), P2 against P=1
with two threads (target >= 1.0: process parallelism must not lose to threads), and the ``ddcnn-scaling``
prediction of the P=2 wall time from the P=1 run's measured per-net times against the measured one
(target: within 15%). On a machine with fewer free cores than 2 the ratios mean little: run it quiet.

    python bench/parallel.py                 # about 25 minutes on a quiet 2-core machine
    python bench/parallel.py --quick --repeats 1   # a smoke run (ratios dominated by start-up)

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
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="tiny workload: checks the script, not the ratios")
    parser.add_argument("--keep", type=Path, help="keep the run directories here")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds of the three ways, in mirrored order (A B C, C B A, ...): the machine's speed drifts by 10-20%% "
        "over minutes on a shared VM, and a mirrored order cancels a steady drift (default 2)",
    )
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
        walls: dict[str, list[float]] = {name: [] for name in ways}
        dirs: dict[str, list[Path]] = {name: [] for name in ways}
        for r in range(args.repeats):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            for name in order:
                overrides, threads = ways[name]
                run_dir = base / f"round{r}_way{list(ways).index(name)}"
                dirs[name].append(run_dir)
                walls[name].append(ddcnn_train(run_dir, common + overrides, threads))
                print(f"round {r}: {name:20s} {walls[name][-1]:7.1f} s", flush=True)

        p1, p2, p1t2 = (sum(walls[k]) / len(walls[k]) for k in ways)
        # Start-up of the P=1 command (process, imports, data): its wall time minus the nets' own times. The P=2
        # command's critical path holds about one such start-up: its parent loads torch and the data but not
        # Lightning, its workers load torch and Lightning but not the data (and start side by side).
        predictions, startups = [], []
        for wall, run_dir in zip(walls["P=1, 1 thread"], dirs["P=1, 1 thread"], strict=True):
            times = run_times(run_dir)
            startups.append(wall - sum(times.local_s.values()))
            _, rows = scaling_table(run_dir, [2], startup_s=startups[-1])
            predictions.append(rows[0].total_s)
        n, startup = len(times.local_s), sum(startups) / len(startups)
        predicted = sum(predictions) / len(predictions)
        print()
        print(
            f"workload: {n} local nets ({args.grid}, {args.model}, {args.data} train_subset={args.train_subset}, "
            f"{args.epochs} epochs); P=1 trains them in {p1 - startup:.1f} s after {startup:.1f} s of start-up "
            f"(means of {args.repeats} rounds)"
        )
        for r in range(args.repeats):
            print(
                f"  round {r}: P2/P1 {walls['P=1, 1 thread'][r] / walls['P=2, 1 thread each'][r]:.2f}, "
                f"P2 vs P1 with 2 threads {walls['P=1, 2 threads'][r] / walls['P=2, 1 thread each'][r]:.2f}"
            )
        print(f"speedup P2/P1: {p1 / p2:.2f}  (target >= 1.8)")
        print(f"P2 vs P1 with 2 threads: {p1t2 / p2:.2f}  (target >= 1.0)")
        print(f"ddcnn-scaling RUN_DIR --devices 2 --startup-s {startup:.1f} on each P=1 run:")
        print(
            f"ddcnn-scaling prediction for P=2: {predicted:.1f} s, measured {p2:.1f} s, error "
            f"{100 * (predicted - p2) / p2:+.1f}%  (target within 15%)"
        )
        for run_dir in dirs["P=2, 1 thread each"]:
            report = json.loads((run_dir / "parallel.json").read_text())
            for w in report["workers"]:
                calibrated = "-" if w["predicted_s"] is None else f"{w['predicted_s']:.1f}"
                print(
                    f"  {run_dir.name} {w['describe']}: start-up {w['startup_s']:.1f} s, {len(w['subdomains'])} nets, "
                    f"calibrated prediction {calibrated} s, actual {w['actual_s']:.1f} s"
                )


if __name__ == "__main__":
    main()
