"""Benchmark the parallel baselines against the single-process global CNN on the same data, backbone and epochs.

Rows (all trained with the same loop, optimizer, batch size and epochs):

* the global CNN in one process (``P = 1``);
* filter-parallel convolutions over ``P`` processes, shares from a calibration run (Marques et al.);
* BPT-CNN's outer layer, asynchronous (AGWU) and synchronous, ``P`` workers + a parameter server (Chen et al.).

Thread policy: one intra-op thread per computing process, for every method (``ddcnn.baselines.launch.THREAD_POLICY``):
the reference runs on one core, ``P`` ranks on ``P`` cores (BPT-CNN's server, mostly waiting, takes one more thread),
so a speedup is that of ``P`` cores over one core whatever the machine, and the parallel efficiency (speedup / P,
P counting the processes that compute) is the usual strong-scaling one. With more processes than cores the
processes share cores and the speedups mean nothing; the header says so.

For each method: test accuracy, training wall time, speedup over the single process and parallel efficiency, and
for filter parallelism the per-step time P vs 1 with its split into computation and communication. ``--repeats``
runs every method that many times, interleaved (so a load that comes and goes weighs on all alike), and reports
means. During each run the load of the machine is sampled (runnable threads, busy cores), to tell whether other
work shared the cores. The rows go to ``--out`` as JSON (``{"config", "machine", "rows", "details"}``);
``ddcnn.baselines.baseline_rows`` and ``ddcnn.report.compare.load_baseline_rows`` read them back for the comparison
report.

    python bench/baselines.py --out results_baselines.json                      # digits, 16x16, vgg_small
    python bench/baselines.py --data mnist --train-subset 6000 --test-subset 2000 --image-size 28 --epochs 3
    python bench/baselines.py --paper-net                                       # Marques et al.'s CIFAR-10 net

``--paper-net`` times the network of Marques et al. (two 5x5 convs of 500 and 1500 filters on 32x32x3 inputs, see
``ddcnn.baselines.nets.marques_cifar``) on random CIFAR-shaped data, one process against filter-parallel, with
3 repeats of 12 steps of batch 32 (the first 5 steps of each run are warm-up and left out). Timings are only
meaningful on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time
from pathlib import Path

# Heavy imports (the data pipeline pulls in Lightning) stay inside main(): the spawned ranks re-import this script.
import torch

from ddcnn.baselines import TrainSpec, train_bpt, train_filter_parallel, train_single
from ddcnn.baselines.launch import THREAD_POLICY, available_cores, threads_per_rank

MODELS = ("vgg_tiny", "vgg_small", "resnet_tiny", "resnet10", "marques_cifar")
METHODS = ("single", "filter-parallel", "bpt-async", "bpt-sync")
# --paper-net: the settings of the Marques et al. check (issue 12), each still overridable on the command line.
PAPER_NET = {
    "data": "random",
    "model": "marques_cifar",
    "image_size": 32,
    "train_subset": 12 * 32,
    "test_subset": 64,
    "epochs": 1,
    "methods": ["single", "filter-parallel"],
    "repeats": 3,
    "calibration_samples": 8,
}


def _load(args: argparse.Namespace):
    if args.data == "random":
        return _random_cifar(args.train_subset or 12 * args.batch_size, args.test_subset or 64, args.image_size or 32)
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


def _random_cifar(n_train: int, n_test: int, size: int, num_classes: int = 10, seed: int = 0):
    """Normal noise of CIFAR-10's shape (3 x size x size, 10 classes) with random labels: for timing only."""
    from ddcnn.data.prepare import Prepared

    generator = torch.Generator().manual_seed(seed)
    x = {s: torch.randn(n, 3, size, size, generator=generator) for s, n in (("train", n_train), ("test", n_test))}
    y = {s: torch.randint(0, num_classes, (len(t),), generator=generator) for s, t in x.items()}
    names = [str(c) for c in range(num_classes)]
    return Prepared(x=x, y=y, class_names=names, mean=torch.zeros(3), std=torch.ones(3), name="random-cifar")


def _build(name: str, data) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "marques_cifar":
        from ddcnn.baselines.nets import marques_cifar

        return marques_cifar(data.spatial_dims, data.in_channels, data.num_classes, image_size=data.image_shape)
    import ddcnn.models as models

    return getattr(models, name)(data.spatial_dims, data.in_channels, data.num_classes)


# Bulky per-run details kept out of the report rows (they go to the file's "details").
DETAILS = ("state_dict", "filters_per_rank", "allocations", "calibration_s_per_batch", "s_per_batch")


class LoadMonitor:
    """Samples the machine's load while a run goes on: runnable threads (``/proc/loadavg``) and busy cores.

    ``runnable`` counts every thread that runs or waits for a core, the run's own included (the sampling thread
    itself is left out); ``busy_cores`` is the cores' busy time over the wall time (``/proc/stat``). Both are
    ``None`` where ``/proc`` does not exist.
    """

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _cpu_jiffies() -> tuple[int, int] | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]) - idle, sum(fields[:8])

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
            except (OSError, ValueError, IndexError):
                return
            self.samples.append(running - 1)

    def __enter__(self) -> LoadMonitor:
        self._began, self._jiffies = time.monotonic(), self._cpu_jiffies()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        wall = time.monotonic() - self._began
        end = self._cpu_jiffies()
        self.busy_cores = None
        if self._jiffies is not None and end is not None and wall > 0:
            self.busy_cores = (end[0] - self._jiffies[0]) / os.sysconf("SC_CLK_TCK") / wall
        self.runnable = statistics.fmean(self.samples) if self.samples else None

    def summary(self) -> dict:
        return {"load_runnable_mean": self.runnable, "load_busy_cores": self.busy_cores}


def _mean_of_runs(runs: list[dict]) -> dict:
    """One result for the repeats of a method: the first run's fields, numbers averaged, spreads kept."""
    merged = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float) and all(isinstance(r.get(key), float) for r in runs):
            merged[key] = statistics.fmean(r[key] for r in runs)
    merged["repeats"] = len(runs)
    merged["step_time_mean_s_runs"] = [r.get("step_time_mean_s") for r in runs]
    for key in ("load_runnable_mean", "load_busy_cores"):
        values = [r[key] for r in runs if r.get(key) is not None]
        merged[key] = statistics.fmean(values) if values else None
    return merged


def _row(result: dict, single_wall: float | None, dataset: str) -> dict:
    row = {"dataset": dataset, **{k: v for k, v in result.items() if k not in DETAILS}}
    row["speedup"] = single_wall / row["wall_time_s"] if single_wall else float("nan")
    row["parallel_efficiency"] = row["speedup"] / row["processes"]
    return row


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def _load_text(r: dict) -> str:
    runnable, busy = r.get("load_runnable_mean"), r.get("load_busy_cores")
    if runnable is None:
        return "-"
    return f"{runnable:.1f} runnable, {busy:.2f} cores busy"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paper-net", action="store_true", help="time Marques et al.'s CIFAR-10 network, P vs 1")
    parser.add_argument("--data", choices=("digits", "mnist", "random"), default=None, help="default digits")
    parser.add_argument("--mnist-path", default=str(Path(__file__).resolve().parents[2] / "shared/data/mnist.npz"))
    parser.add_argument("--image-size", type=int, default=None, help="square size to resize to (default 16; 0 keeps)")
    parser.add_argument("--train-subset", type=int, default=None)
    parser.add_argument("--test-subset", type=int, default=None)
    parser.add_argument("--model", choices=MODELS, default=None, help="default vgg_small")
    parser.add_argument("--epochs", type=int, default=None, help="default 5")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--schedule", choices=("cosine", "constant"), default="cosine", help="learning-rate schedule")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=2, help="P: filter-parallel ranks and BPT-CNN workers")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=None, help="default: all")
    parser.add_argument("--repeats", type=int, default=None, help="runs of every method, interleaved (default 1)")
    parser.add_argument("--shares", type=float, nargs="+", default=None, help="fixed filter shares (no calibration)")
    parser.add_argument("--calibration-samples", type=int, default=None, help="samples the calibration times")
    parser.add_argument("--rounds-per-epoch", type=int, default=4, help="BPT-CNN IDPA rounds per epoch")
    parser.add_argument("--gamma", type=float, default=0.5, help="BPT-CNN AGWU decay coefficient")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline of each distributed run (s)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    defaults = {"data": "digits", "image_size": 16, "model": "vgg_small", "epochs": 5, "methods": list(METHODS)}
    given = {k: v for k, v in vars(args).items() if v is not None}
    for key, value in {**defaults, "repeats": 1, **(PAPER_NET if args.paper_net else {}), **given}.items():
        setattr(args, key, value)
    if "single" not in args.methods:
        args.methods = ["single", *args.methods]  # the reference every speedup is measured against

    data = _load(args)
    net = _build(args.model, data)
    spec = TrainSpec(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, schedule=args.schedule, seed=args.seed)
    splits = (data.x["train"], data.y["train"], data.x["test"], data.y["test"])
    p = args.processes
    cores = available_cores()
    threads = threads_per_rank(p)
    print(
        f"data {data.name} {tuple(data.image_shape)}: {len(splits[0])} train / {len(splits[2])} test; {args.model} "
        f"({sum(t.numel() for t in net.parameters()) / 1e6:.2f} M weights); {spec.epochs} epochs of batch "
        f"{spec.batch_size}; P={p}; {args.repeats} repeat(s)",
        flush=True,
    )
    print(
        f"threads: {THREAD_POLICY} ({threads} per process; P=1: 1 in all, filter-parallel: {p * threads}, "
        f"BPT-CNN: {p * threads} + 1 for the server); {cores} cores here; load average before "
        f"{os.getloadavg()[0]:.2f}" + ("" if p * threads <= cores else f"; WARNING: {p * threads} threads > cores"),
        flush=True,
    )

    bpt = {"workers": p, "rounds_per_epoch": args.rounds_per_epoch, "timeout_s": args.timeout, "threads": threads}
    fp = {"shares": args.shares, "threads": threads, "calibration_samples": args.calibration_samples}
    runs = {
        "single": lambda: train_single(net, *splits, spec, threads=threads),
        "filter-parallel": lambda: train_filter_parallel(net, *splits, spec, p, timeout_s=args.timeout, **fp),
        "bpt-async": lambda: train_bpt(net, *splits, spec, mode="async", gamma=args.gamma, **bpt),
        "bpt-sync": lambda: train_bpt(net, *splits, spec, mode="sync", **bpt),
    }
    by_method: dict[str, list[dict]] = {m: [] for m in args.methods}
    for repeat in range(args.repeats):
        for method in args.methods:
            began = time.perf_counter()
            with LoadMonitor() as load:
                result = runs[method]()
            by_method[method].append({**result, **load.summary()})
            print(
                f"  [{repeat + 1}/{args.repeats}] {result['method']} done in {time.perf_counter() - began:.1f} s "
                f"(with process start-up); median step {_ms(result['step_time_s'])} ms; machine load during "
                f"the run: {_load_text(load.summary())}",
                flush=True,
            )
    results = [_mean_of_runs(r) for r in by_method.values()]
    single = results[0]
    rows = [_row(r, single["wall_time_s"], data.name) for r in results]
    print(f"\nthreads: {THREAD_POLICY}; {cores} cores; means over {args.repeats} repeat(s)")
    print("| method | P | test acc. | train wall (s) | median step (ms) | speedup | efficiency | machine load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['processes']} | {r['accuracy']:.4f} | {r['wall_time_s']:.2f} | "
            f"{_ms(r['step_time_s'])} | {r['speedup']:.2f} | {r['parallel_efficiency']:.2f} | {_load_text(r)} |"
        )
    if data.name == "random-cifar":
        print("(random data and labels: the accuracies are chance, only the times mean something)")

    report: dict = {}
    fp_rows = [r for r in rows if r["method"].startswith("filter-parallel")]
    if fp_rows:
        f = fp_rows[0]
        speedup = single["step_time_mean_s"] / f["step_time_mean_s"]
        report["filter_parallel_step_ratio"] = f["step_time_mean_s"] / single["step_time_mean_s"]
        report["filter_parallel_step_speedup"] = speedup
        print(f"\nfilter-parallel, mean step time (warm-up steps left out), {THREAD_POLICY}:")
        print("| P | step (ms) | compute (ms) | communication (ms) | step speedup | CPU per step (ms) | per run (ms) |")
        print("|---|---|---|---|---|---|---|")
        print(
            f"| 1 | {_ms(single['step_time_mean_s'])} | {_ms(single['step_time_mean_s'])} | 0 | 1.00 | "
            f"{_ms(single['cpu_time_per_step_s'])} | {', '.join(_ms(t) for t in single['step_time_mean_s_runs'])} |"
        )
        print(
            f"| {p} | {_ms(f['step_time_mean_s'])} | {_ms(f['compute_time_per_step_s'])} | "
            f"{_ms(f['comm_time_per_step_s'])} (largest rank {_ms(f['comm_time_per_step_max_s'])}) | {speedup:.2f} | "
            f"{_ms(f['cpu_time_per_step_s'])} (largest rank {_ms(f['cpu_time_per_step_max_s'])}) | "
            f"{', '.join(_ms(t) for t in f['step_time_mean_s_runs'])} |"
        )
        print(
            f"shares {[round(s, 3) for s in f['shares']]}; communication = time inside the collectives, waiting for "
            f"the other rank included; CPU = CPU time of one process (all its threads), which other work on the "
            f"machine hardly changes; replicated layers in sync: {f['replicated_divergence'] == 0.0}"
        )
    for r in rows:
        if r["method"].startswith("BPT-CNN"):
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
                "methods": list(args.methods),
                "repeats": args.repeats,
                "thread_policy": THREAD_POLICY,
                "threads_per_process": threads,
                "rounds_per_epoch": args.rounds_per_epoch,
                "gamma": args.gamma,
                **spec.as_dict(),
            },
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "cores_available": cores,
                "torch": torch.__version__,
            },
            **report,
            "rows": rows,
            "details": {r["method"]: {k: r[k] for k in DETAILS if k in r and k != "state_dict"} for r in results},
        }
        from ddcnn.io import atomic_write_json

        atomic_write_json(args.out, report)
        print(f"\nwrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
