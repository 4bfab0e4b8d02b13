"""Bit-identity of the training loop across a restructure: train the same scenarios at a base commit and at the
working tree, then compare what every training wrote.

Each scenario is one ``ddcnn-train`` command on the built-in digits (tiny nets, a few epochs), so it runs at any
commit whatever the loop's Python API looks like. For every training of a run (``local/NN``, ``coarse``, ``global``
and the optional methods' folders) it compares:

- every tensor of ``last.ckpt`` (weights, optimizer and scheduler state, the best weights, the initial weights),
  exactly (``torch.equal``), and its plain values but the clock (``fit_time_s``);
- ``logs/metrics.csv`` byte for byte, but the training clock's column ``time_s`` (and the curve timings ``*time*``);
- ``results.json`` with every timing removed (keys holding ``time``, ``speedup``, ``_s`` ends, throughput, memory).

The base commit is checked out in a temporary worktree and run with the same interpreter (``PYTHONPATH`` points
there), so both sides use the same torch and libraries.

Usage::

    python tools/bit_identity.py --base c7e6436 [--only NAME ...] [--jobs 1] [--keep DIR]

Prints one line per scenario (``same`` or what differs) and exits 1 when any scenario differs.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMMON = [
    "data=digits",
    "model=vgg_tiny",
    "trainer.max_epochs=3",
    "trainer.enable_progress_bar=false",
    "coarse.max_epochs=3",
    "report.plots=false",
    "report.export=false",
    "store.reuse=false",
    "engine.checkpoint_every_s=0",
]
# name -> the overrides after COMMON. Together they reach every loop setting and every stage that trains with it.
SCENARIOS: dict[str, list[str]] = {
    "default": [],
    "curves": ["report.curves.enabled=true"],
    "patience_plateau": [
        "trainer.max_epochs=8",
        "engine.patience=3",
        "engine.min_epochs=2",
        "scheduler={_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true,factor:0.1,patience:1}",
    ],
    "cosine": ["scheduler={_target_:torch.optim.lr_scheduler.CosineAnnealingLR,_partial_:true,T_max:null}"],
    "monitor_val_loss": ["engine.monitor=val_loss", "engine.monitor_mode=min", "engine.min_delta=0.01"],
    # (trainer.limit_val_batches=0 reaches the coarse DNN too, which selects on validation: refused at any commit)
    "monitor_train_loss": ["engine.monitor=train_loss", "engine.monitor_mode=min"],
    "clip_norm": ["trainer.gradient_clip_val=0.5"],
    "clip_value": ["trainer.gradient_clip_val=0.05", "+trainer.gradient_clip_algorithm=value"],
    "accumulate": ["+trainer.accumulate_grad_batches=3"],
    "limits": ["trainer.limit_train_batches=3", "trainer.limit_val_batches=2"],
    "fraction_limits": ["trainer.limit_train_batches=0.5", "trainer.limit_val_batches=0.5"],
    # (c7e6436 fails a 64-true run at its first curve point: the curve fed float32 images to the float64 net)
    "float64": ["trainer.precision=64-true", "report.curves.enabled=false"],
    "bf16": ["trainer.precision=bf16-mixed"],
    "deterministic": ["trainer.deterministic=true"],
    "sgd": ["optimizer=sgd"],
    "resnet": ["model=resnet_tiny"],
    "grid_4x4": ["decomposition=4x4"],
    "coarse_probs": ["coarse.input=probs"],
    "coarse_steps": ["coarse.max_epochs=auto", "coarse.steps=60", "coarse.linear.enabled=false"],
    # the ensemble's k pinned: k=auto follows the measured times, which the machine's load moves
    "methods_all": ["methods=all", "methods.enabled.global_ddp=false", "methods.global_ensemble.k=2"],
    "val_target": ["data.val_target_fraction=0.2", "report.curves.enabled=true"],
    "log_steps": ["trainer.log_every_n_steps=2", "logger=tensorboard"],
    "ddp_spawned": ["engine.num_devices=2", "methods.enabled.global_ddp=false"],
    # a coarse DNN whose rate diverges: restarts from its initial weights at lower rates (their state in last.ckpt)
    "diverge_restart": ["coarse.optimizer.lr=30", "coarse.linear.enabled=false"],
}
# Timing fields in results.json and meta files: they differ between any two runs.
# ("timing" is results.json's block of the conditions of the times: the code's hash, the machine's load.)
_TIMING = ("time", "speedup", "throughput", "memory", "startup", "warmup", "wall", "_s", "rss", "cpu", "date", "host")
_CONDITIONS = ("timing", "load", "comparable", "code")


def _run(source: Path, scenario: list[str], run_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "import sys; from ddcnn.cli import train_main; sys.argv[0] = 'ddcnn-train'; train_main()"
    cmd = [sys.executable, "-c", code, *COMMON, *scenario, f"hydra.run.dir={run_dir}"]
    return subprocess.run(
        cmd, cwd=run_dir.parent, env={**env, "PYTHONPATH": str(source)}, capture_output=True, text=True, timeout=1800
    )


def _timing_key(key: str) -> bool:
    key = key.lower()
    return any(part in key for part in _TIMING) or key in _CONDITIONS


def _plain(value):
    """``value`` without timing keys (nested)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not _timing_key(str(k))}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def _tensors(value, prefix: str = "") -> tuple[dict, dict]:
    """The tensors of a checkpoint by path, and its other leaves by path (timings dropped)."""
    import torch

    tensors, plain = {}, {}
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            if _timing_key(str(k)):
                continue
            t, p = _tensors(v, f"{prefix}/{k}")
            tensors |= t
            plain |= p
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            t, p = _tensors(v, f"{prefix}/{i}")
            tensors |= t
            plain |= p
    else:
        plain[prefix] = "nan" if isinstance(value, float) and math.isnan(value) else value
    return tensors, plain


def _csv_without_time(path: Path) -> str:
    rows = list(csv.reader(io.StringIO(path.read_text())))
    if not rows:
        return ""
    keep = [i for i, name in enumerate(rows[0]) if not _timing_key(name)]
    return "\n".join(",".join(row[i] for i in keep if i < len(row)) for row in rows)


def compare(base: Path, new: Path) -> list[str]:
    """What differs between two run directories (empty: bit-identical but for the clocks)."""
    import torch

    out = []
    base_ckpts = sorted(p.relative_to(base) for p in base.rglob("last.ckpt"))
    new_ckpts = sorted(p.relative_to(new) for p in new.rglob("last.ckpt"))
    if base_ckpts != new_ckpts:
        out.append(f"trainings differ: {sorted(set(map(str, base_ckpts)) ^ set(map(str, new_ckpts)))}")
    for rel in base_ckpts:
        if not (new / rel).is_file():
            continue
        a = torch.load(base / rel, map_location="cpu", weights_only=False)
        b = torch.load(new / rel, map_location="cpu", weights_only=False)
        ta, pa = _tensors(a)
        tb, pb = _tensors(b)
        if set(ta) != set(tb):
            out.append(f"{rel}: tensor keys differ {sorted(set(ta) ^ set(tb))[:6]}")
        bad = [k for k in set(ta) & set(tb) if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
        if bad:
            out.append(f"{rel}: {len(bad)} tensor(s) differ, e.g. {sorted(bad)[:3]}")
        if pa != pb:
            keys = sorted(k for k in set(pa) | set(pb) if pa.get(k) != pb.get(k))
            out.append(f"{rel}: values differ at {keys[:4]}")
    for path in sorted(base.rglob("metrics.csv")):
        rel = path.relative_to(base)
        other = new / rel
        if not other.is_file():
            out.append(f"{rel}: missing")
        elif _csv_without_time(path) != _csv_without_time(other):
            out.append(f"{rel}: differs")
    a, b = base / "results.json", new / "results.json"
    if not a.is_file() or not b.is_file():
        out.append("results.json missing")
    elif _plain(json.loads(a.read_text())) != _plain(json.loads(b.read_text())):
        out.append("results.json differs (timings removed)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare the working tree against")
    parser.add_argument("--only", nargs="*", help="scenario names (default: all)")
    parser.add_argument("--keep", type=Path, help="keep the run directories here")
    args = parser.parse_args(argv)
    names = args.only or list(SCENARIOS)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    work = Path(args.keep or tempfile.mkdtemp(prefix="bit_identity_"))
    base_src = work / "base_src"
    if not base_src.is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_src), args.base], check=True)
    env = {**os.environ, "DDCNN_STORE": str(work / "store"), "CUDA_VISIBLE_DEVICES": ""}
    failed = 0
    try:
        for name in names:
            began = time.perf_counter()
            dirs = {}
            for side, source in (("base", base_src), ("tree", REPO)):
                run_dir = work / side / name
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                proc = _run(source, SCENARIOS[name], run_dir, env)
                if proc.returncode != 0:
                    print(f"{name}: {side} run failed:\n{proc.stderr[-3000:]}", flush=True)
                    dirs = {}
                    break
                dirs[side] = run_dir
            if not dirs:
                failed += 1
                continue
            diff = compare(dirs["base"], dirs["tree"])
            failed += bool(diff)
            took = time.perf_counter() - began
            print(f"{name}: {'same' if not diff else 'DIFFERS: ' + '; '.join(diff)} ({took:.0f} s)", flush=True)
    finally:
        if args.keep is None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_src)], check=False)
    print(f"{len(names) - failed} of {len(names)} scenarios bit-identical to {args.base}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
