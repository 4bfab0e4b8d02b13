"""The cost curve by image size: the global CNN against one local net of the decomposition (issue #47, item 3).

For 2D images of 64² to 512² and 3D volumes of 32³ to 128³, grids 2x2 / 4x4 (2x2x2 / 4x4x2), overlap 0 and 2, one
row per (size, grid, overlap): the FLOPs of a training step of each net and their ratio, the memory the plan gives
each (:func:`ddcnn.models.memory.plan_network`: saved for backward; and the whole step), and, where the global step
is cheap enough (``--max-gflop``), the per-step time of each measured in this process (median of ``--repeats``
measurements, alternating global and local, each of as many steps as take :data:`MIN_MEASURE_S`) and its ratio.
``--rss`` adds what ``bench/memory3d.py`` measured (now gone into this script): the peak host RSS of a few training
steps above the process's baseline, each net in a fresh process.

    python bench/size_cost.py [--quick] [--model vgg_small] [--batch 2] [--threads 1] [--out size_cost.json]

``--quick`` plans a few small rows and times none (seconds; the test runs it). FLOPs and memory come from meta tensors,
so every row is planned whatever its size; times are wall clock on a machine that may be loaded (say so with them).
The ratios of one process are comparable; absolute times are not.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddcnn.decomposition import Decomposition  # noqa: E402
from ddcnn.models import resnet, vgg  # noqa: E402
from ddcnn.models.memory import MIB, plan_network  # noqa: E402

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
    """Seconds per training step of ``net`` (forward, loss, backward), the mean of ``count`` steps in a row."""
    began = time.perf_counter()
    for _ in range(count):
        F.cross_entropy(net(x), y).backward()
        net.zero_grad(set_to_none=True)
    return (time.perf_counter() - began) / count


def _times(model: str, dims: int, full: tuple[int, ...], sub: tuple[int, ...], batch: int, repeats: int) -> dict:
    nets = {"global": _net(model, dims).train(), "local": _net(model, dims).train()}
    gen = torch.Generator().manual_seed(0)
    data = {
        "global": (torch.randn(batch, 1, *full, generator=gen), torch.randint(K, (batch,), generator=gen)),
        "local": (torch.randn(batch, 1, *sub, generator=gen), torch.randint(K, (batch,), generator=gen)),
    }
    counts = {}
    for role in nets:  # first use of each shape's kernels, then how many steps make one measurement
        _step_s(nets[role], *data[role])
        counts[role] = max(1, math.ceil(MIN_MEASURE_S / max(_step_s(nets[role], *data[role]), 1e-6)))
    times = {"global": [], "local": []}
    for _ in range(repeats):
        for role in nets:
            times[role].append(_step_s(nets[role], *data[role], counts[role]))
    return {role: statistics.median(values) for role, values in times.items()}


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
    if not args.quick and plans["global"].flops_per_step / 1e9 <= args.max_gflop:
        times = _times(model, dims, full, sub, batch, args.repeats)
        out |= {
            "time_global_s": times["global"],
            "time_local_s": times["local"],
            "time_ratio": times["global"] / times["local"],
        }
    if args.rss:
        out["rss_global_mib"] = _rss_child(model, dims, full, batch, 2)
        out["rss_local_mib"] = _rss_child(model, dims, sub, batch, 2)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few small rows, planned only (seconds)")
    parser.add_argument("--model", default="vgg_small")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-gflop", type=float, default=120.0, help="time only rows whose global step is cheaper")
    parser.add_argument("--rss", action="store_true", help="also the peak RSS of each net in a fresh process")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        cases = QUICK_ROWS
    else:
        cases = [
            (dims, side, grid, overlap)
            for dims in (2, 3)
            for side in SIZES[dims]
            for grid in GRIDS[dims]
            for overlap in OVERLAPS
        ]
    rows = [row(args.model, dims, side, grid, overlap, args.batch, args) for dims, side, grid, overlap in cases]
    print(f"{args.model}, batch {args.batch}, {args.threads} thread(s); step time: median of {args.repeats} steps")
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
    if args.out is not None:
        args.out.write_text(json.dumps({"model": args.model, "batch": args.batch, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
