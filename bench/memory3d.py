"""Peak memory of training one local net of a 2x2x2 decomposition against the global 3D net.

Same backbone, same batch size, 64^3 volumes (AdrenalMNIST3D 64 when present, else random volumes of the
same shape: activation memory does not depend on the values). Each measurement runs in a fresh process:
the peak resident memory (VmHWM) during a few training steps, above the process's resident memory just
before them (model, optimizer and data already allocated). Prints `memory ratio: <x>` (target <= 0.3).

    python bench/memory3d.py [--batch-size 8] [--model vgg_small] [--overlap 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(which: str, model: str, batch_size: int, overlap: int, steps: int) -> dict:
    from ddcnn.decomposition import Decomposition
    from ddcnn.models import resnet, vgg

    builder = getattr(vgg, model, None) or getattr(resnet, model)
    torch.manual_seed(0)
    archive = SHARED / "adrenalmnist3d_64.npz"
    if archive.is_file():
        with np.load(archive) as z:
            x = torch.from_numpy(z["x_train"][: batch_size * steps].astype(np.float32) / 255.0)[:, None]
            y = torch.from_numpy(z["y_train"][: batch_size * steps].reshape(-1).astype(np.int64))
        source = "AdrenalMNIST3D 64^3"
    else:
        x = torch.rand(batch_size * steps, 1, 64, 64, 64)
        y = torch.randint(0, 2, (batch_size * steps,))
        source = "random 64^3 volumes"
    dec = Decomposition((2, 2, 2), (64, 64, 64), overlap)
    if which == "local":
        x = dec.subdomain(x, 0).contiguous()
    net = builder(spatial_dims=3, in_channels=1, num_classes=2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    # One step first so the optimizer state exists: the baseline then holds weights, grads and Adam moments.
    loss = F.cross_entropy(net(x[:2]), y[:2])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    baseline = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    for s in range(steps):
        xb, yb = x[s * batch_size : (s + 1) * batch_size], y[s * batch_size : (s + 1) * batch_size]
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = _rss_kib("VmHWM")
    return {
        "which": which,
        "input": list(x.shape[1:]),
        "baseline_mib": baseline / 1024,
        "peak_above_baseline_mib": (peak - baseline) / 1024,
        "source": source,
        "params": sum(p.numel() for p in net.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", default="vgg_small")
    parser.add_argument("--overlap", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", choices=["local", "global"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.model, args.batch_size, args.overlap, args.steps)))
        return
    rows = {}
    for which in ("local", "global"):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            which,
            "--batch-size",
            str(args.batch_size),
            "--model",
            args.model,
            "--overlap",
            str(args.overlap),
            "--steps",
            str(args.steps),
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        rows[which] = json.loads(out)
    for which, r in rows.items():
        print(
            f"{which:6s} net on {r['input']}: peak {r['peak_above_baseline_mib']:8.1f} MiB above a baseline of "
            f"{r['baseline_mib']:.0f} MiB ({r['params']} parameters, {r['source']})"
        )
    ratio = rows["local"]["peak_above_baseline_mib"] / rows["global"]["peak_above_baseline_mib"]
    print(f"{args.model}, batch size {args.batch_size}, 2x2x2 decomposition with overlap {args.overlap}")
    print(f"memory ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
