"""Benchmark the parallel baselines against the single-process global CNN on the same data, backbone and epochs.

Rows (all trained with the same loop, optimizer, batch size and epochs; one CPU thread per computing process):

* the global CNN in one process (``P = 1``);
* filter-parallel convolutions over ``P`` processes, shares from a calibration run (Marques et al.);
* BPT-CNN's outer layer, asynchronous (AGWU) and synchronous, ``P`` workers + a parameter server (Chen et al.).

For each: test accuracy, training wall time, speedup over the single process and parallel efficiency
(speedup / P, P counting the processes that compute), and for filter parallelism the per-step time ratio P/1 with
its split into computation and communication. The rows go to ``--out`` as JSON (``{"config", "machine", "rows",
"details"}``); ``ddcnn.baselines.baseline_rows`` and ``ddcnn.report.compare.load_baseline_rows`` read them back for the
comparison report.

    python bench/baselines.py --out results_baselines.json                      # digits, 16x16, vgg_small
    python bench/baselines.py --data mnist --train-subset 6000 --test-subset 2000 --image-size 28 --epochs 3

Timings are only meaningful on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

# Heavy imports (the data pipeline pulls in Lightning) stay inside main(): the spawned ranks re-import this script.
import torch

from ddcnn.baselines import TrainSpec, train_bpt, train_filter_parallel, train_single

MODELS = ("vgg_tiny", "vgg_small", "resnet_tiny", "resnet10")


def _load(args: argparse.Namespace):
    from ddcnn.data.datamodule import prepare
    from ddcnn.data.sources import digits, npz

    splits = digits() if args.data == "digits" else npz(args.mnist_path, name="mnist")
    size = (args.image_size, args.image_size) if args.image_size else None
    return prepare(
        splits,
        num_classes=splits.num_classes,
        in_channels=splits.in_channels,
        spatial_dims=2,
        image_size=size,
        val_fraction=0.15 if args.data == "digits" else 0.1,
        train_subset=args.train_subset,
        test_subset=args.test_subset,
    )


def _build(name: str, data) -> torch.nn.Module:
    import ddcnn.models as models

    torch.manual_seed(0)
    return getattr(models, name)(data.spatial_dims, data.in_channels, data.num_classes)


# Bulky per-run details kept out of the report rows (they go to the file's "details").
DETAILS = ("state_dict", "filters_per_rank", "allocations", "calibration_s_per_batch", "s_per_batch")


def _row(result: dict, single_wall: float, dataset: str) -> dict:
    row = {"dataset": dataset, **{k: v for k, v in result.items() if k not in DETAILS}}
    row["speedup"] = single_wall / row["wall_time_s"]
    row["parallel_efficiency"] = row["speedup"] / row["processes"]
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", choices=("digits", "mnist"), default="digits")
    parser.add_argument("--mnist-path", default=str(Path(__file__).resolve().parents[2] / "shared/data/mnist.npz"))
    parser.add_argument("--image-size", type=int, default=16, help="square size to resize to; 0 keeps the images")
    parser.add_argument("--train-subset", type=int, default=None)
    parser.add_argument("--test-subset", type=int, default=None)
    parser.add_argument("--model", choices=MODELS, default="vgg_small")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--schedule", choices=("cosine", "constant"), default="cosine", help="learning-rate schedule")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=2, help="P: filter-parallel ranks and BPT-CNN workers")
    parser.add_argument("--shares", type=float, nargs="+", default=None, help="fixed filter shares (no calibration)")
    parser.add_argument("--rounds-per-epoch", type=int, default=4, help="BPT-CNN IDPA rounds per epoch")
    parser.add_argument("--gamma", type=float, default=0.5, help="BPT-CNN AGWU decay coefficient")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline of each distributed run (s)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)

    data = _load(args)
    net = _build(args.model, data)
    spec = TrainSpec(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, schedule=args.schedule, seed=args.seed)
    splits = (data.x["train"], data.y["train"], data.x["test"], data.y["test"])
    p = args.processes
    print(
        f"data {data.name} {tuple(data.image_shape)}: {len(splits[0])} train / {len(splits[2])} test; {args.model}; "
        f"{spec.epochs} epochs of batch {spec.batch_size}; P={p}; {torch.get_num_threads()} threads here",
        flush=True,
    )

    results = []
    began = time.perf_counter()
    single = train_single(net, *splits, spec, threads=1)
    results.append(single)
    print(f"  single process done in {time.perf_counter() - began:.1f} s", flush=True)
    bpt = {"workers": p, "rounds_per_epoch": args.rounds_per_epoch, "timeout_s": args.timeout}
    runs = {
        "filter-parallel": lambda: train_filter_parallel(net, *splits, spec, p, args.shares, timeout_s=args.timeout),
        "BPT-CNN async": lambda: train_bpt(net, *splits, spec, mode="async", gamma=args.gamma, **bpt),
        "BPT-CNN sync": lambda: train_bpt(net, *splits, spec, mode="sync", **bpt),
    }
    for name, run in runs.items():
        began = time.perf_counter()
        results.append(run())
        print(f"  {name} done in {time.perf_counter() - began:.1f} s (with process start-up)", flush=True)

    rows = [_row(r, single["wall_time_s"], data.name) for r in results]
    print()
    print("| method | P | test acc. | train wall (s) | step (ms) | speedup | efficiency |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['processes']} | {r['accuracy']:.4f} | {r['wall_time_s']:.2f} | "
            f"{1e3 * r['step_time_s']:.2f} | {r['speedup']:.2f} | {r['parallel_efficiency']:.2f} |"
        )

    fp = rows[1]
    ratio = fp["step_time_s"] / single["step_time_s"]
    comm = fp["comm_time_per_step_s"]
    shares = [round(s, 3) for s in fp["shares"]]
    print(
        f"\nfilter-parallel: median step time P={p} / P=1 = {1e3 * fp['step_time_s']:.2f} / "
        f"{1e3 * single['step_time_s']:.2f} ms = {ratio:.2f}; shares {shares}; on average {1e3 * comm:.2f} of "
        f"{1e3 * fp['step_time_mean_s']:.2f} ms per step ({100 * comm / fp['step_time_mean_s']:.0f}%) inside the "
        f"layers' all-gathers/all-reduces; replicated layers in sync: {fp['replicated_divergence'] == 0.0}"
    )
    for r in rows[2:]:
        gap = 100 * (single["accuracy"] - r["accuracy"])
        print(
            f"{r['method']}: accuracy {100 * r['accuracy']:.2f}% vs single {100 * single['accuracy']:.2f}% "
            f"({'within' if gap <= 1.0 else 'NOT within'} 1 point, gap {gap:+.2f}); samples per worker "
            f"{r['samples_per_worker']}; staleness mean {r['staleness_mean']:.2f}, max {r['staleness_max']}"
        )

    if args.out is not None:
        report = {
            "config": {
                "data": data.name,
                "image_shape": list(data.image_shape),
                "n_train": len(splits[0]),
                "n_test": len(splits[2]),
                "model": args.model,
                "processes": p,
                "rounds_per_epoch": args.rounds_per_epoch,
                "gamma": args.gamma,
                **spec.as_dict(),
            },
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "filter_parallel_step_ratio": ratio,
            "rows": rows,
            "details": {r["method"]: {k: r[k] for k in DETAILS if k in r and k != "state_dict"} for r in results},
        }
        from ddcnn.io import atomic_write_json

        atomic_write_json(args.out, report)
        print(f"\nwrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
