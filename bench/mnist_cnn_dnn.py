"""CNN-DNN against the global CNN on real MNIST: small VGG, 2x2 and 4x4 decompositions.

Trains the global CNN once and the local nets + coarse DNN for each decomposition on the same data
(a stratified training subset of the official MNIST training set, the full official test set), then
prints one table. Targets (issue 2): CNN-DNN test accuracy >= 0.98 and >= global - 0.3 points.

    python bench/mnist_cnn_dnn.py [--train-subset 20000] [--epochs 4] [--overlap 2] [--out bench_runs/mnist]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from _common import SHARED_DATA, config, quiet

from ddcnn.pipeline import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-subset", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--overlap", type=int, default=2)
    parser.add_argument("--model", default="vgg_small")
    parser.add_argument("--grids", default="2x2,4x4")
    parser.add_argument("--out", default="bench_runs/mnist")
    args = parser.parse_args()
    quiet()
    archive = SHARED_DATA / "mnist.npz"
    if not archive.is_file():
        raise SystemExit(f"{archive} not found: this benchmark needs the real MNIST archive (see data/README.md).")
    out = Path(args.out)
    common = [
        "data=mnist",
        f"data.path={archive}",
        f"data.train_subset={args.train_subset}",
        f"model={args.model}",
        f"trainer.max_epochs={args.epochs}",
        "trainer.enable_progress_bar=false",
    ]
    rows, start = [], time.perf_counter()
    global_dir = None
    for grid in args.grids.split(","):
        run_dir = out / f"{grid}_o{args.overlap}"
        if global_dir is not None and not (run_dir / "global" / "done").exists():
            # The global CNN does not depend on the decomposition: train it once and reuse its artifacts.
            shutil.copytree(global_dir, run_dir / "global", dirs_exist_ok=True)
        cfg = config([*common, f"decomposition={grid}", f"decomposition.overlap={args.overlap}"], run_dir)
        results = train(cfg)
        global_dir = global_dir or run_dir / "global"
        rows.append((grid, results))
    total = time.perf_counter() - start
    print(
        f"\nMNIST, {args.train_subset} training images (stratified subset of the official 60000; 10% of them "
        f"held out for validation), official 10000 test images, {args.model}, {args.epochs} epochs, "
        f"overlap {args.overlap}"
    )
    print(
        "| grid | global CNN | CNN-DNN | mean prob. | majority vote | best local | global time (s) "
        "| slowest local + coarse (s) | projected speedup |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for grid, r in rows:
        a, t = r["accuracy"], r["time_s"]
        print(
            f"| {grid} | {a['global']:.4f} | {a['cnn_dnn']:.4f} | {a['mean_prob']:.4f} | {a['majority_vote']:.4f} | "
            f"{max(a['local']):.4f} | {t['global']:.1f} | {r['projected_time_s']:.1f} | {r['projected_speedup']:.2f} |"
        )
    for grid, r in rows:
        a = r["accuracy"]
        ok = a["cnn_dnn"] >= 0.98 and a["cnn_dnn"] >= a["global"] - 0.003
        print(f"{grid}: CNN-DNN {a['cnn_dnn']:.4f} vs global {a['global']:.4f} -> target {'met' if ok else 'NOT met'}")
    print(f"total wall time: {total / 60:.1f} min")
    (out / "summary.json").write_text(json.dumps({g: r["accuracy"] for g, r in rows}, indent=2))


if __name__ == "__main__":
    main()
