"""The memory plan against a real training step, activation checkpointing's cost and saving, and the pre-flight
check at 256³ (issue #47, items 1 and 2).

Three parts, each printed as a table and written to ``--out`` (JSON):

1. **Plan vs measured**, per network and size: :func:`ddcnn.models.memory.plan_network` (meta tensors) against
   :func:`ddcnn.models.memory.measure_step` (a real forward and backward on the CPU: what autograd saved, each
   storage once, plus parameters, gradients and Adam's state after its step; allocator-independent), the host's RSS
   growth over the forward beside it. Target: within 25% where the activations are >= 256 MiB, within 32 MiB below.
2. **Activation checkpointing** (``engine.activation_checkpointing``): the step time with and without it (median of
   ``--repeats`` steps, one process, alternating; the process's CPU time, with freed host memory kept as
   :func:`ddcnn.pipeline.train` keeps it), the planned activations and the host RSS growth over the forward (measured
   first, under the allocator as it comes: kept memory would hide the growth).
3. **The pre-flight check at 256³** (3D vgg_small, batch 2, 2x2x2): ``check_networks`` with the plan, CPU seconds and
   RSS growth, imports and the first meta trace of the process (which imports ``torch._dynamo``) excluded. Target:
   under 2 s of CPU and 1 GB of RSS.

    python bench/memory_plan.py [--quick] [--threads 1] [--out bench_memory_plan.json]
    python bench/memory_plan.py --doc RUN.json   # docs/cost.md's tables from that run (kept as docs/memory_plan.json)
    python bench/memory_plan.py --check          # docs/cost.md's tables == what docs/memory_plan.json gives

``--quick`` runs small sizes only (seconds; the test runs it). The full run takes a couple of minutes on one thread.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import _doc  # noqa: E402
from ddcnn.data.memory import peak_rss_bytes, rss_bytes  # noqa: E402
from ddcnn.models.checkpointing import apply_checkpointing, checkpoint_runs  # noqa: E402
from ddcnn.models.memory import MIB, measure_step, plan_network  # noqa: E402
from ddcnn.models.resnet import resnet18  # noqa: E402
from ddcnn.models.vgg import vgg_small  # noqa: E402
from ddcnn.runtime import cpu_capability, host_allocator, keep_freed_host_memory, load_average  # noqa: E402

DOC, RECORD = ROOT / "docs" / "cost.md", ROOT / "docs" / "memory_plan.json"

K = 2
# (label, builder, spatial_dims, side, batch): global and local (2x2x2 / 2x2) nets of the sizes, and 2D nets
# whose activations pass 256 MiB.
FULL = [
    ("vgg_small 3D global 32³", vgg_small, 3, 32, 2),
    ("vgg_small 3D local 16³", vgg_small, 3, 16, 2),
    ("vgg_small 3D global 64³", vgg_small, 3, 64, 2),
    ("vgg_small 3D local 32³", vgg_small, 3, 32, 2),
    ("vgg_small 3D global 80³", vgg_small, 3, 80, 2),
    ("vgg_small 2D global 384²", vgg_small, 2, 384, 8),
    ("resnet18 2D global 128²", resnet18, 2, 128, 8),
    ("resnet18 3D local 32³", resnet18, 3, 32, 2),
]
QUICK = [
    ("vgg_small 3D local 16³", vgg_small, 3, 16, 2),
    ("vgg_small 2D global 64²", vgg_small, 2, 64, 4),
    ("resnet18 2D local 32²", resnet18, 2, 32, 4),
]
CHECKPOINT_FULL = [("vgg_small 3D global 64³", vgg_small, 3, 64, 2), ("resnet18 2D global 128²", resnet18, 2, 128, 8)]
CHECKPOINT_QUICK = [("vgg_small 2D global 64²", vgg_small, 2, 64, 4)]


def _net(builder, spatial_dims: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return builder(spatial_dims=spatial_dims, in_channels=1, num_classes=K)


def _batch(spatial_dims: int, side: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(batch, 1, *(side,) * spatial_dims, generator=gen), torch.randint(K, (batch,), generator=gen)


def _forward_rss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """The host RSS growth over a training forward (what it holds for backward, as the allocator sees it)."""
    before = rss_bytes() or 0
    loss = F.cross_entropy(net(x), y)
    grown = (rss_bytes() or 0) - before
    loss.backward()
    return grown


def plan_vs_measured(cases) -> list[dict]:
    rows = []
    for label, builder, dims, side, batch in cases:
        net = _net(builder, dims)
        plan = plan_network(net, (1, *(side,) * dims), batch, num_classes=K)
        x, y = _batch(dims, side, batch)
        real = measure_step(copy.deepcopy(net), x, y)
        planned = plan.peak_bytes - plan.batch_bytes  # the measured figure has no batch
        rss = _forward_rss(copy.deepcopy(net).train(), x, y)
        error = planned - real["total_bytes"]
        limit = 0.25 * real["total_bytes"] if real["activation_bytes"] >= 256 * MIB else 32 * MIB
        rows.append(
            {
                "net": label,
                "batch": batch,
                "method": plan.method,
                "planned_activation_bytes": plan.activation_bytes,
                "measured_activation_bytes": real["activation_bytes"],
                "planned_bytes": planned,
                "measured_bytes": real["total_bytes"],
                "forward_rss_growth_bytes": rss,
                "error_bytes": error,
                "relative_error": error / real["total_bytes"],
                "within_target": abs(error) <= limit,
                "planned_gflops": plan.flops_per_step / 1e9,
                "measured_gflops": real["flops_per_step"] / 1e9,
            }
        )
    return rows


def _step_time(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """One forward and backward on the process's CPU clock: another process's share of the cores does not count."""
    began = time.process_time()
    F.cross_entropy(net(x), y).backward()
    net.zero_grad(set_to_none=True)
    return time.process_time() - began


def checkpointing_cost(cases, repeats: int) -> list[dict]:
    """Per case the planned activations with and without checkpointing, the host RSS growth over each forward (all
    cases first, under the allocator as it comes), then the step times with freed memory kept, as training runs."""
    nets = []
    for label, builder, dims, side, batch in cases:
        plain = _net(builder, dims).train()
        cut = apply_checkpointing(copy.deepcopy(plain)).train()
        x, y = _batch(dims, side, batch)
        shape = (1, *(side,) * dims)
        row = {
            "net": label,
            "batch": batch,
            "planned_activation_bytes": plan_network(plain, shape, batch, num_classes=K).activation_bytes,
            "planned_checkpointed_activation_bytes": plan_network(
                plain, shape, batch, num_classes=K, runs=checkpoint_runs(plain)
            ).activation_bytes,
            "forward_rss_growth_bytes": _forward_rss(plain, x, y),
            "checkpointed_forward_rss_growth_bytes": _forward_rss(cut, x, y),
        }
        nets.append((row, plain, cut, x, y))
    keep_freed_host_memory()
    for row, plain, cut, x, y in nets:
        _step_time(plain, x, y), _step_time(cut, x, y)  # first use of each shape's kernels
        times = {"plain": [], "checkpointed": []}
        for _ in range(repeats):  # alternating: a drift of the machine falls on both alike
            times["plain"].append(_step_time(plain, x, y))
            times["checkpointed"].append(_step_time(cut, x, y))
        t_plain, t_cut = statistics.median(times["plain"]), statistics.median(times["checkpointed"])
        row.update(step_s=t_plain, checkpointed_step_s=t_cut, time_cost=t_cut / t_plain)
    return [row for row, *_ in nets]


def preflight(side: int) -> dict:
    """``check_networks`` (shape check and plan of the local, global and coarse nets) of 3D vgg_small volumes of
    ``side``³, batch 2, 2x2x2, with data that hold no voxels (only their shape is read)."""
    import ddcnn.context as context
    from ddcnn.config import compose
    from ddcnn.decomposition import Decomposition
    from ddcnn.rundir import RunDir
    from ddcnn.settings import RunSettings

    settings = RunSettings.from_config(compose(["model=vgg_small", "data.batch_size=2"], Path("/tmp/ddcnn-bench-run")))
    settings = settings.with_data_counts(K, 1)

    def ctx_of(n: int):
        data = SimpleNamespace(
            image_shape=(n,) * 3, in_channels=1, spatial_dims=3, num_classes=K, y={"train": range(100)}
        )
        return context.Context(
            RunDir("/tmp/ddcnn-bench-run"), data, Decomposition((2, 2, 2), (n,) * 3, (0,) * 3), settings
        )

    context.check_networks(ctx_of(16))  # the process's first meta trace imports torch._dynamo: an import
    ctx = ctx_of(side)
    peak, rss, cpu = peak_rss_bytes() or 0, rss_bytes() or 0, resource.getrusage(resource.RUSAGE_SELF)
    began = time.perf_counter()
    context.check_networks(ctx)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "side": side,
        "cpu_s": after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime,
        "wall_s": wall,
        "rss_growth_bytes": (rss_bytes() or 0) - rss,
        "peak_rss_growth_bytes": (peak_rss_bytes() or 0) - peak,
        "plan": ctx.memory_plan,
    }


def _mib(v: float) -> str:
    return f"{v / MIB:,.1f}" if v < 100 * MIB else f"{v / MIB:,.0f}"


def table(record: dict) -> list[str]:
    """docs/cost.md's lines from one run: plan against measured per net, checkpointing's saving and price, the
    pre-flight check at 256³, and how it was measured."""
    lines = [
        "| net | batch | saved for backward, plan / measured (MiB) | the step's memory, plan / measured (MiB) | "
        "plan error | host RSS growth over the forward (MiB) | GFLOP per step | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = record["plan_vs_measured"]
    for r in rows:
        lines.append(
            f"| {r['net']} | {r['batch']} | {_mib(r['planned_activation_bytes'])} / "
            f"{_mib(r['measured_activation_bytes'])} | {_mib(r['planned_bytes'])} / {_mib(r['measured_bytes'])} | "
            f"{100 * r['relative_error']:+.2f}% | {_mib(r['forward_rss_growth_bytes'])} | {r['planned_gflops']:.2f} | "
            f"{'met' if r['within_target'] else '**missed**'} |"
        )
    worst = max(rows, key=lambda r: abs(r["relative_error"]))
    low, high = min(r["measured_bytes"] for r in rows), max(r["measured_bytes"] for r in rows)
    lines += [
        "",
        f"The plan meets its target (within 25% where the activations are 256 MiB or more, within 32 MiB below) for "
        f"{sum(r['within_target'] for r in rows)} of {len(rows)} nets, {_mib(low)} to {_mib(high)} MiB measured; "
        f"its largest error is {100 * worst['relative_error']:+.2f}% ({worst['net']}).",
        "",
        "| net | batch | saved for backward, plain / checkpointed (plan, MiB) | less | step, plain / checkpointed "
        "(CPU s) | time cost |",
        "|---|---|---|---|---|---|",
    ]
    for r in record["checkpointing"]:
        plain, cut = r["planned_activation_bytes"], r["planned_checkpointed_activation_bytes"]
        lines.append(
            f"| {r['net']} | {r['batch']} | {_mib(plain)} / {_mib(cut)} | {100 * (1 - cut / plain):.0f}% | "
            f"{r['step_s']:.3f} / {r['checkpointed_step_s']:.3f} | {r['time_cost']:.2f}x |"
        )
    p = record["preflight"]
    planned_gib = p["plan"]["global"]["activation_bytes"] / 2**30
    load = lambda v: "-" if v is None else " ".join(f"{x:.2f}" for x in v)  # noqa: E731
    lines += [
        "",
        f"`check_networks` with the plan at {p['side']}³ (3D vgg_small, batch 2, 2x2x2; imports and the process's "
        f"first meta trace excluded): {p['cpu_s']:.2f} s of CPU, RSS {p['rss_growth_bytes'] / MIB:+.1f} MiB (target: "
        f"under 2 s and 1 GB); the global CNN's activations planned at {planned_gib:.2f} GiB.",
        f"Measured {record['date']} by `{' '.join(['python bench/memory_plan.py', *record['argv']])}`: "
        f"{record['threads']} thread(s), {record['cpu']} ({record['cpu_capability']}, {record['cpu_count']} cores); "
        f"step time: {record['clock']}, the median of {record['repeats']} steps, host allocator "
        f"{record['host_allocator']}; load average {load(record['load_before'])} before, "
        f"{load(record['load_after'])} after.",
    ]
    return lines


BLOCK = _doc.Block("memory_plan.py", DOC, RECORD, table, "the memory plan's tables")


def main(argv: list[str] | None = None) -> dict:
    import os

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only (seconds)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per checkpointing case")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    BLOCK.add_arguments(parser)
    args = parser.parse_args(argv)
    if BLOCK.handle(args):
        return {}
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (2 if args.quick else 5)
    result = {
        "date": datetime.date.today().isoformat(),
        "argv": _doc.measured_argv(argv if argv is not None else sys.argv[1:]),
        "threads": args.threads,
        "repeats": repeats,
        "cpu": _doc.cpu_name(),
        "cpu_capability": cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "clock": "process CPU time",
        "load_before": load_average(),
    }
    try:
        result["preflight"] = preflight(64 if args.quick else 256)
        result["plan_vs_measured"] = plan_vs_measured(QUICK if args.quick else FULL)
        result["checkpointing"] = checkpointing_cost(CHECKPOINT_QUICK if args.quick else CHECKPOINT_FULL, repeats)
    finally:
        torch.set_num_threads(threads)  # main() also runs inside other processes (the tests)
    result["host_allocator"] = host_allocator()
    result["load_after"] = load_average()
    print(f"{'net':28}{'batch':>6}{'saved plan':>12}{'saved real':>12}{'plan':>10}{'real':>10}{'error':>8}"
          f"{'RSS fwd':>10}{'GFLOP':>9}  target")  # fmt: skip
    for r in result["plan_vs_measured"]:
        print(
            f"{r['net']:28}{r['batch']:6d}{r['planned_activation_bytes'] / MIB:12.1f}"
            f"{r['measured_activation_bytes'] / MIB:12.1f}{r['planned_bytes'] / MIB:10.1f}"
            f"{r['measured_bytes'] / MIB:10.1f}{100 * r['relative_error']:7.2f}%"
            f"{r['forward_rss_growth_bytes'] / MIB:10.1f}{r['planned_gflops']:9.2f}  "
            f"{'met' if r['within_target'] else 'MISSED'}"
        )
    print("(MiB; plan and real: params + grads + Adam state + saved for backward; RSS fwd: host RSS growth over the "
          "forward)")  # fmt: skip
    print(f"\n{'checkpointing':28}{'step s':>9}{'ckpt s':>9}{'cost':>7}{'saved plan':>12}{'ckpt plan':>11}"
          f"{'RSS fwd':>10}{'ckpt RSS':>10}")  # fmt: skip
    for r in result["checkpointing"]:
        print(
            f"{r['net']:28}{r['step_s']:9.3f}{r['checkpointed_step_s']:9.3f}{r['time_cost']:6.2f}x"
            f"{r['planned_activation_bytes'] / MIB:12.1f}{r['planned_checkpointed_activation_bytes'] / MIB:11.1f}"
            f"{r['forward_rss_growth_bytes'] / MIB:10.1f}{r['checkpointed_forward_rss_growth_bytes'] / MIB:10.1f}"
        )
    p = result["preflight"]
    print(
        f"\ncheck_networks + plan at {p['side']}³ (vgg_small 3D, batch 2, 2x2x2): {p['cpu_s']:.2f} s CPU, "
        f"{p['wall_s']:.2f} s wall, RSS +{p['rss_growth_bytes'] / MIB:.1f} MiB (peak +"
        f"{p['peak_rss_growth_bytes'] / MIB:.1f} MiB); global activations planned "
        f"{p['plan']['global']['activation_bytes'] / 2**30:.2f} GiB"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
