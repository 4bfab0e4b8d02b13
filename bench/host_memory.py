"""What glibc's handling of freed memory costs a training step on the CPU, and what keeping it saves.

glibc gives each block above a threshold (128 KiB at first, rising to 32 MiB) its own mapping and returns it to the
OS on ``free``: a training step frees its activations and allocates them again at the next step, and the kernel
faults them in anew, zeroed. :func:`ddcnn.runtime.keep_freed_host_memory` (which :func:`ddcnn.pipeline.train` calls
first) keeps freed memory in the process. For the nets of the results page's recipes (ddcnn's ``vgg_small``, AdamW, one
thread, the recipes' batches and the sub-domains of their grids), each in a fresh process per mode, the modes
alternating, this prints per training step: CPU seconds (user + system) as glibc comes and kept, their ratio, the
kernel's share of the first, page faults, and the peak resident size of each.

    python bench/host_memory.py [--quick] [--repeats 2] [--min-cpu-s 3] [--out host_memory.json]
    python bench/host_memory.py --doc host_memory.json   # docs/cost.md's table from that run (docs/host_memory.json)
    python bench/host_memory.py --check                  # docs/cost.md's table == what docs/host_memory.json gives

CPU time, not wall time: on a loaded machine it moves less (other processes take wall time, not this process's CPU
time), though caches shared with them still move it. ``--quick``: two small rows, one repeat, short measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import _doc  # noqa: E402

DOC, RECORD = ROOT / "docs" / "cost.md", ROOT / "docs" / "host_memory.json"
HEAD = [
    "| net | batch | CPU s/step, glibc | kept | ratio | kernel share, glibc | faults/step, glibc | kept | "
    "peak RSS MiB, glibc | kept |",
    "|---|---|---|---|---|---|---|---|---|---|",
]

# (row, spatial dims, side, batch, width) of the results page's recipes: MNIST (batch 64; 2x2 overlap 0: 14 px),
# AdrenalMNIST3D 28³ (half width, batch 32; 2x2x2 overlap 8: 18³) and 64³ (batch 8; 2x2x2 overlap 2: 34³).
ROWS = [
    ("MNIST global CNN, 28²", 2, 28, 64, 1.0),
    ("MNIST local net 2x2, 14²", 2, 14, 64, 1.0),
    ("AdrenalMNIST3D global CNN, 28³", 3, 28, 32, 0.5),
    ("AdrenalMNIST3D local net 2x2x2/8, 18³", 3, 18, 32, 0.5),
    ("AdrenalMNIST3D 64³ global CNN", 3, 64, 8, 0.5),
    ("AdrenalMNIST3D 64³ local net 2x2x2/2, 34³", 3, 34, 8, 0.5),
]
QUICK = [1, 3]

_CHILD = """
import json, os, resource, sys, time
sys.path.insert(0, {root!r})
from ddcnn.runtime import host_allocator, keep_freed_host_memory
if {keep}:
    keep_freed_host_memory()
import torch
import torch.nn.functional as F
from ddcnn.models.vgg import vgg_small

torch.set_num_threads(1)
torch.manual_seed(0)
dims, side, batch, width, min_cpu_s = {dims}, {side}, {batch}, {width}, {min_cpu_s}
net = vgg_small(spatial_dims=dims, in_channels=1, num_classes=2, width_mult=width).train()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
x, y = torch.randn(batch, 1, *([side] * dims)), torch.randint(2, (batch,))

def step():
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(net(x), y).backward()
    opt.step()

for _ in range(3):  # warm-up: kernels chosen, the heap grown to the step's peak
    step()
use = lambda: resource.getrusage(resource.RUSAGE_SELF)
first, steps = use(), 0
while steps < 3 or (use().ru_utime + use().ru_stime) - (first.ru_utime + first.ru_stime) < min_cpu_s:
    step()
    steps += 1
last = use()
user, system = last.ru_utime - first.ru_utime, last.ru_stime - first.ru_stime
print(json.dumps({{
    "cpu_s": (user + system) / steps, "sys_share": system / (user + system), "steps": steps,
    "faults": (last.ru_minflt - first.ru_minflt) / steps, "peak_rss_mib": last.ru_maxrss / 1024,
    "allocator": host_allocator(),
}}))
"""


def _measure(row: tuple, keep: bool, min_cpu_s: float) -> dict:
    _, dims, side, batch, width = row
    code = _CHILD.format(root=str(ROOT), keep=keep, dims=dims, side=side, batch=batch, width=width, min_cpu_s=min_cpu_s)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "DDCNN_HOST_MEMORY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"host_memory.py: the measuring process failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _line(r: dict) -> str:
    g, k = r["glibc"], r["kept"]
    return (
        f"| {r['net']} | {r['batch']} | {g['cpu_s']:.3f} | {k['cpu_s']:.3f} | {r['ratio']:.2f} | "
        f"{100 * g['sys_share']:.0f}% | {g['faults']:,.0f} | {k['faults']:,.0f} | {g['peak_rss_mib']:,.0f} | "
        f"{k['peak_rss_mib']:,.0f} |"
    )


def table(rows: list[dict]) -> list[str]:
    """docs/cost.md's table from one run's rows, and the global CNN's step-time ratio to its local net in each mode."""
    lines = [*HEAD, *(_line(r) for r in rows)]
    by_net = {r["net"]: r for r in rows}
    pairs = [
        (label, by_net[g], by_net[loc])
        for label, g, loc in (
            ("MNIST", ROWS[0][0], ROWS[1][0]),
            ("AdrenalMNIST3D 28³", ROWS[2][0], ROWS[3][0]),
            ("64³", ROWS[4][0], ROWS[5][0]),
        )
        if g in by_net and loc in by_net
    ]
    if pairs:
        ratios = "; ".join(
            f"{label} {g['glibc']['cpu_s'] / loc['glibc']['cpu_s']:.1f} as glibc comes, "
            f"{g['kept']['cpu_s'] / loc['kept']['cpu_s']:.1f} kept"
            for label, g, loc in pairs
        )
        lines += ["", f"The global CNN's step time over its local net's: {ratios}."]
    return lines


BLOCK = _doc.Block("host_memory.py", DOC, RECORD, table, "the allocator's table")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small rows, one repeat, short measurements")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per row and mode (median)")
    parser.add_argument("--min-cpu-s", type=float, default=3.0, help="CPU seconds each measurement runs at least")
    parser.add_argument("--out", help="write the rows as JSON here")
    BLOCK.add_arguments(parser)
    args = parser.parse_args(argv)
    if BLOCK.handle(args):
        return {}
    rows = [ROWS[i] for i in QUICK] if args.quick else ROWS
    repeats, min_cpu_s = (1, 0.3) if args.quick else (args.repeats, args.min_cpu_s)
    if _measure(rows[0], True, 0.0)["allocator"] != "glibc, freed memory kept":
        raise SystemExit("host_memory.py: this C library is not glibc: ddcnn leaves its allocator as it is")
    print("\n".join(HEAD))
    results = []
    for row in rows:
        runs = {"glibc": [], "kept": []}
        for _ in range(repeats):  # alternating: a drift of the machine falls on both modes alike
            runs["glibc"].append(_measure(row, False, min_cpu_s))
            runs["kept"].append(_measure(row, True, min_cpu_s))
        med = {
            m: {k: statistics.median(r[k] for r in rs) for k in ("cpu_s", "sys_share", "faults", "peak_rss_mib")}
            for m, rs in runs.items()
        }
        ratio = med["glibc"]["cpu_s"] / med["kept"]["cpu_s"]
        result = {"net": row[0], "batch": row[3], "glibc": med["glibc"], "kept": med["kept"], "ratio": ratio}
        print(_line(result), flush=True)
        results.append(result | {"runs": runs})
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return {"rows": results}


if __name__ == "__main__":
    main()
