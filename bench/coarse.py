"""The coarse DNN's targets (issue 20), seed-averaged: every combiner of the local nets against the convex stacker.

For each row and seed one ``ddcnn-train`` process trains the local nets, the global CNN and the combiners (the
CNN-DNN on probabilities and on logits, the convex stacker, the coarse DNN fit on validation outputs and, with
``--oof-folds``, on out-of-fold outputs) into a run directory; the paper's plain MLP with ddcnn's former recipe (8
epochs of batch 1024 at lr 2e-2, unscaled inputs) is then fit on the same saved local outputs, in this process. Per
row it prints test accuracy and test NLL (mean ± std over seeds) of every method, and checks the targets:

- the CNN-DNN (on probabilities, the paper's and the bench's main coarse DNN, and on logits, ddcnn's default) >= the
  mean-probability combiner, and >= the convex stacker (on probabilities) - 0.5 points (means over seeds);
- their distance to the global CNN;
- the time to the fixed target of ``docs/protocol.md`` (set by the global CNN, never by the CNN-DNN's selection):
  global CNN time / CNN-DNN time on the seeds where both reached it, and how many did.

A last section fits the coarse DNN on synthetic local outputs of the test grid (10^2 to 10^5 rows, 2 to 100 classes,
probabilities and logits) and reports any cell at chance, with the coarse DNN's and the stacker's time on the largest.
AdrenalMNIST3D (``adrenal28``) prints AUC beside MedMNIST v2's published 3D baselines (ResNet-18 3D 0.827,
ResNet-50 3D 0.828).

    python bench/coarse.py                                  # digits, MNIST 2x2 / 4x4, Fashion-MNIST 2x2; 5 seeds
    python bench/coarse.py --rows digits --seeds 5 --keep /tmp/coarse_runs
    python bench/coarse.py --rows mnist_2x2 --oof-folds 3   # with the cross-fitted coarse DNN (3 more nets/sub-domain)
    python bench/coarse.py --rows adrenal28 --seeds 5 --no-grid
    python bench/coarse.py --rows mnist_fashion20 --no-grid  # 400 images, 20 classes (an image folder it builds)

Accuracy does not depend on the machine's load; the times do (run quiet for them). Reuses finished run directories
under ``--keep`` (a rerun only fills in what is missing).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, TRAIN, quiet, train_env
from _common import ROWS as SHARED_ROWS

sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROWS = {
    **SHARED_ROWS,
    "fmnist_2x2": ["data=fashion_mnist", "data.train_subset=10000", "trainer.max_epochs=2"],
    "adrenal28": ["experiment=adrenal3d"],
    # a few hundred images of tens of classes (the faces recipe, docs/protocol.md section 6): an image folder of 20
    # classes, 20 images each, built from MNIST (d0..d9) and Fashion-MNIST (f0..f9) by _mnist_fashion20
    "mnist_fashion20": [
        "experiment=faces",
        "methods=default",
        "data.name=mnist_fashion20",
        "data.num_classes=auto",
        "data.image_size=[28,28]",
    ],
}
FOLDER_ROWS = {"mnist_fashion20"}
# The paper's probabilities are the bench's main coarse input, stated (ddcnn's default, decided by the results page,
# docs/protocol.md section 6, was logits from 2026-12-04 to 2026-12-07): its columns and the convex stacker (which takes
# coarse.input) stay those measured before, and the logits column is the coarse_alt stage.
COMMON = ["trainer.enable_progress_bar=false", "report.plots=false", "report.export=false", "coarse.input=probs"]
# Columns: results.json method key -> label.
METHOD_LABELS = {
    "cnn_dnn_probs": "CNN-DNN (probs, the paper's)",
    "cnn_dnn_logits": "CNN-DNN (logits, the default)",
    "cnn_dnn_val": "CNN-DNN fit on val",
    "cnn_dnn_oof": "CNN-DNN fit out-of-fold",
    "paper_mlp": "paper MLP, former recipe",
    "stacker": "convex stacker",
    "mean_prob": "mean probability",
    "majority_vote": "majority vote",
    "global": "global CNN",
}
FORMER = [
    "coarse.net.skip=none",
    "coarse.net.input_norm=none",
    "coarse.net.linear=false",
    "coarse.linear.enabled=false",
    "coarse.optimizer.lr=0.02",
    "coarse.max_epochs=8",
    "coarse.batch_size=1024",
    "coarse.patience=null",
    "coarse.scheduler=null",
    "coarse.divergence_restarts=0",
]
MEDMNIST_3D_AUC = {"ResNet-18 (3D)": 0.827, "ResNet-50 (3D)": 0.828}


def _mnist_fashion20(root: Path, per_class: int = 20) -> Path:
    """The image folder of row ``mnist_fashion20`` under ``root`` (built once): ``<class>/<n>.png``, 28x28 grey, the
    first ``per_class`` training images of each class of MNIST (d0..d9) and Fashion-MNIST (f0..f9) in a permutation
    drawn with seed 0."""
    import numpy as np
    from PIL import Image

    folder, done = root / "mnist_fashion20_images", root / "mnist_fashion20_images.done"
    if done.is_file():
        return folder
    for name, prefix in (("mnist.npz", "d"), ("fashion_mnist.npz", "f")):
        with np.load(Path(os.environ["DDCNN_DATA"]) / name) as arrays:
            x, y = arrays["x_train"], arrays["y_train"]
        order = np.random.default_rng(0).permutation(len(y))
        for c in range(10):
            (folder / f"{prefix}{c}").mkdir(parents=True, exist_ok=True)
            for n, i in enumerate(order[y[order] == c][:per_class]):
                Image.fromarray(x[i], mode="L").save(folder / f"{prefix}{c}" / f"{n}.png")
    done.touch()
    return folder


def _row(row: str, keep: Path) -> list[str]:
    """The overrides of ``row``; an image-folder row's folder is built under ``keep`` and named by ``data.root``."""
    return [*ROWS[row], f"data.root={_mnist_fashion20(keep)}"] if row in FOLDER_ROWS else ROWS[row]


def run_row(row: str, seed: int, run_dir: Path, oof_folds: int, extra: list[str]) -> dict:
    """One ``ddcnn-train`` run (skipped when ``run_dir`` already holds its results); its ``results.json``."""
    results = run_dir / "results.json"
    methods = ["methods.enabled.coarse_val=true", "methods.enabled.stacker=true"]
    if oof_folds:
        methods += ["methods.enabled.coarse_oof=true", f"methods.local_oof.folds={oof_folds}"]
    if not results.is_file() or (oof_folds and not (run_dir / "coarse_oof" / "done").is_file()):
        stage = [] if not results.is_file() else ["stage=all"]
        cmd = [*TRAIN, *_row(row, run_dir.parent), *COMMON, *methods, *extra, *stage]
        cmd += [f"seed={seed}", f"hydra.run.dir={run_dir}"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{row} seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        logging.info("%s seed %d: %.0f s", row, seed, time.perf_counter() - start)
    return json.loads(results.read_text())


def _nll(run_dir: Path, stage: str) -> float | None:
    path = run_dir / stage / "probs_test.pt"
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    return float(F.nll_loss(saved["probs"].clamp_min(1e-12).log(), saved["labels"]))


def _former_recipe(run_dir: Path, row: str, seed: int, extra: list[str]) -> tuple[float, float]:
    """The paper's plain MLP with ddcnn's former coarse recipe, fit now on the run's saved local outputs."""
    from _common import config

    from ddcnn.context import build_coarse_net, build_context
    from ddcnn.stages.coarse import coarse_inputs, fit_coarse

    cfg = config([*_row(row, run_dir.parent), *COMMON, *extra, *FORMER, f"seed={seed}"], run_dir)
    ctx = build_context(cfg, run_dir, claim=False)
    x, y = coarse_inputs(ctx, "probs")
    torch.manual_seed(seed)
    coarse = ctx.settings.coarse
    net = build_coarse_net(coarse, ctx.decomposition.num_subdomains, ctx.data.num_classes, kind="probs")
    with tempfile.TemporaryDirectory() as folder:
        fitted = fit_coarse(net, x, y, folder, coarse, seed=seed)
    with torch.no_grad():
        logits = fitted.net.eval()(x["test"])
    return float((logits.argmax(-1) == y["test"]).float().mean()), float(F.cross_entropy(logits, y["test"]))


def _mean_std(values: list[float]) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.4f} ± {std:.4f}"


def report_row(row: str, seeds: list[int], keep: Path, oof_folds: int, extra: list[str]) -> dict:
    acc: dict[str, list[float]] = {k: [] for k in METHOD_LABELS}
    nll: dict[str, list[float]] = {k: [] for k in METHOD_LABELS}
    auc: dict[str, list[float]] = {k: [] for k in METHOD_LABELS}
    equal, coarse_s, flags, local_unconverged = [], [], [], []
    stages = {"cnn_dnn_probs": "coarse", "cnn_dnn_logits": "coarse_alt", "cnn_dnn_val": "coarse_val"}
    stages |= {"cnn_dnn_oof": "coarse_oof", "stacker": "stacker", "global": "global"}
    for seed in seeds:
        run_dir = keep / f"{row}_s{seed}"
        results = run_row(row, seed, run_dir, oof_folds, extra)
        for key in METHOD_LABELS:
            metrics = (results.get("metrics") or {}).get(key)
            if metrics:
                acc[key].append(metrics["accuracy"])
                auc[key].append(metrics.get("auc"))
            if key in stages:
                nll[key].append(_nll(run_dir, stages[key]))
        former = _former_recipe(run_dir, row, seed, extra)
        acc["paper_mlp"].append(former[0])
        nll["paper_mlp"].append(former[1])
        e = results.get("time_to_target")
        if e:
            equal.append(e)
        coarse_s.append(results["time_s"].get("coarse"))
        flags += [f"seed {seed}: {f['message']}" for f in results.get("flags") or []]
        if any(net.get("converged") is False for net in (results.get("convergence") or {}).get("local") or []):
            local_unconverged.append(seed)
    crossfit = f" with {oof_folds}-fold cross-fitting" if oof_folds else ""
    print(f"\n## {row} ({len(seeds)} seeds: {seeds}){crossfit}")
    print("| method | test accuracy | test NLL | AUC |")
    print("|---|---|---|---|")
    for key, label in METHOD_LABELS.items():
        if acc[key]:
            print(f"| {label} | {_mean_std(acc[key])} | {_mean_std(nll[key])} | {_mean_std(auc[key])} |")
    mean = statistics.fmean
    stacker, averaging = mean(acc["stacker"]), mean(acc["mean_prob"])
    ok_mean = ok_stacker = True
    for key, name in (("cnn_dnn_probs", "on probabilities"), ("cnn_dnn_logits", "on logits (the default)")):
        coarse = mean(acc[key])
        ok_mean, ok_stacker = ok_mean and coarse >= averaging, ok_stacker and coarse >= stacker - 0.005
        print(
            f"- CNN-DNN {name} {coarse:.4f} vs mean probability {averaging:.4f}: "
            f"{'PASS' if coarse >= averaging else 'FAIL'}; vs convex stacker {stacker:.4f} - 0.5 points: "
            f"{'PASS' if coarse >= stacker - 0.005 else 'FAIL'}"
            + (f"; to the global CNN: {100 * (coarse - mean(acc['global'])):+.2f} points" if acc["global"] else "")
        )
    if len(acc["cnn_dnn_logits"]) == len(acc["cnn_dnn_probs"]) > 0:
        from ddcnn.report.stats import paired_difference

        diffs = [100 * (a - b) for a, b in zip(acc["cnn_dnn_logits"], acc["cnn_dnn_probs"], strict=True)]
        # both inputs come from the same local nets: the verdict is withheld where any seed's did not converge
        stats = paired_difference(diffs, not local_unconverged)
        interval = "" if stats["low"] is None else f" [{stats['low']:+.2f}, {stats['high']:+.2f}]"
        print(
            f"- coarse DNN on logits − on probabilities, paired by seed: {stats['mean']:+.2f}{interval} points, "
            f"{stats['verdict']} (per seed: {[round(d, 2) for d in diffs]}"
            + (f"; local nets not converged in seeds {local_unconverged}" if local_unconverged else "")
            + ")"
        )
    if acc["cnn_dnn_oof"]:
        diff = [a - b for a, b in zip(acc["cnn_dnn_oof"], acc["cnn_dnn_probs"], strict=False)]
        per_seed = [round(100 * d, 2) for d in diff]
        print(f"- out-of-fold minus in-sample fit: {100 * mean(diff):+.2f} points (per seed: {per_seed})")
    if equal:
        both = [e for e in equal if e["global"]["reached"] and e["cnn_dnn"]["reached"]]
        ratios = [e["global"]["time_s"] / e["cnn_dnn"]["time_s"] for e in both if e["cnn_dnn"]["time_s"]]
        text = f"{mean(ratios):.2f}x over {len(ratios)} seeds" if ratios else "no seed where both reached it"
        missed = [f"{e['cnn_dnn']['why_not']}" for e in equal if not e["cnn_dnn"]["reached"]]
        counts = f"CNN-DNN reached it on {len(equal) - len(missed)}/{len(equal)} seeds" + (
            f" (not: {', '.join(missed)})" if missed else ""
        )
        print(
            f"- time to the fixed target (set by the global CNN, docs/protocol.md), global CNN / CNN-DNN on N "
            f"devices: {text}; {counts}"
        )
    print(f"- coarse stage time: {_mean_std(coarse_s)} s")
    if row == "adrenal28" and auc["cnn_dnn_probs"]:
        published = ", ".join(f"{k} {v:.3f}" for k, v in MEDMNIST_3D_AUC.items())
        print(f"- AUC beside MedMNIST v2's published 3D baselines ({published}): see the AUC column")
    for flag in flags:
        print(f"- flagged: {flag}")
    return {"row": row, "ok": ok_mean and ok_stacker}


def grid_section() -> None:
    """The coarse DNN on synthetic local outputs of every size and class count: none at chance; its cost."""
    from ddcnn.config import compose
    from ddcnn.context import build_coarse_net
    from ddcnn.data.synthetic import synthetic_local_outputs
    from ddcnn.metrics import majority_rate, near_chance
    from ddcnn.settings import RunSettings
    from ddcnn.stages.coarse import fit_coarse

    torch.set_num_threads(1)
    coarse = RunSettings.from_config(compose([])).coarse
    print("\n## synthetic grid: N=4 local nets (N=16 for 10^5 rows), probabilities and logits")
    print("| rows | classes | input | majority rate | mean prob | CNN-DNN | fit (s) | at chance |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (100, 1000, 10_000, 100_000):
        for k in (2, 10, 40, 100):
            if n == 100_000 and k > 10:
                continue
            subdomains = 16 if n == 100_000 else 4
            for kind in ("probs", "logits"):
                x, y = synthetic_local_outputs(n, subdomains, k, seed=n + k)
                if kind == "probs":
                    x = {s: v.softmax(-1) for s, v in x.items()}
                torch.manual_seed(0)
                net = build_coarse_net(coarse, subdomains, k, kind=kind)
                start = time.perf_counter()
                with tempfile.TemporaryDirectory() as folder:
                    fitted = fit_coarse(net, x, y, folder, coarse, seed=0)
                seconds = time.perf_counter() - start
                with torch.no_grad():
                    acc = float((fitted.net.eval()(x["test"]).argmax(-1) == y["test"]).float().mean())
                probs = x["test"].softmax(-1) if kind == "logits" else x["test"]
                averaging = float((probs.mean(1).argmax(-1) == y["test"]).float().mean())
                rate = majority_rate(y["train"], y["test"])
                chance = near_chance(acc, rate, len(y["test"]))
                print(
                    f"| {n} | {k} | {kind} | {rate:.3f} | {averaging:.3f} | {acc:.3f} | {seconds:.1f} | "
                    f"{'**yes**' if chance else 'no'} |"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="digits,mnist_2x2,mnist_4x4,fmnist_2x2", help=f"of {list(ROWS)}")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--oof-folds", type=int, default=0, help="k of the cross-fitted coarse DNN (0: off)")
    parser.add_argument("--keep", type=Path, default=None, help="run directories here (reused); default: temporary")
    parser.add_argument("--no-grid", action="store_true", help="skip the synthetic grid")
    parser.add_argument("--override", action="append", default=[], help="extra ddcnn-train override (repeatable)")
    args = parser.parse_args()
    quiet()
    keep = args.keep or Path(tempfile.mkdtemp(prefix="ddcnn_coarse_bench_"))
    print(f"# bench/coarse.py: {time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.1f}, runs in {keep}")
    outcome = [
        report_row(r, list(range(args.seeds)), keep, args.oof_folds, args.override) for r in args.rows.split(",") if r
    ]
    if not args.no_grid:
        grid_section()
    print("\n" + ", ".join(f"{o['row']}: {'PASS' if o['ok'] else 'FAIL'}" for o in outcome))


if __name__ == "__main__":
    main()
