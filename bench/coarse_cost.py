"""The coarse stage's cost as the data grow (issue #47 item 4): the coarse fit against the slowest local net.

    python bench/coarse_cost.py RUN_DIR [RUN_DIR ...] [--sizes 1000,2500,5000,10000] [--repeats 2] [--json OUT]

For each finished run directory (its local nets done; ``ddcnn-train`` or ``experiments/results.py`` runs), the
coarse DNN is fit exactly as its coarse stage fits it (:func:`ddcnn.stages.coarse.fit_coarse`: the run's recorded
``coarse`` and loop settings, its ``coarse.input``, ``coarse.num_threads`` threads) on the first ``n`` rows of a
fixed random order of its training split, for each size ``n`` up to the split's own, and on the whole split. It
prints per size the fit's training clock (median of ``--repeats``), what the fit kept and its validation accuracy,
and the fit's share of the slowest local net's training at that size. The local net's time at ``n`` rows is the run's
recorded ``fit_time_s`` scaled by ``n / n_train``: at a fixed number of epochs a local net's work is linear in its
rows (the run's own early stopping decided those epochs). Then the fit's growth: the exponent ``b`` of
``time = a n^b`` by least squares on the logs, and the share projected to 60,000 rows from it.

The coarse fit's rows per step grow with the data (``coarse.batch_size: auto``: ``n / 40`` within [32, 1024]) for a
fixed ``coarse.steps``, and its convex path solves on at most ``coarse.linear.max_rows`` rows: its time grows more
slowly than the local nets', whose epochs cover every row. Times depend on the machine's load: run it alone; the
shares are ratios of times measured in different processes (the run's local nets, this fit) and say so.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ddcnn import registry  # noqa: E402
from ddcnn.context import build_coarse_net, coarse_net_spec, subdomain_seed  # noqa: E402
from ddcnn.engine.optim import torch_threads  # noqa: E402
from ddcnn.rundir import RunDir  # noqa: E402
from ddcnn.settings.run import RunSettings  # noqa: E402
from ddcnn.stages.coarse import coarse_plan, fit_coarse  # noqa: E402

PROJECT_TO = 60_000  # the largest training set of issue #47's range (MNIST, Fashion-MNIST)
TARGET_SHARE = 0.10


def _settings(run_dir: Path) -> RunSettings:
    from omegaconf import OmegaConf

    return RunSettings.from_config(OmegaConf.load(run_dir / "config.yaml"))


def _local_times(run: RunDir) -> list[float]:
    times, i = [], 0
    while run.is_done("local", i):
        times.append(float(run.meta("local", i)["fit_time_s"]))
        i += 1
    if not times:
        raise SystemExit(f"coarse_cost.py: {run.root} has no finished local net (run its stage=local first)")
    return times


def measure(run_dir: Path, sizes: list[int], repeats: int, seed: int = 0) -> dict:
    """The coarse fit's time, kept candidate and validation accuracy per training size of one run directory: each fit
    from the coarse stage's own seed (so at the run's size it is the stage's fit); ``seed`` draws the subsets."""
    run = RunDir(run_dir)
    settings = _settings(run_dir)
    fit_seed = subdomain_seed(settings.seed, registry.get("coarse").seed_offset)  # ddcnn.stages.common.stage_seed
    coarse = settings.coarse
    local = _local_times(run)
    n_nets = len(local)
    kind = str(coarse.input)
    x, y = {}, {}
    for split in ("train", "val"):
        x[split], y[split] = run.local_outputs(n_nets, split, kind)
    n_run = len(y["train"])
    order = torch.randperm(n_run, generator=torch.Generator().manual_seed(seed))
    rows = []
    for n in sorted({s for s in sizes if s < n_run} | {n_run}):
        pick = order[:n] if n < n_run else torch.arange(n_run)  # the whole split in its own order: the stage's fit
        fit_x, fit_y = {"train": x["train"][pick], "val": x["val"]}, {"train": y["train"][pick], "val": y["val"]}
        times, walls = [], []
        for _ in range(repeats):
            torch.manual_seed(fit_seed)
            net = build_coarse_net(coarse, n_nets, x["train"].shape[-1], spec=coarse_net_spec(coarse, kind))
            with tempfile.TemporaryDirectory() as folder, torch_threads(coarse.num_threads):
                start = time.perf_counter()
                fitted = fit_coarse(net, fit_x, fit_y, folder, coarse, seed=fit_seed, loop=settings.loop)
                walls.append(time.perf_counter() - start)
            times.append(float(fitted.result.fit_time_s))
        fit_s = statistics.median(times)
        local_s = max(local) * n / n_run
        val = fitted.report.get("validation", {}).get(fitted.kept, {})
        rows.append(
            {
                "n_train": n,
                "fit_s": fit_s,
                "wall_s": statistics.median(walls),
                "linear_s": (fitted.report.get("linear") or {}).get("time_s"),
                "plan": coarse_plan(n, coarse),
                "kept": fitted.kept,
                "val_acc": val.get("acc"),
                "slowest_local_s": local_s,
                "share": fit_s / local_s,
            }
        )
        print(
            f"  n={n:>6}: coarse fit {fit_s:6.2f} s (linear path {rows[-1]['linear_s'] or 0:5.2f} s, "
            f"batch {rows[-1]['plan']['batch_size']}), kept {fitted.kept}, val acc {val.get('acc', float('nan')):.4f}; "
            f"slowest local net {local_s:7.1f} s: {100 * rows[-1]['share']:.1f}%",
            flush=True,
        )
    logs = [(math.log(r["n_train"]), math.log(r["fit_s"])) for r in rows if r["fit_s"] > 0]
    slope = None
    if len(logs) >= 2:
        mx, my = statistics.fmean(a for a, _ in logs), statistics.fmean(b for _, b in logs)
        slope = sum((a - mx) * (b - my) for a, b in logs) / sum((a - mx) ** 2 for a, _ in logs)
    last = rows[-1]
    projected = None
    if slope is not None:
        fit_60k = last["fit_s"] * (PROJECT_TO / last["n_train"]) ** slope
        projected = {"fit_s": fit_60k, "share": fit_60k / (max(local) * PROJECT_TO / n_run)}
    return {
        "run": str(run_dir),
        "data": settings.data.name,
        "grid": "x".join(str(g) for g in settings.decomposition.grid),
        "coarse_input": kind,
        "local_fit_s": local,
        "n_train": n_run,
        "local_epochs": [int(run.meta("local", i).get("convergence", {}).get("epochs") or 0) for i in range(n_nets)],
        "rows": rows,
        "exponent": slope,
        "projected_60k": projected,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished run directories (their local nets done)")
    parser.add_argument("--sizes", default="1000,2500,5000,10000", help="training rows to fit on (and the whole)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    out, worst = [], 0.0
    for run_dir in args.runs:
        print(f"coarse_cost.py: {run_dir}", flush=True)
        result = measure(run_dir, sizes, args.repeats)
        out.append(result)
        worst = max(worst, result["rows"][-1]["share"])
        p = result["projected_60k"]
        epochs = result["local_epochs"]
        print(
            f"  local nets: {min(epochs)}-{max(epochs)} epochs on {result['n_train']} rows; the fit grows as "
            f"n^{result['exponent']:.2f}"
            + (f"; projected to {PROJECT_TO:,} rows: {p['fit_s']:.1f} s, {100 * p['share']:.1f}%" if p else "")
        )
    print(
        f"coarse_cost.py: the coarse fit's largest share of the slowest local net at a run's own size: "
        f"{100 * worst:.1f}% (target <= {100 * TARGET_SHARE:.0f}%): {'met' if worst <= TARGET_SHARE else 'NOT met'}"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
