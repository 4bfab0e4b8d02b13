"""A researcher's own data, first try (issue #45): the default recipe on real datasets of different shapes.

    python experiments/user_datasets.py --out /work/userdata                 # the four image folders (once)
    DDCNN_DATA=../shared/data python experiments/user_data.py --root /work/userdata [--only NAME ...] [--out DIR]
    python experiments/user_data.py --table --out DIR                        # the table of finished runs again
    python experiments/user_data.py --write [--out DIR]    # docs/user_data.md and .json from the finished runs
    python experiments/user_data.py --check                # docs/user_data.md's table == what its .json gives

Each dataset is trained with ``ddcnn-train`` exactly as a new user would type it: the data source, its root and, for
a 3D volume, a 3D grid; nothing of the recipe (``--extra`` adds overrides, to try another recipe, and the table says
so). Then, per dataset, every CNN training of the run (each local net and the global CNN): its epochs, what ended it,
its kept epoch and the convergence test's cause where it did not converge (``docs/protocol.md``, "Convergence"); the
run's wall and CPU time; the CNN-DNN's and the global CNN's test accuracy and the paired verdict of
``results.md`` (CNN-DNN − global CNN over the run's test images), or the reason there is none.

The datasets (``DATASETS``): the four folders of ``experiments/user_datasets.py`` (``lfw_faces`` 200 images, 2
classes, 25x25 grey; ``kanji_fonts`` 400 images, 40 classes, 48x48 grey; ``font_chars`` 2,520 images, 36 classes,
32x32 grey; ``icons_rgb`` 1,782 images, 9 classes, 32x32 RGB), the built-in digits (the README's demo) and
AdrenalMNIST3D 28^3 (1,584 volumes, 2 classes; ``data=adrenal3d_28 decomposition=2x2x2``) and Fashion-MNIST whole
(70,000 images, 10 classes, 28x28 grey; ``data=fashion_mnist``): tens of thousands of images.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC, RECORD = ROOT / "docs" / "user_data.md", ROOT / "docs" / "user_data.json"
BEGIN, END = "<!-- user_data.py:table begin (generated; --check compares) -->", "<!-- user_data.py:table end -->"

# name -> the overrides a user types (ROOT_DIR: --root); the rest is ddcnn's default recipe
DATASETS: dict[str, tuple[str, ...]] = {
    "digits": (),
    "lfw_faces": ("data=image_folder", "data.root=ROOT_DIR/lfw_faces"),
    "kanji_fonts": ("data=image_folder", "data.root=ROOT_DIR/kanji_fonts"),
    "font_chars": ("data=image_folder", "data.root=ROOT_DIR/font_chars"),
    "icons_rgb": ("data=image_folder", "data.root=ROOT_DIR/icons_rgb"),
    "adrenal3d": ("data=adrenal3d_28", "decomposition=2x2x2"),
    "fashion_mnist": ("data=fashion_mnist",),
}
# what a run adds that is no part of the recipe: no export, no progress bars in a log file
QUIET = ("report.export=false", "trainer.enable_progress_bar=false")


def command(name: str, root: Path, run_dir: Path, extra: list[str]) -> list[str]:
    typed = [o.replace("ROOT_DIR", str(root)) for o in DATASETS[name]]
    ddcnn = Path(sys.executable).with_name("ddcnn-train")
    return [str(ddcnn), *typed, *extra, *QUIET, f"hydra.run.dir={run_dir}"]


def run(name: str, root: Path, out: Path, extra: list[str]) -> dict:
    """Train dataset ``name`` into ``out/name`` (a finished run is read, not trained again) and record the command,
    its wall and CPU seconds."""
    run_dir = out / name
    record_file = run_dir / "user_data_run.json"
    cmd = command(name, root, run_dir, extra)
    if record_file.is_file() and json.loads(record_file.read_text())["command"] == cmd:
        return json.loads(record_file.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    print(f"user_data.py: {name}: {shlex.join(cmd)}", flush=True)
    with (run_dir / "train.log").open("w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    record = {
        "command": cmd,
        "returncode": done.returncode,
        "wall_s": time.time() - start,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "load": os.getloadavg()[0],
    }
    if done.returncode == 0:
        record_file.write_text(json.dumps(record, indent=1))
    return record


def trainings(run_dir: Path) -> list[dict]:
    """Every CNN training of a run: the local nets and the global CNN, from their meta.json."""
    out = []
    for meta_file in [*sorted((run_dir / "local").glob("*/meta.json")), run_dir / "global" / "meta.json"]:
        if not meta_file.is_file():
            continue
        meta = json.loads(meta_file.read_text())
        conv = meta.get("convergence") or {}
        label = "global" if meta_file.parent.name == "global" else f"local {int(meta_file.parent.name)}"
        out.append(
            {
                "training": label,
                "epochs": conv.get("epochs"),
                "stopped_by": conv.get("stopped_by"),
                "best_epoch": meta.get("best_epoch"),
                "converged": bool(meta.get("converged")),
                "cause": conv.get("cause"),
                "advice": conv.get("advice"),
            }
        )
    return out


def summary(name: str, run_dir: Path, record: dict) -> dict:
    results = json.loads((run_dir / "results.json").read_text())
    acc = {m["key"]: m["accuracy"] for m in results["methods"]}
    acc["cnn_dnn"] = acc.get(f"cnn_dnn_{(results.get('coarse_input') or {}).get('coarse', 'logits')}")
    lead = next((p for p in results.get("paired_test") or [] if p["baseline"] == "global"), None)
    data = results.get("data") or {}
    return {
        "dataset": name,
        "trainings": trainings(run_dir),
        "cnn_dnn": acc.get("cnn_dnn"),
        "global": acc.get("global"),
        "majority_rate": results.get("majority_rate"),
        "verdict": lead,
        "wall_s": record["wall_s"],
        "cpu_s": record["cpu_s"],
        "load": record.get("load"),
        "classes": data.get("num_classes"),
        "splits": {k: data.get(f"n_{k}") for k in ("train", "val", "test")},
        "flags": len(results.get("flags") or []),
        "extra": [
            o
            for o in record["command"]
            if o.startswith(("trainer.", "engine.", "scheduler", "optimizer.")) and o not in QUIET
        ],
    }


def table(rows: list[dict]) -> list[str]:
    head = "| dataset | train / val / test | trainings converged or best-epoch stopped | not converged (cause) | "
    head += "epochs (min-max) | CNN-DNN | global CNN | CNN-DNN − global CNN (95% interval over test images) | "
    head += "flags | wall / CPU (s) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r["trainings"]
        bad = [f"{x['training']} ({x['cause']})" for x in t if not x["converged"]]
        epochs = [x["epochs"] for x in t if x["epochs"]]
        v = r["verdict"]
        lead = (
            f"{v['difference']:+.2f} [{v['low']:+.2f}, {v['high']:+.2f}]: {v['verdict']}"
            if v
            else "no paired test (see results.md)"
        )
        s = r["splits"]
        typed = f" (`{' '.join(r['extra'])}`)" if r.get("extra") else ""
        lines.append(
            f"| {r['dataset']}{typed} | {s['train']} / {s['val']} / {s['test']} | {len(t) - len(bad)} of {len(t)} | "
            f"{', '.join(bad) or '-'} | {min(epochs, default=0)}-{max(epochs, default=0)} | "
            f"{100 * (r['cnn_dnn'] or 0):.2f} | {100 * (r['global'] or 0):.2f} | {lead} | {r['flags']} | "
            f"{r['wall_s']:.0f} / {r['cpu_s']:.0f} |"
        )
    return lines


def write_doc(rows: list[dict]) -> None:
    """docs/user_data.json (the runs' summaries) and the table of docs/user_data.md between its markers."""
    RECORD.write_text(json.dumps(rows, indent=1) + "\n")
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(f"{head}{BEGIN}\n" + "\n".join(table(rows)) + f"\n{END}{tail}")


def check_doc() -> list[str]:
    """The lines of docs/user_data.md's table that differ from what docs/user_data.json gives (empty: none)."""
    rows = json.loads(RECORD.read_text())
    text = DOC.read_text()
    shown = text.partition(BEGIN)[2].partition(END)[0].strip().splitlines()
    wanted = table(rows)
    return [line for line in wanted if line not in shown] + [line for line in shown if line not in wanted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/work/userdata"), help="the folders of user_datasets.py")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "user_data", help="the run directories")
    parser.add_argument("--only", nargs="+", choices=sorted(DATASETS), help="these datasets only")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides beside the typed ones (another recipe)")
    parser.add_argument("--table", action="store_true", help="only print the table of the finished runs in --out")
    parser.add_argument("--write", action="store_true", help="write docs/user_data.{md,json} from the runs in --out")
    parser.add_argument("--check", action="store_true", help="docs/user_data.md's table == docs/user_data.json's")
    args = parser.parse_args(argv)
    if args.check:
        differ = check_doc()
        print("\n".join(differ) or f"{DOC}: the table is what {RECORD.name} gives")
        return 1 if differ else 0
    args.table = args.table or args.write
    names = args.only or list(DATASETS)
    rows = []
    for name in names:
        if args.table:
            record_file = args.out / name / "user_data_run.json"
            if not record_file.is_file():
                continue
            record = json.loads(record_file.read_text())
        else:
            record = run(name, args.root, args.out, args.extra)
            if record["returncode"] != 0:
                print(f"user_data.py: {name} failed (exit {record['returncode']}): see {args.out / name}/train.log")
                continue
        rows.append(summary(name, args.out / name, record))
        (args.out / "user_data.json").write_text(json.dumps(rows, indent=1))
        print("\n".join(table(rows[-1:])[2:]), flush=True)
    print("\n".join(table(rows)))
    if args.write:
        write_doc(rows)
    for r in rows:
        for t in r["trainings"]:
            if not t["converged"]:
                print(f"- {r['dataset']} {t['training']}: {t['cause']}: {t['advice']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
