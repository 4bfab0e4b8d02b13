"""Re-judge every training of the committed results page (``docs/results/runs``) with the current convergence test
(:func:`ddcnn.engine.convergence.convergence`) from its recorded history (``logs/metrics.csv``), ``meta.json`` and the
run's ``config.yaml``, and count the trainings whose verdict changes (issue #44, item 4).

Usage: ``python experiments/rescan_convergence.py [RUNS_DIR] [--list]``. Reads only; writes nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from ddcnn.engine.convergence import convergence
from ddcnn.settings.loop import scheduler_spec

RUNS = Path(__file__).resolve().parents[1] / "docs" / "results" / "runs"


def _number(value: str) -> float | None:
    return float(value) if value not in ("", None) else None


def _history(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [{key: _number(value) for key, value in row.items()} for row in csv.DictReader(f)]


def _settings(config: dict, stage: str) -> dict[str, Any]:
    """The rule's inputs a training of ``stage`` ran under: the coarse DNN's own (``coarse.*``), else the run's."""
    if stage.startswith("coarse"):
        coarse = config.get("coarse") or {}
        monitor = coarse.get("monitor", "val_acc")
        mode = "max" if monitor == "val_acc" else "min"
        return {"monitor": monitor, "monitor_mode": mode, "patience": coarse.get("patience"), "plateau": False}
    engine, scheduler = config.get("engine") or {}, scheduler_spec(config.get("scheduler")) or {}
    plateau = str(scheduler.get("_target_", "")).endswith("ReduceLROnPlateau")
    return {
        "monitor": engine.get("monitor", "val_acc"),
        "monitor_mode": engine.get("monitor_mode", "max"),
        "patience": engine.get("patience"),
        "plateau": plateau,
    }


def rescan(runs: Path) -> list[dict[str, Any]]:
    """One entry per training with a recorded history and convergence record: where, the old and the new verdict."""
    out = []
    for meta_path in sorted(runs.rglob("meta.json")):
        folder = meta_path.parent
        metrics = folder / "logs" / "metrics.csv"
        meta = json.loads(meta_path.read_text())
        record = meta.get("convergence") or {}
        if not metrics.is_file() or record.get("stopped_by") not in ("early_stopping", "budget"):
            continue
        run = next(p for p in folder.parents if (p / "config.yaml").is_file())
        config = yaml.safe_load((run / "config.yaml").read_text())
        data = (
            (json.loads((run / "results.json").read_text()).get("data") or {})
            if (run / "results.json").is_file()
            else {}
        )
        stage = folder.relative_to(run).parts[0]
        scheduled = (
            bool((config.get("coarse") or {}).get("scheduler"))
            if stage.startswith("coarse")
            else bool(config.get("scheduler"))
        )
        new = convergence(
            _history(metrics),
            record["stopped_by"],
            int(record.get("min_epochs") or 0),
            scheduled,
            data.get("num_classes"),
            best_epoch=meta.get("best_epoch"),
            n_val=data.get("n_val"),
            **_settings(config, stage),
        )
        out.append(
            {
                "training": str(folder.relative_to(runs)),
                "dataset": folder.relative_to(runs).parts[0],
                "stage": stage,
                "old": bool(record.get("converged")),
                "new": new["converged"],
                "cause": new["cause"],
                "reason": "; ".join(new["reasons"]),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="?", type=Path, default=RUNS)
    parser.add_argument("--list", action="store_true", help="print every training whose verdict changes")
    args = parser.parse_args()
    entries = rescan(args.runs)
    changed = [e for e in entries if e["old"] != e["new"]]
    print(
        f"{len(entries)} trainings; {sum(e['old'] for e in entries)} converged by the recorded test, "
        f"{sum(e['new'] for e in entries)} by the current one; {len(changed)} change."
    )
    by = Counter((e["dataset"], e["stage"].split("/")[0], e["cause"]) for e in changed)
    for (dataset, stage, cause), count in sorted(by.items()):
        print(f"  {dataset:14s} {stage:16s} {cause or '-':20s} {count}")
    if args.list:
        for e in changed:
            print(f"{e['training']}: {e['old']} -> {e['new']} ({e['reason']})")


if __name__ == "__main__":
    main()
