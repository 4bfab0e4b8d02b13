"""The 3D global CNN's tuning budget (``docs/protocol.md`` section 5b, issue #44 item 4).

    DDCNN_DATA=../shared/data python experiments/global_lr_3d.py --out DIR [--checkout PAGE_CHECKOUT]
    python experiments/global_lr_3d.py --out DIR --table          # the table of the finished trainings again
    python experiments/global_lr_3d.py --out DIR --table --save docs/next/global_lr_3d   # what the table is made of

AdrenalMNIST3D's recipe picked its overlap for the CNN-DNN from two candidates by the CNN-DNN's mean validation AUC
over 4 seeds; the global CNN gets a sweep of the same size, its own: learning rates :data:`RATES` (the recipe's first)
over seeds :data:`SEEDS`, each the page's AdrenalMNIST3D command (``experiments/results.py``, taken from the checkout
``--checkout`` whose code trains the page, and its store, so that the recipe's rate is the page's own global CNN
where the settings match) with ``stage=global``. Scored by the validation AUC of the kept epoch
(``global/probs_val.pt``) with the kept validation loss beside it; neither the target split nor the test split is
read. The higher mean AUC wins, a tie keeps the recipe's rate. Writes ``DIR/global_lr_3d.json`` and prints the
table; each training resumes where it stopped (its run directory under ``DIR``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RATES = (0.002, 0.001)  # the recipe's rate first
SEEDS = (0, 1, 2, 3)
DATASET = "adrenal3d"


def page_script(checkout: Path):
    """``experiments/results.py`` of ``checkout``, imported (its ``ROOT`` is that checkout, whose ddcnn it runs)."""
    spec = importlib.util.spec_from_file_location("results_page_of_checkout", checkout / "experiments" / "results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def command(results, seed: int, rate: float, out: Path, page_workdir: Path) -> list[str]:
    """The page's AdrenalMNIST3D command of ``seed`` (its store under ``page_workdir``) training the global CNN only,
    at learning rate ``rate`` (stated only where it is not the recipe's, so that the recipe's is the page's own)."""
    args = results._resolve(results._parser().parse_args(["--datasets", DATASET]))
    (dataset,) = [d for d in results.plan(args) if d.key == DATASET]
    spec = results.RunSpec(dataset, dataset.grids[0], dataset.overlaps[0], seed)
    rate_override = [] if rate == RATES[0] else [f"optimizer.lr={rate}"]
    overrides = [*spec.overrides(page_workdir), "stage=global", *rate_override]
    return [*results._entry("ddcnn-train"), *overrides, f"hydra.run.dir={run_dir(out, rate, seed)}"]


def run_dir(out: Path, rate: float, seed: int) -> Path:
    return out / f"lr{rate:g}_s{seed}"


def score(folder: Path) -> dict:
    """The kept epoch's validation AUC (one-vs-rest for more than 2 classes), loss and accuracy of a finished global
    stage folder."""
    import torch
    from sklearn.metrics import roc_auc_score

    saved = torch.load(folder / "probs_val.pt", weights_only=True)
    probs, labels = saved["probs"].double().numpy(), saved["labels"].numpy()
    auc = roc_auc_score(labels, probs[:, 1]) if probs.shape[1] == 2 else roc_auc_score(labels, probs, multi_class="ovr")
    loss = float(-np.log(np.clip(probs[np.arange(len(labels)), labels], 1e-12, None)).mean())
    meta = json.loads((folder / "meta.json").read_text())
    return {
        "val_auc": float(auc),
        "val_loss": loss,
        "val_acc": float((probs.argmax(1) == labels).mean()),
        "best_epoch": meta.get("best_epoch"),
        "converged": meta.get("converged"),
        "n_val": len(labels),
    }


# What the table reads of a finished training's global stage folder.
SCORED_FILES = ("probs_val.pt", "meta.json")


def finished(out: Path):
    """``(rate, seed, global stage folder)`` of every training of the sweep under ``out`` that holds
    :data:`SCORED_FILES`."""
    for rate in RATES:
        for seed in SEEDS:
            folder = run_dir(out, rate, seed) / "global"
            if all((folder / name).is_file() for name in SCORED_FILES):
                yield rate, seed, folder


def table(out: Path) -> dict:
    """Every finished training's score, the means per rate and the decision of section 5b (``None`` until every
    training of the sweep has finished)."""
    rows = [{"rate": rate, "seed": seed, **score(folder)} for rate, seed, folder in finished(out)]
    means = {}
    for rate in RATES:
        mine = [r for r in rows if r["rate"] == rate]
        if mine:
            means[str(rate)] = {
                "seeds": len(mine),
                **{k: float(np.mean([r[k] for r in mine])) for k in ("val_auc", "val_loss", "val_acc")},
            }
    complete = len(rows) == len(RATES) * len(SEEDS)
    # the higher mean AUC; a tie keeps the recipe's rate (the first)
    winner = max(RATES, key=lambda r: (means[str(r)]["val_auc"], r == RATES[0])) if complete else None
    return {"rows": rows, "means": means, "complete": complete, "winner": winner, "recipe_rate": RATES[0]}


def summary(result: dict) -> str:
    """The sweep's result in one sentence (``docs/protocol.md`` section 5b quotes it; a test compares the two)."""
    means = ", ".join(
        f"{m['val_auc']:.4f} at {float(rate):g} ({m['seeds']} seeds; kept validation loss {m['val_loss']:.4f})"
        for rate, m in result["means"].items()
    )
    if not result["complete"]:
        return f"Mean validation AUC so far: {means}; no decision yet."
    return f"Mean validation AUC: {means}; the higher is {result['winner']:g}: {_consequence(result)}."


def _consequence(result: dict) -> str:
    return "the recipe's rate stands" if result["winner"] == result["recipe_rate"] else "the page retrains"


def save(out: Path, to: Path) -> None:
    """Copy what :func:`table` reads of every finished training (``global/probs_val.pt``, ``global/meta.json``) from
    ``out`` to ``to``, so that the committed copy gives the same table."""
    import shutil

    for rate, seed, folder in finished(out):
        target = run_dir(to, rate, seed) / "global"
        target.mkdir(parents=True, exist_ok=True)
        for name in SCORED_FILES:
            shutil.copy2(folder / name, target / name)


def render(result: dict) -> str:
    lines = ["| rate | seed | val AUC | kept val loss | val acc | kept epoch | converged |", "|---" * 7 + "|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['rate']:g} | {r['seed']} | {r['val_auc']:.4f} | {r['val_loss']:.4f} | {r['val_acc']:.4f} | "
            f"{r['best_epoch']} | {r['converged']} |"
        )
    for rate, m in result["means"].items():
        lines.append(
            f"| {float(rate):g} | mean of {m['seeds']} | {m['val_auc']:.4f} | {m['val_loss']:.4f} | {m['val_acc']:.4f} "
            "| | |"
        )
    if result["complete"]:
        lines.append(
            f"\nWinner (higher mean validation AUC): {result['winner']:g}: {_consequence(result)} "
            "(docs/protocol.md 5b)."
        )
    else:
        lines.append(f"\n{len(result['rows'])} of {len(RATES) * len(SEEDS)} trainings finished: no decision yet.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the sweep's run directories and its JSON")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose code and plan train the page")
    parser.add_argument("--page-workdir", type=Path, help="the page's run directories (default: CHECKOUT/runs/results)")
    parser.add_argument("--table", action="store_true", help="only the table of the finished trainings")
    parser.add_argument("--save", type=Path, help="copy what the table is made of there (its probabilities and meta)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if not args.table:
        results = page_script(args.checkout.resolve())
        page_workdir = (args.page_workdir or args.checkout / "runs" / "results").resolve()
        for rate in RATES:
            for seed in SEEDS:
                if (run_dir(out, rate, seed) / "global" / "done").is_file():
                    continue
                print(f"global_lr_3d: training rate {rate:g}, seed {seed}", flush=True)
                cmd = command(results, seed, rate, out, page_workdir)
                subprocess.run(cmd, cwd=results.ROOT, env=results._env(1), check=True)
    result = table(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "global_lr_3d.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.save:
        save(out, args.save.resolve())
    print(render(result))
    print(summary(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
