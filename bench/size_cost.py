"""The cost curve by image size: the global CNN against one local net of the decomposition (issue #47, item 3).

For 2D images of 64² to 512² and 3D volumes of 32³ to 128³, grids 2x2 / 4x4 (2x2x2 / 4x4x2), overlap 0 and 2, one
row per (size, grid, overlap): the FLOPs of a training step of each net and their ratio, the memory the plan gives
each (:func:`ddcnn.models.memory.plan_network`: saved for backward; and the whole step), and, where the global step
is cheap enough (``--max-gflop``), the per-step time of each measured in this process (median of ``--repeats``
measurements, alternating global and local, each of as many steps as take :data:`MIN_MEASURE_S`) and its ratio.
``--rss`` adds what ``bench/memory3d.py`` measured (now gone into this script): the peak host RSS of a few training
steps above the process's baseline, each net in a fresh process.

    python bench/size_cost.py [--quick] [--model vgg_small] [--batch 2] [--threads 1] [--out size_cost.json]
    python bench/size_cost.py --out b.json --compare a.json   # a second run: how far its step-time ratios are from a's
    python bench/size_cost.py --doc b.json                     # docs/cost.md's table from that run (and docs/cost.json)
    python bench/size_cost.py --check                          # docs/cost.md's table == what docs/cost.json gives

``--quick`` plans a few small rows and times none (seconds; the test runs it). FLOPs and memory come from meta tensors,
so every row is planned whatever its size; times are wall clock on a machine that may be loaded (the JSON records the
load average before and after, the host allocator and the CPU, and the table prints them). The ratios of one process
are comparable; absolute times are not. The process keeps its freed host memory as training does
(:func:`ddcnn.runtime.keep_freed_host_memory`; ``--host-memory glibc`` measures glibc as it comes): the allocator
changed the 64³ global/local step-time ratio from 8.4 to 6.3 (``docs/cost.md``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _doc  # noqa: E402
from ddcnn.decomposition import Decomposition  # noqa: E402
from ddcnn.models import resnet, vgg  # noqa: E402
from ddcnn.models.memory import MIB, plan_network  # noqa: E402
from ddcnn.runtime import cpu_capability, host_allocator, keep_freed_host_memory, load_average  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC, RECORD = ROOT / "docs" / "cost.md", ROOT / "docs" / "cost.json"

K = 2
SIZES = {2: (64, 128, 256, 512), 3: (32, 64, 128)}
GRIDS = {2: ((2, 2), (4, 4)), 3: ((2, 2, 2), (4, 4, 2))}
OVERLAPS = (0, 2)
QUICK_ROWS = [(2, 64, (2, 2), 0), (2, 64, (2, 2), 2), (3, 32, (2, 2, 2), 0), (3, 32, (2, 2, 2), 2)]


def _builder(model: str):
    return getattr(vgg, model, None) or getattr(resnet, model)


def _net(model: str, spatial_dims: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return _builder(model)(spatial_dims=spatial_dims, in_channels=1, num_classes=K)


# Each timed measurement runs a net's step as many times as take at least this long (its per-step time the mean): a
# small sub-domain's step takes a millisecond, and one step timed alone made two quiet runs differ by up to 49%
# (128² 4x4: step-time ratio 12.1 against 8.1).
MIN_MEASURE_S = 0.25


def _step_s(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, count: int = 1) -> float:
    """Seconds per training step of ``net`` (forward, loss, backward), the mean of ``count`` steps in a row.

    On the CPU, CPU seconds of this process: what another process takes of the cores does not count (its share of the
    caches still does), and the kernel's time on the step's page faults does. On a GPU, the wall clock between two
    synchronisations: the device's time."""
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(x.device)
    began = time.perf_counter() if cuda else time.process_time()
    for _ in range(count):
        F.cross_entropy(net(x), y).backward()
        net.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(x.device)
        return (time.perf_counter() - began) / count
    return (time.process_time() - began) / count


def _times(
    model: str, dims: int, full: tuple[int, ...], sub: tuple[int, ...], batch: int, repeats: int, device: torch.device
) -> dict:
    """Per-step time of the global net and of one local net (median of ``repeats`` measurements, alternating), and on
    a GPU what a step of each adds to the memory allocated before it (``torch.cuda.max_memory_allocated``: the saved
    activations, the gradients and the kernels' workspace; the net and its batch were there before)."""
    nets = {"global": _net(model, dims).train().to(device), "local": _net(model, dims).train().to(device)}
    gen = torch.Generator().manual_seed(0)
    data = {
        "global": (torch.randn(batch, 1, *full, generator=gen), torch.randint(K, (batch,), generator=gen)),
        "local": (torch.randn(batch, 1, *sub, generator=gen), torch.randint(K, (batch,), generator=gen)),
    }
    data = {role: (x.to(device), y.to(device)) for role, (x, y) in data.items()}
    counts, peaks = {}, {}
    for role in nets:  # first use of each shape's kernels, then how many steps make one measurement
        _step_s(nets[role], *data[role])
        if device.type == "cuda":
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        counts[role] = max(1, math.ceil(MIN_MEASURE_S / max(_step_s(nets[role], *data[role]), 1e-6)))
        if device.type == "cuda":
            peaks[role] = (torch.cuda.max_memory_allocated(device) - before) / MIB
    times = {"global": [], "local": []}
    for _ in range(repeats):
        for role in nets:
            times[role].append(_step_s(nets[role], *data[role], counts[role]))
    out = {role: statistics.median(values) for role, values in times.items()}
    if peaks:
        out |= {"step_added_global_mib": peaks["global"], "step_added_local_mib": peaks["local"]}
    del nets, data
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _rss_child(model: str, dims: int, shape: tuple[int, ...], batch: int, steps: int) -> float:
    """Peak RSS (MiB) of ``steps`` AdamW steps above the baseline after one step, in a fresh process."""
    code = (
        "import sys, json, torch, torch.nn.functional as F; from pathlib import Path\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from bench.size_cost import _net\n"
        f"net = _net({model!r}, {dims}); opt = torch.optim.AdamW(net.parameters())\n"
        f"x = torch.rand({batch}, 1, *{tuple(shape)!r}); y = torch.zeros({batch}, dtype=torch.long)\n"
        "def step():\n    F.cross_entropy(net(x), y).backward(); opt.step(); opt.zero_grad(set_to_none=True)\n"
        "def kib(f): return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(f + ':'))\n"
        "step(); base = kib('VmRSS'); Path('/proc/self/clear_refs').write_text('5')\n"
        f"for _ in range({steps}): step()\n"
        "print(json.dumps((kib('VmHWM') - base) / 1024))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def row(model: str, dims: int, side: int, grid: tuple[int, ...], overlap: int, batch: int, args) -> dict:
    full = (side,) * dims
    dec = Decomposition(grid, full, (overlap,) * dims)
    sub = tuple(int(n) for n in dec.sub_shape)
    net = _net(model, dims)
    plans = {
        "global": plan_network(net, (1, *full), batch, num_classes=K),
        "local": plan_network(net, (1, *sub), batch, num_classes=K),
    }
    voxels = {"global": torch.Size(full).numel(), "local": torch.Size(sub).numel()}
    out = {
        "spatial_dims": dims,
        "size": side,
        "grid": "x".join(map(str, grid)),
        "n": dec.num_subdomains,
        "overlap": overlap,
        "sub_shape": list(sub),
        "voxel_ratio": voxels["global"] / voxels["local"],
        "flops_global": plans["global"].flops_per_step,
        "flops_local": plans["local"].flops_per_step,
        "flop_ratio": plans["global"].flops_per_step / plans["local"].flops_per_step,
        "saved_global_mib": plans["global"].activation_bytes / MIB,
        "saved_local_mib": plans["local"].activation_bytes / MIB,
        "step_global_mib": plans["global"].peak_bytes / MIB,
        "step_local_mib": plans["local"].peak_bytes / MIB,
        "time_global_s": None,
        "time_local_s": None,
        "time_ratio": None,
    }
    timed = (not args.quick or args.timed) and plans["global"].flops_per_step / 1e9 <= args.max_gflop
    if timed and time.perf_counter() < args.deadline:
        times = _times(model, dims, full, sub, batch, args.repeats, torch.device(args.device))
        out |= {
            "time_global_s": times["global"],
            "time_local_s": times["local"],
            "time_ratio": times["global"] / times["local"],
        }
        if "step_added_global_mib" in times:  # on a GPU: measured, beside the plan's saved-for-backward figures
            out |= {k: times[k] for k in ("step_added_global_mib", "step_added_local_mib")}
    elif timed:
        out["not_timed"] = "over --budget-s"
    if args.rss:
        out["rss_global_mib"] = _rss_child(model, dims, full, batch, 2)
        out["rss_local_mib"] = _rss_child(model, dims, sub, batch, 2)
    return out


def _key(r: dict) -> tuple:
    return (r["spatial_dims"], r["size"], r["grid"], r["overlap"])


def compare(rows: list[dict], other: dict) -> dict:
    """How far each step-time ratio of ``rows`` is from the same row's in ``other`` (an earlier run's JSON): the
    larger over the smaller, less one, per row timed in both, and the largest."""
    theirs = {_key(r): r["time_ratio"] for r in other["rows"] if r["time_ratio"] is not None}
    per_row = [
        {"row": list(_key(r)), "this": r["time_ratio"], "other": theirs[_key(r)],
         "differ": max(r["time_ratio"], theirs[_key(r)]) / min(r["time_ratio"], theirs[_key(r)]) - 1}
        for r in rows
        if r["time_ratio"] is not None and _key(r) in theirs
    ]  # fmt: skip
    worst = max(per_row, key=lambda d: d["differ"], default=None)
    return {
        "other": {k: other.get(k) for k in ("date", "load_before", "load_after", "host_allocator")},
        "rows": per_row,
        "max_differ": worst["differ"] if worst else None,
        "max_row": worst["row"] if worst else None,
    }


def _side(shape: list[int], dims: int) -> str:
    """``[16, 16, 32]`` as ``16²x32``; ``[33, 33]`` as ``33²``."""
    runs: list[list[int]] = []
    for n in shape:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "x".join(f"{n}{'' if k == 1 else '²' if k == 2 else '³'}" for n, k in runs)


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.0f}" if v >= 20 else f"{v:.1f}"


def _row_name(r: dict) -> str:
    return f"{r['size']}{'²' if r['spatial_dims'] == 2 else '³'} {r['grid']}, overlap {r['overlap']}"


def _ratio(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def table(record: dict) -> list[str]:
    """docs/cost.md's table from one run's JSON: a line per (input, grid), its overlaps side by side."""
    groups: dict[tuple, list[dict]] = {}
    for r in record["rows"]:
        groups.setdefault((r["spatial_dims"], r["size"], r["grid"]), []).append(r)
    lines = [
        "| input | grid (N) | overlap | sub-domain | FLOP ratio | saved for backward, global / local (MiB) | "
        "step-time ratio | step-time ratio / N |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (dims, size, grid), rows in sorted(groups.items()):
        rows = sorted(rows, key=lambda r: r["overlap"])
        local = sorted({_num(r["saved_local_mib"]) for r in rows}, key=lambda t: float(t.replace(",", "")))
        timed = [None if r["time_ratio"] is None else f"{r['time_ratio']:.1f}" for r in rows]
        per_n = [None if r["time_ratio"] is None else f"{r['time_ratio'] / r['n']:.2f}" for r in rows]
        if all(t is None for t in timed):
            times = f"not timed ({rows[0]['flops_global'] / 1e9:,.0f} GFLOP a global step) | -"
        else:
            times = " / ".join(t or "-" for t in timed) + " | " + " / ".join(t or "-" for t in per_n)
        lines.append(
            f"| {size}{'²' if dims == 2 else '³'} | {grid} ({rows[0]['n']}) | "
            f"{' / '.join(str(r['overlap']) for r in rows)} | "
            f"{' / '.join(_side(r['sub_shape'], dims) for r in rows)} | "
            f"{' / '.join(_ratio(r['flop_ratio']) for r in rows)} | "
            f"{_num(rows[0]['saved_global_mib'])} / {'-'.join(local)} | {times} |"
        )
    load = lambda v: "-" if v is None else " ".join(f"{x:.2f}" for x in v)  # noqa: E731
    command = " ".join(["python bench/size_cost.py", *record["argv"]])
    lines += [
        "",
        f"Measured {record['date']} by `{command}`: {record['model']}, "
        f"batch {record['batch']}, {record['threads']} thread(s), {record['cpu']} ({record['cpu_capability']}, "
        f"{record['cpu_count']} cores), host allocator {record['host_allocator']}; step time: {record['clock']}, "
        f"the median of {record['repeats']} measurements; load average {load(record['load_before'])} before, "
        f"{load(record['load_after'])} after.",
    ]
    timed = [r for r in record["rows"] if r["time_ratio"] is not None]
    if timed:
        low, high = min(timed, key=lambda r: r["time_ratio"]), max(timed, key=lambda r: r["time_ratio"])
        above = [r for r in timed if r["time_ratio"] > r["n"]]
        best = max(timed, key=lambda r: r["time_ratio"] / r["n"])
        lines.append(
            f"Per device (the N local nets on N devices, against the global CNN on one), a local step costs less in "
            f"every timed row: the global step takes {low['time_ratio']:.1f} ({_row_name(low)}) to "
            f"{high['time_ratio']:.1f} ({_row_name(high)}) times as long. Per step on one device (N local steps in "
            f"sequence against one global step), the step-time ratio passes N in {len(above)} of {len(timed)} timed "
            f"rows{': ' + '; '.join(_row_name(r) for r in above) if above else ''}; its largest ratio / N is "
            f"{best['time_ratio'] / best['n']:.2f} ({_row_name(best)})."
        )
    agree = record.get("agreement")
    if agree and agree["max_differ"] is not None:
        d, s, g, o = agree["max_row"]
        lines.append(
            f"A run before it ({agree['other']['date']}, load {load(agree['other']['load_before'])} before) gave "
            f"every step-time ratio within {100 * agree['max_differ']:.0f}% of these "
            f"(the largest difference: {s}{'²' if d == 2 else '³'} {g}, overlap {o})."
        )
    return lines


BLOCK = _doc.Block("size_cost.py", DOC, RECORD, table, "the table")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few small rows, planned only (seconds)")
    parser.add_argument("--model", default="vgg_small")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-gflop", type=float, default=120.0, help="time only rows whose global step is cheaper")
    parser.add_argument("--rss", action="store_true", help="also the peak RSS of each net in a fresh process")
    parser.add_argument("--timed", action="store_true", help="with --quick: time its rows too")
    parser.add_argument("--dims", type=int, nargs="+", choices=(2, 3), default=(2, 3), help="2D rows, 3D rows or both")
    parser.add_argument("--device", default="cpu", help="where the steps are timed: cpu (CPU time), cuda (device time)")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="time no row that would start past this")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--compare", type=Path, help="an earlier run's JSON: how far this run's step-time ratios are")
    parser.add_argument(
        "--host-memory", choices=("kept", "glibc"), default="kept",
        help="keep freed host memory as training does (default), or measure glibc's allocator as it comes",
    )  # fmt: skip
    BLOCK.add_arguments(parser)
    args = parser.parse_args(argv)
    if BLOCK.handle(args):
        return []
    args.deadline = time.perf_counter() + args.budget_s
    if args.host_memory == "kept":
        keep_freed_host_memory()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _measure(args, argv)
    finally:
        torch.set_num_threads(threads)  # main() also runs inside other processes (the tests, bench/gpu_check.py)


def _measure(args: argparse.Namespace, argv: list[str] | None) -> list[dict]:
    if args.quick:
        cases = QUICK_ROWS
    else:
        cases = [
            (dims, side, grid, overlap)
            for dims in args.dims
            for side in SIZES[dims]
            for grid in GRIDS[dims]
            for overlap in OVERLAPS
        ]
    record = {
        "date": datetime.date.today().isoformat(),
        "argv": _doc.measured_argv(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "batch": args.batch,
        "threads": args.threads,
        "repeats": args.repeats,
        "max_gflop": args.max_gflop,
        "device": args.device,
        "clock": "device time (synchronised wall clock)" if args.device.startswith("cuda") else "process CPU time",
        "host_allocator": host_allocator(),
        "cpu": _doc.cpu_name(),
        "cpu_capability": cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "load_before": load_average(),
    }
    rows = []
    for dims, side, grid, overlap in cases:
        rows.append(row(args.model, dims, side, grid, overlap, args.batch, args))
        print(f"  {side}^{dims} {'x'.join(map(str, grid))} overlap {overlap}", file=sys.stderr, flush=True)
    record |= {"load_after": load_average(), "rows": rows}
    print(
        f"{args.model}, batch {args.batch}, {args.threads} thread(s), host allocator {record['host_allocator']}; "
        f"on {args.device}; step time: {record['clock']}, median of {args.repeats} measurements"
    )
    print(f"{'input':>8}{'grid':>7}{'ov':>3}{'sub':>12}{'voxels':>8}{'GFLOP g':>9}{'GFLOP l':>9}{'FLOP x':>8}"
          f"{'saved g':>10}{'saved l':>9}{'time x':>8}")  # fmt: skip
    for r in rows:
        side = f"{r['size']}^{r['spatial_dims']}"
        timed = "-" if r["time_ratio"] is None else f"{r['time_ratio']:.1f}"
        print(
            f"{side:>8}{r['grid']:>7}{r['overlap']:>3}{'x'.join(map(str, r['sub_shape'])):>12}{r['voxel_ratio']:8.2f}"
            f"{r['flops_global'] / 1e9:9.2f}{r['flops_local'] / 1e9:9.3f}{r['flop_ratio']:8.2f}"
            f"{r['saved_global_mib']:10.1f}{r['saved_local_mib']:9.1f}{timed:>8}"
        )
    print("(saved: MiB autograd keeps for backward, planned; x: global / one local net)")
    if args.compare is not None:
        record["agreement"] = compare(rows, json.loads(args.compare.read_text()))
        worst = record["agreement"]
        if worst["max_differ"] is not None:
            print(f"against {args.compare}: every step-time ratio within {100 * worst['max_differ']:.0f}% "
                  f"(largest at {worst['max_row']})")  # fmt: skip
    print(f"load average {record['load_before']} before, {record['load_after']} after")
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=2))
    return rows


if __name__ == "__main__":
    main()
