"""The default demo's wall time at two commits, side by side: does ``ddcnn-train`` still finish as fast as it did?

    python bench/demo_time.py --base 3407822~1 [--repeats 3] [--out runs/bench/demo_time]

Runs README's first command (``ddcnn-train``, no overrides: the built-in digits, 2x2, overlap 2) from a clean worktree
of ``--base`` and from this checkout, alternating (base, this, base, this, ...) so that both see the same load, each
into a fresh run directory and a fresh store (nothing reused: every run trains everything). Prints every wall time,
the medians, and this checkout's median over the base's (issue 31's target: 0.8 to 1.2). The load average beside each
run says what else the machine did; compare ratios, not seconds, across machines.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _common import ROOT, TRAIN, train_env


def run_demo(tree: Path, out: Path) -> float:
    """Wall seconds of one ``ddcnn-train`` from ``tree``'s ddcnn into ``out`` (its own store); raises on failure."""
    env = train_env(PYTHONPATH=str(tree), DDCNN_STORE=str(out / "store"))
    start = time.perf_counter()
    done = subprocess.run(
        [*TRAIN, f"hydra.run.dir={out / 'run'}"], cwd=tree, env=env, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"ddcnn-train from {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. the one an issue was filed at)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per commit (default 3)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "demo_time")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    base = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if base.returncode != 0:
        raise SystemExit(f"--base {args.base!r} is not a commit of {ROOT}: {base.stderr.strip()}")
    commit = base.stdout.strip()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="ddcnn-demo-base-") as tmp:
        tree = Path(tmp) / commit
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), commit], cwd=ROOT, check=True)
        try:
            walls: dict[str, list[float]] = {commit: [], "this": []}
            for i in range(args.repeats):
                for name, where in ((commit, tree), ("this", ROOT)):
                    load = os.getloadavg()[0]
                    wall = run_demo(where, args.out / f"{name}_{i}")
                    walls[name].append(wall)
                    print(f"{name:>8} run {i}: {wall:7.1f} s (load before {load:.2f})", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    medians = {name: statistics.median(values) for name, values in walls.items()}
    print(f"median: {commit} {medians[commit]:.1f} s, this checkout {medians['this']:.1f} s")
    print(f"this / {commit}: {medians['this'] / medians[commit]:.3f} (target 0.8 to 1.2)")


if __name__ == "__main__":
    main()
