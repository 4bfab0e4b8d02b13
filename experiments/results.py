"""The results page: ``docs/results.md`` regenerated from scratch by one command, with a manifest that checks it.

    DDCNN_DATA=../shared/data python experiments/results.py --jobs 2   # the real page (hours; one run per core)
    python experiments/results.py --tiny --out /tmp/results --workdir /tmp/results/runs  # CI's few-second version
    python experiments/results.py --check [--out docs] [--root DIR]                      # page == what the runs wrote
    python experiments/results.py --snapshot          # keep the finished runs of an unfinished invocation (commit them)

What it does, in order:

1. **Runs** every training of the plan with ``ddcnn-train`` (one subprocess per run directory, ``--jobs`` at once in
   plan order, ``OMP_NUM_THREADS=1`` unless ``--threads``; each run records its own CPU time and the commit it ran
   at, and the page names every commit its runs were trained at): MNIST and Fashion-MNIST with ``vgg_small`` local
   nets and global CNN, grids 2x2 and 4x4, overlap 0 and 2, seeds 0, 1, 2, ``methods=all`` (every method of the
   registry: the CNN-DNN on probabilities and logits, the stacker, the out-of-fold and validation-fit coarse DNNs,
   end to end, transfer, global transfer, global DDP on 2 CPU processes); AdrenalMNIST3D 28^3
   (``experiment=adrenal3d``: 2x2x2, overlap 8, its 12-epoch cosine recipe, checkpoint by validation loss) over the
   same seeds with the default methods. A run directory that holds ``results.json`` is reused, so an interrupted
   invocation resumes where it stopped (and ``ddcnn-train`` itself resumes a half-finished run from its stages'
   checkpoints). Each finished run is snapshotted at once under ``OUT/results/runs/`` (``--snapshot`` does it for
   the finished runs of a workdir), and a run whose run directory is gone but whose snapshot is there is restored
   from it, not trained again: commit the snapshots of an unfinished invocation and a later one, on another machine,
   trains only the rest. The global CNN does not depend on the decomposition: the store (``store.reuse``, under
   ``WORKDIR/store``) trains it once per dataset and seed and copies it into the other runs.
2. **Reports** them with ``ddcnn-report`` (tables with accuracy mean ± std over the seeds, times, speedup, speedup at
   equal accuracy; plots) into ``WORKDIR/report``.
3. **Writes** ``OUT/results.md`` (the page: machine, threads, load, date, command and wall time in its header; the
   report's table of each dataset; its plots and each configuration's accuracy-versus-time curves, copied under
   ``OUT/results/``; the AdrenalMNIST3D AUC beside MedMNIST's published 3D baselines), a snapshot of every run's
   ``results.json``, ``config.yaml`` and ``fingerprint.json`` under ``OUT/results/runs/``, and
   ``OUT/results_manifest.json``: every run directory, its fingerprint and the SHA-256 of its ``results.json``, the
   figures the page took from it, and every table line of the page. :func:`check_manifest` recomputes each table
   from the run directories with the report's own code and fails on any line of the page that differs.

**The training rule, one for every method.** Every training (local nets, out-of-fold local nets, global CNN, end to
end, transfer, global transfer, global DDP, AdrenalMNIST3D's included) stops once its monitored validation metric has
not improved for ``--patience`` = 2 epochs (``engine.patience``), capped at ``--epochs`` = 15 (``trainer.max_epochs``;
AdrenalMNIST3D: its recipe's 12), and keeps the weights of its best epoch (``engine.monitor``: validation accuracy;
AdrenalMNIST3D: validation loss, its recipe); every coarse DNN stops the same way after ``coarse.patience`` = 3 epochs
of its own. The page states the rule and each run's ``meta.json`` records where each training stopped. The 2D
trainings multiply their learning rate by ``--lr-drop`` = 0.2 after every epoch without improvement
(``ReduceLROnPlateau``, the ``scheduler`` of each run's ``config.yaml``; AdrenalMNIST3D keeps its cosine recipe): with
a constant rate (AdamW, 2e-3) the validation accuracy of the MNIST global CNN went 0.87, 0.65, 0.91, 0.89, 0.84 over
epochs 1-5, so the patience ended it at epoch 5 with 91.3% test accuracy, an unconverged baseline below every
combiner of the local nets (first invocation, 2026-12-02, stopped for it): a noisy epoch now makes the step smaller
rather than ending the training. A smaller step also makes the validation accuracy creep by one or two images of
3000 for many epochs at a vanishing rate (seen: a local net to the 15-epoch cap on +0.06 points), so for the 2D
trainings an epoch counts as an improvement only by more than ``--min-delta`` = 0.002 (``engine.min_delta``: 6 of the
3000 validation images, a third of the accuracy's sampling error there); the weights kept are still the best epoch's.

**CPU time** (the 2-core development machine, AMD EPYC, one torch thread per training, ``--jobs 2``, 2026-12-02;
each run's ``experiment_run.json`` has its own): the 27 runs of the page took 12189 s CPU, 3.4 of the 10 CPU-hours
the page may cost (MNIST 5082 s, Fashion-MNIST 6248 s, AdrenalMNIST3D 860 s; one run 266-760 s, the 4x4 overlap-2
runs the dearest), and 1.97 h wall from the first run's start to the last one's end. On another machine of the same
kind, under a second job's load, the same runs had taken about twice the CPU (MNIST 2x2 overlap 0, seed 0: 858 s
against 386 s here): read the figures as this machine's. With the earlier constant-rate recipe (cap 10, no
``min_delta``) seed 0 of the plan had taken 7615 s CPU there. An invocation stopped part-way is simply started
again, also on a fresh machine from the committed snapshots (step 1), and the page names the commits its runs were
trained at and the span of their wall clock.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This checkout's ddcnn, not whichever one the environment installed (the subprocesses get the same PYTHONPATH).
sys.path.insert(0, str(ROOT))

MANIFEST_FORMAT = "ddcnn.results_manifest/1"
PAGE, MANIFEST, ASSETS = "results.md", "results_manifest.json", "results"
# Copied into the snapshot of a run: what the report reads (results.json, config.yaml) and what identifies it.
SNAPSHOT_FILES = ("results.json", "config.yaml", "fingerprint.json", "experiment_run.json")
# Also kept, so that a run restored from its snapshot gives the page what the run directory gave it.
SNAPSHOT_EXTRA = ("plots/accuracy_vs_time.png",)
# The figures of each results.json methods row that the page's tables are made of.
ROW_FIELDS = (
    "accuracy",
    "balanced_accuracy",
    "auc",
    "sequential_time_s",
    "projected_time_s",
    "devices",
    "speedup",
    "params",
)
# MedMNIST v2's AdrenalMNIST3D test AUC of its 3D baselines (Yang et al., "MedMNIST v2", Scientific Data 10, 41,
# 2023, Table 4; https://arxiv.org/abs/2110.14795), 28^3 volumes, official split.
PUBLISHED_3D = (("ResNet-18 (3D)", 0.827), ("ResNet-50 (3D)", 0.828))
AUC_HEAD = "| backbone | grid | overlap | method | seeds | test accuracy (%) | balanced acc. (%) | test AUC |"
# The summary table of each dataset: the CNN-DNN against its two cheap combiners and the global CNN, per grid/overlap.
GLANCE_HEAD = (
    "| backbone | grid | overlap | seeds | global CNN (%) | CNN-DNN (%) | mean probability (%) | majority vote (%) "
    "| CNN-DNN − mean probability (points) | CNN-DNN − global CNN (points) | most accurate method (%) |"
)


@dataclass(frozen=True)
class Dataset:
    """One section of the page: the runs of one ``ddcnn-train`` experiment over grids, overlaps and seeds."""

    key: str  # folder under WORKDIR and the label of the section
    title: str
    overrides: tuple[str, ...]
    grids: tuple[str, ...]
    overlaps: tuple[int, ...]
    auc_table: bool = False  # a table of test AUC per method (beside `published`, if any)
    published: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class RunSpec:
    dataset: Dataset
    grid: str
    overlap: int | None  # None: the experiment's own
    seed: int

    @property
    def name(self) -> str:
        """The run directory, relative to WORKDIR."""
        overlap = "" if self.overlap is None else f"_o{self.overlap}"
        return f"{self.dataset.key}/{self.grid}{overlap}_s{self.seed}"

    def overrides(self, workdir: Path) -> list[str]:
        grid = [f"decomposition={self.grid}"]
        if self.overlap is not None:
            grid.append(f"decomposition.overlap={self.overlap}")
        common = ["report.export=false", "trainer.enable_progress_bar=false", f"store.root={workdir / 'store'}"]
        return [*self.dataset.overrides, *grid, f"seed={self.seed}", *common]


def plan(args: argparse.Namespace) -> list[Dataset]:
    """The datasets of the page (``--tiny``: one small dataset, one epoch, the default methods)."""
    rule = [f"engine.patience={args.patience}"]  # the page's one early-stopping rule (module doc)
    if args.tiny:
        tiny = ["data=digits", "model=vgg_tiny", "trainer.max_epochs=1", *rule, "methods=default", "report.plots=false"]
        tiny += ["methods.enabled.coarse_alt=false", "methods.enabled.coarse_val=false", "report.curves.enabled=false"]
        if args.train_subset:
            tiny.append(f"data.train_subset={args.train_subset}")
        return [Dataset("digits", "Digits (tiny mode)", tuple(tiny), ("2x2",), (0, 2), auc_table=True)]
    subset = [f"data.train_subset={args.train_subset}"] if args.train_subset else []
    subset += [f"data.test_subset={args.test_subset}"] if args.test_subset else []
    two_d = ["model=vgg_small", "methods=all", f"trainer.max_epochs={args.epochs}", *rule, *subset]
    if args.min_delta:  # an improvement is one by more than this (module doc)
        two_d.append(f"engine.min_delta={args.min_delta}")
    if args.lr_drop:  # the learning rate divided after every epoch without improvement (module doc)
        two_d.append(
            "scheduler={_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true,mode:max,"
            f"factor:{args.lr_drop},patience:0}}"
        )
    two_d += [f"data.val_fraction={args.val_fraction}", f"data.batch_size={args.batch_size}"]
    two_d += [f"report.curves.points={args.curve_points}", f"methods.local_oof.folds={args.oof_folds}"]
    datasets = {
        "mnist": Dataset("mnist", "MNIST", ("experiment=mnist", *two_d), ("2x2", "4x4"), (0, 2)),
        "fashion_mnist": Dataset(
            "fashion_mnist", "Fashion-MNIST", ("experiment=fashion_mnist", *two_d), ("2x2", "4x4"), (0, 2)
        ),
        "adrenal3d": Dataset(
            "adrenal3d",
            "AdrenalMNIST3D 28³",
            ("experiment=adrenal3d", "methods=default", *rule),
            ("2x2x2",),
            (None,),
            auc_table=True,
            published=PUBLISHED_3D,
        ),
    }
    unknown = [d for d in args.datasets if d not in datasets]
    if unknown:
        raise SystemExit(f"results.py: unknown dataset(s) {unknown}; choose from {sorted(datasets)}")
    return [datasets[d] for d in args.datasets]


def run_specs(datasets: list[Dataset], seeds: list[int]) -> list[RunSpec]:
    # Seed-major: the first pass gives one seed of everything (a usable page if time runs out).
    return [RunSpec(d, g, o, s) for s in seeds for d in datasets for g in d.grids for o in d.overlaps]


# --- running ------------------------------------------------------------------------------------------------------
def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _wait(proc: subprocess.Popen, timeout_s: float | None) -> tuple[int, float]:
    """Wait for ``proc`` (killed after ``timeout_s``); its exit code and the CPU seconds (user + sys) of it and the
    children it waited for, its own rusage, so that runs in parallel each count only their own."""
    timer = threading.Timer(timeout_s, proc.kill) if timeout_s else None
    if timer is not None:
        timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if timer is not None:
            timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _env(threads: int) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def _entry(name: str) -> list[str]:
    """A ddcnn console script run with this interpreter and this checkout's ddcnn."""
    target = {"ddcnn-train": "ddcnn.cli:train_main", "ddcnn-report": "ddcnn.report.cli:report_main"}[name]
    module, func = target.split(":")
    code = f"import sys; from {module} import {func}; sys.argv[0] = {name!r}; sys.exit({func}())"
    return [sys.executable, "-c", code]


def _finished(run_dir: Path) -> bool:
    return all((run_dir / f).is_file() for f in ("results.json", "config.yaml", "experiment_run.json"))


def _portable(command: str) -> str:
    """A run's command without what names this machine's folders (the store's): equal on any machine for equal
    settings."""
    return " ".join(part for part in shlex.split(command) if not part.startswith("store.root="))


def save_snapshot(run_dir: Path, snapshot: Path) -> None:
    """Copy what the page needs of a finished run directory to ``snapshot`` (``OUT/results/runs/<run>``), atomically:
    a snapshot folder is whole or absent."""
    partial = snapshot.with_name(snapshot.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for file in (*SNAPSHOT_FILES, *SNAPSHOT_EXTRA):
        if (run_dir / file).is_file():
            (partial / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / file, partial / file)
    shutil.rmtree(snapshot, ignore_errors=True)
    partial.rename(snapshot)


def train(
    spec: RunSpec, workdir: Path, threads: int, timeout_s: float | None, log, snapshots: Path | None = None
) -> dict:
    """Train one run directory (or reuse it when it holds ``results.json``, or restore it from its snapshot under
    ``snapshots`` when only that is left: a committed, unfinished invocation); its record (times, command). A run
    trained here is snapshotted under ``snapshots`` at once, so that committing ``OUT/results/runs`` keeps it."""
    run_dir = workdir / spec.name
    record_file = run_dir / "experiment_run.json"
    if (run_dir / "results.json").is_file() and record_file.is_file():
        record = json.loads(record_file.read_text())
        log(f"{spec.name}: finished earlier ({record.get('wall_s', 0):.0f} s wall), reused")
        return record
    overrides = spec.overrides(workdir)
    command = "ddcnn-train " + " ".join(shlex.quote(o) for o in overrides) + f" hydra.run.dir={spec.name}"
    if snapshots is not None and _finished(snapshots / spec.name):
        saved = json.loads((snapshots / spec.name / "experiment_run.json").read_text())
        if _portable(saved.get("command", "")) == _portable(command):
            shutil.rmtree(run_dir, ignore_errors=True)  # a half-finished training of it: the snapshot is finished
            shutil.copytree(snapshots / spec.name, run_dir)
            log(f"{spec.name}: restored from its snapshot {snapshots / spec.name} (trained at {saved.get('commit')})")
            return saved
        log(f"{spec.name}: its snapshot was run with other settings ({saved.get('command')}); training it again")
    cmd = [*_entry("ddcnn-train"), *overrides, f"hydra.run.dir={run_dir}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    load_before, started = _loadavg(), time.time()
    with open(run_dir.parent / f"{run_dir.name}.log", "a") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(threads), stdout=out, stderr=subprocess.STDOUT)
        code, cpu = _wait(proc, timeout_s)
    wall = time.time() - started
    if code != 0 or not (run_dir / "results.json").is_file():
        tail = (run_dir.parent / f"{run_dir.name}.log").read_text().splitlines()[-20:]
        raise RuntimeError(f"ddcnn-train failed for {spec.name} (exit {code}):\n" + "\n".join(tail))
    record = {
        "command": command,
        "commit": _git_commit(),
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "load_before": load_before,
        "load_after": _loadavg(),
        "threads": threads,
    }
    record_file.write_text(json.dumps(record, indent=1) + "\n")
    if snapshots is not None:
        save_snapshot(run_dir, snapshots / spec.name)
    return record


def report(specs: list[RunSpec], workdir: Path, threads: int, plots: bool) -> Path:
    out = workdir / "report"
    cmd = [*_entry("ddcnn-report"), *(str(workdir / s.name) for s in specs), "--out", str(out)]
    proc = subprocess.run(
        [*cmd, *([] if plots else ["--no-plots"])], cwd=ROOT, env=_env(threads), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"ddcnn-report failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return out


# --- the page and its manifest ----------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _slug(text: str) -> str:
    from ddcnn.report.compare import _slug as slug

    return slug(text)


def _load_runs(root: Path, names: list[str]):
    from ddcnn.report.compare import load_run

    return [load_run(root / name) for name in names]


def report_lines(root: Path, names: list[str]) -> dict[str, list[str]]:
    """Per dataset name, the lines of the report's table of the runs ``names`` under ``root`` (as ``ddcnn-report``
    writes it: :func:`ddcnn.report.compare.comparison_rows` and :func:`~ddcnn.report.compare.table_markdown`)."""
    from ddcnn.report.compare import comparison_rows, table_markdown

    tables = comparison_rows(_load_runs(root, names))
    return {dataset: table_markdown(rows).splitlines() for dataset, rows in tables.items()}


def _auc(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}"


def auc_lines(root: Path, names: list[str], published: tuple[tuple[str, float], ...]) -> list[str]:
    """The AUC table of the runs ``names`` (one dataset): every method's test accuracy, balanced accuracy and AUC
    (mean ± std over the seeds, the report's numbers), then the published baselines' AUC."""
    from ddcnn.report.compare import _accuracy, comparison_rows

    (rows,) = comparison_rows(_load_runs(root, names)).values()
    lines = [AUC_HEAD, "|" + "---|" * (AUC_HEAD.count("|") - 1)]
    for r in rows:
        cells = [r["backbone"], r["grid"], r["overlap"], r["method"], str(r["seeds"])]
        cells += [_accuracy(r), _accuracy(r, "balanced_accuracy"), _auc(r["auc_mean"], r["auc_std"])]
        lines.append("| " + " | ".join(cells) + " |")
    for name, auc in published:
        lines.append(f"| {name} | - | - | MedMNIST v2, published | - | - | - | {auc:.3f} |")
    return lines


def _cnn_dnn_key(run) -> str:
    """The results key of the run's CNN-DNN row (its coarse DNN's input: probabilities by default)."""
    return f"cnn_dnn_{(run.results.get('coarse_input') or {}).get('coarse', 'probs')}"


def _paired(runs, key: str, other: str) -> str:
    """``key`` minus ``other`` in accuracy points, paired by run (same seed, same local nets): mean ± std and on
    how many runs ``key`` was at least as accurate."""
    diffs = []
    for run in runs:
        acc = {r["key"]: float(r["accuracy"]) for r in run.rows}
        if key in acc and other in acc:
            diffs.append(100 * (acc[key] - acc[other]))
    if not diffs:
        return "-"
    mean = sum(diffs) / len(diffs)
    cell = f"{mean:+.2f}"
    if len(diffs) > 1:
        std = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5
        cell += f" ± {std:.2f}"
    return cell + f" (≥ on {sum(d >= 0 for d in diffs)}/{len(diffs)})"


def glance_lines(root: Path, names: list[str]) -> list[str]:
    """The summary table of the runs ``names`` (one dataset): per backbone, grid and overlap, the test accuracy of
    the global CNN, the CNN-DNN, the mean probability and the majority vote (mean ± std over the seeds, as the
    report's table has them), the CNN-DNN's lead over the mean probability and over the global CNN paired by seed,
    and the most accurate method of the family."""
    from ddcnn.report.compare import _accuracy, comparison_rows

    runs = _load_runs(root, names)
    (rows,) = comparison_rows(runs).values()
    groups: dict[tuple, list] = {}
    for run in sorted(runs, key=lambda r: (r.backbone, math.prod(r.grid), r.grid, r.overlap, r.seed)):
        groups.setdefault((run.backbone, run.grid_label, run.overlap_label), []).append(run)
    lines = [GLANCE_HEAD, "|" + "---|" * (GLANCE_HEAD.count("|") - 1)]
    for config, group in groups.items():
        backbone, grid, overlap = config
        mine = {r["method_key"]: r for r in rows if (r["backbone"], r["grid"], r["overlap"]) == config}
        key = _cnn_dnn_key(group[0])
        cells = [backbone, grid, overlap, str(len({run.seed for run in group}))]
        cells += [_accuracy(mine[k]) if k in mine else "-" for k in ("global", key, "mean_prob", "majority_vote")]
        cells += [_paired(group, key, "mean_prob"), _paired(group, key, "global")]
        best = max(mine.values(), key=lambda r: r["accuracy_mean"])
        cells.append(f"{best['method']}: {_accuracy(best)}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def run_figures(run_dir: Path) -> dict:
    """What the page takes from one run directory: each method's row figures and the speedups at equal accuracy."""
    results = json.loads((run_dir / "results.json").read_text())
    methods = {row["key"]: {k: row.get(k) for k in ROW_FIELDS} for row in results.get("methods") or []}
    equal = results.get("speedup_at_equal_accuracy") or {}
    flags = [f"{f['kind']}: {f['message']}" for f in results.get("flags") or []]
    return {"methods": methods, "speedup_at_equal_accuracy": equal, "flags": flags}


def flag_lines(root: Path, names: list[str]) -> list[str]:
    """The page's list of the rows the runs ``names`` flagged (``results.json`` ``flags``: at chance, or a combiner
    far below averaging the local nets), or one line saying there are none."""
    lines = [f"- `{name}`: {flag}" for name in names for flag in run_figures(root / name)["flags"]]
    return lines or [
        "- No row of these runs is flagged (none at chance, no combiner far below averaging the local nets: "
        "`flags` in each `results.json`)."
    ]


def _machine() -> dict[str, str]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": str(os.cpu_count()), "system": f"{platform.system()} {platform.release()}"}


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown (not a git checkout)"
        return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def _commits_line(page_commit: str, records: dict[str, dict]) -> str:
    """The commit the page was written at, and the runs' own where they differ (an invocation resumed on other
    code: the page says so rather than pass the runs off as one code's)."""
    runs: dict[str, list[str]] = {}
    for name, record in records.items():
        runs.setdefault(record.get("commit", "not recorded"), []).append(name)
    if set(runs) <= {page_commit}:
        return f"commit {page_commit} (every run)"
    trained = "; ".join(f"{commit}: {len(names)} run(s)" for commit, names in sorted(runs.items()))
    return f"page written at commit {page_commit}; runs trained at {trained} (each run's in its experiment_run.json)"


def _threads(root: Path, names: list[str]) -> str:
    threads = set()
    for name in names:
        contexts = (json.loads((root / name / "results.json").read_text()).get("timing") or {}).get("contexts") or {}
        threads |= {str(c.get("torch_threads")) for c in contexts.values()}
    return ", ".join(sorted(threads)) or "unknown"


def write_page(
    datasets: list[Dataset], specs: list[RunSpec], workdir: Path, out: Path, meta: dict[str, str], tiny: bool
) -> tuple[str, dict]:
    """Write ``OUT/results.md``, ``OUT/results_manifest.json`` and ``OUT/results/`` (plots, run snapshots)."""
    assets = out / ASSETS
    snapshot = assets / "runs"
    if snapshot.exists():
        shutil.rmtree(snapshot)
    names = [s.name for s in specs]
    for name in names:
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        save_snapshot(workdir / name, snapshot / name)
    records = {n: json.loads((workdir / n / "experiment_run.json").read_text()) for n in names}
    cpu_s = sum(r["cpu_s"] for r in records.values())
    first = min(datetime.fromisoformat(r["started"]) for r in records.values())
    last = max(datetime.fromisoformat(r["started"]).timestamp() + r["wall_s"] for r in records.values())
    last_end = datetime.fromtimestamp(last, timezone.utc)
    head = [
        "| | |",
        "|---|---|",
        f"| machine | {meta['cpu']}, {meta['cores']} cores, {meta['system']} |",
        f"| torch threads per training | {_threads(workdir, names)} (`OMP_NUM_THREADS={meta['threads']}`) |",
        f"| load (1/5/15 min) | start {meta['load_start']}, end {meta['load_end']}; per run in `results/runs/*/"
        "experiment_run.json` |",
        f"| date | {meta['started']} to {meta['finished']} (this invocation; each run's own start in its "
        "`experiment_run.json`) |",
        f"| runs | {len(names)} trained from {first:%Y-%m-%d %H:%M} to {last_end:%Y-%m-%d %H:%M} UTC: "
        f"{(last - first.timestamp()) / 3600:.2f} h from the first start to the last end |",
        f"| code | {_commits_line(meta['commit'], records)} |",
        f"| command | `{meta['command']}` |",
        f"| wall time | {meta['wall_s']} s for this invocation; {cpu_s:.0f} s CPU over the {len(names)} runs "
        f"(user + sys of their `ddcnn-train` processes, as each run recorded it) |",
    ]
    page = [
        "# Results: the CNN-DNN and its method family against the global CNN",
        "",
        f"Generated by `experiments/results.py`{' --tiny' if tiny else ''}; do not edit by hand: rerun it. Every "
        f"table line below is checked against the runs by `python experiments/results.py --check` (the manifest "
        f"`{MANIFEST}` lists every run directory, its fingerprint and the figures taken from it).",
        "",
        *head,
        "",
        "**Training rule, one for every method.** Every training (local nets, out-of-fold local nets, global CNN, end"
        " to end, transfer, global transfer, global DDP) stops once its monitored validation metric "
        "(`engine.monitor`) has not improved (by more than `engine.min_delta`) for `engine.patience` epochs, capped "
        "at `trainer.max_epochs` (all in each run's `config.yaml`), and keeps the weights of its best epoch; every "
        "coarse DNN stops the same way after `coarse.patience` epochs. Where each training stopped is in its "
        "`meta.json` (`stopped_epoch`). The learning-rate schedule of every training is the `scheduler` of its "
        "`config.yaml` (MNIST and Fashion-MNIST: the rate multiplied by `factor` after every epoch without "
        "improvement, so that one noisy epoch makes the step smaller rather than ending the training).",
        "",
        "Each run's settings are its `config.yaml` in `results/runs/<run>/`; the command of each is in its "
        "`experiment_run.json`. Accuracy: mean ± sample standard deviation over the seeds. Times: training clocks of "
        "the stages (process start-up and warm-up excluded), on the machine above while it ran other jobs too: read "
        "them and the speedups as rough.",
        "",
    ]
    manifest_tables: list[dict] = []
    report_dir = workdir / "report"
    for dataset in datasets:
        ds_names = [s.name for s in specs if s.dataset == dataset]
        tables = report_lines(workdir, ds_names)
        ((data_name, lines),) = tables.items()
        slug = _slug(data_name)
        written = (report_dir / f"{slug}.md").read_text().splitlines()
        # the report's table comes first; the paired differences (ddcnn.report.compare.paired_markdown) follow it
        if [line for line in written if line.startswith("|")][: len(lines)] != lines:
            raise RuntimeError(f"ddcnn-report's table of {data_name} differs from the one recomputed from the runs")
        overrides = " ".join(dataset.overrides)
        page += [
            f"## {dataset.title}",
            "",
            f"Runs: `ddcnn-train {overrides}`, with the grid, overlap and seed of each.",
            "",
        ]
        glance = glance_lines(workdir, ds_names)
        page += [
            "At a glance: test accuracy in percent, mean ± std over the seeds; the CNN-DNN's lead over the mean "
            "probability and over the global CNN in accuracy points, paired by seed (same data split and local nets), "
            "with the number of seeds on which the CNN-DNN was at least as accurate.",
            "",
            *glance,
            "",
            "Every method (times: training clocks; speedup at equal accuracy: the time the global CNN took to reach "
            "the CNN-DNN's final validation accuracy over the CNN-DNN's projected time, its slowest local net plus its "
            "coarse DNN, on the seeds where the global CNN reached it):",
            "",
        ]
        manifest_tables.append({"kind": "glance", "dataset": data_name, "runs": ds_names, "lines": glance})
        page += [*lines, ""]
        manifest_tables.append({"kind": "report", "dataset": data_name, "runs": ds_names, "lines": lines})
        if dataset.auc_table:
            lines = auc_lines(workdir, ds_names, dataset.published)
            beside = " beside MedMNIST v2's published 3D baselines (same data, same split)" if dataset.published else ""
            page += [f"Test AUC (mean ± std over the seeds){beside}:", ""]
            page += [*lines, ""]
            manifest_tables.append(
                {"kind": "auc", "dataset": data_name, "runs": ds_names, "published": dataset.published, "lines": lines}
            )
        page += ["Flagged rows:", "", *flag_lines(workdir, ds_names), ""]
        figures = []
        for png in sorted(report_dir.glob(f"{slug}_*.png")):
            shutil.copy2(png, assets / png.name)
            figures.append(png.name)
        for spec in specs:
            curve = workdir / spec.name / "plots" / "accuracy_vs_time.png"
            if spec.dataset == dataset and spec.seed == min(s.seed for s in specs) and curve.is_file():
                name = f"{slug}_{spec.name.split('/')[-1]}_accuracy_vs_time.png"
                shutil.copy2(curve, assets / name)
                figures.append(name)
        page += [f"![{Path(f).stem}]({ASSETS}/{f})" for f in figures] + ([""] if figures else [])
    text = "\n".join(page)
    runs = {
        n: {
            "fingerprint": json.loads((workdir / n / "fingerprint.json").read_text())["fingerprint"],
            "results_sha256": _sha256(workdir / n / "results.json"),
            "snapshot": f"{ASSETS}/runs/{n}",
            **run_figures(workdir / n),
        }
        for n in names
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "page": PAGE,
        "workdir": str(workdir),
        "command": meta["command"],
        "runs": runs,
        "header_lines": head,
        "tables": manifest_tables,
    }
    (out / PAGE).write_text(text)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return text, manifest


def check_manifest(page: str, manifest: dict, root: Path) -> list[str]:
    """What is wrong between the page, its manifest and the run directories under ``root`` (empty: nothing).

    ``root`` holds the run directories under their manifest names: the original ``--workdir`` or the snapshot
    ``OUT/results/runs``. Checked: each run's fingerprint and ``results.json`` hash are the manifest's; the figures the
    manifest took from each run are those of its ``results.json``; every table recomputed from the runs with the
    report's code is the manifest's, line for line; and every table line of the page is one of the manifest's (its
    header table or a recomputed one), so a figure on the page that no run wrote fails.
    """
    problems: list[str] = []
    if manifest.get("format") != MANIFEST_FORMAT:
        return [f"manifest format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}"]
    for name, entry in manifest["runs"].items():
        run_dir = root / name
        if not (run_dir / "results.json").is_file():
            problems.append(f"{name}: no results.json under {root}")
            continue
        fingerprint = json.loads((run_dir / "fingerprint.json").read_text())["fingerprint"]
        if fingerprint != entry["fingerprint"]:
            problems.append(f"{name}: fingerprint {fingerprint}, manifest {entry['fingerprint']}")
        if _sha256(run_dir / "results.json") != entry["results_sha256"]:
            problems.append(f"{name}: results.json is not the one the page was made from (SHA-256 differs)")
        figures = run_figures(run_dir)
        for key in ("methods", "speedup_at_equal_accuracy", "flags"):
            if figures[key] != entry.get(key):
                problems.append(f"{name}: the manifest's {key} figures differ from its results.json")
    allowed = set(manifest["header_lines"])
    for table in manifest["tables"]:
        missing = [n for n in table["runs"] if not (root / n / "results.json").is_file()]
        if missing:
            problems.append(f"table {table['kind']} of {table['dataset']}: runs {missing} missing under {root}")
            continue
        if table["kind"] == "report":
            recomputed = report_lines(root, table["runs"]).get(table["dataset"])
        elif table["kind"] == "glance":
            recomputed = glance_lines(root, table["runs"])
        else:
            published = tuple((str(n), float(a)) for n, a in table.get("published", ()))
            recomputed = auc_lines(root, table["runs"], published)
        if recomputed != table["lines"]:
            diff = [line for line in table["lines"] if line not in (recomputed or [])][:3]
            problems.append(f"table {table['kind']} of {table['dataset']}: not what the runs give, e.g. {diff}")
        allowed |= set(recomputed or [])
    page_lines = page.splitlines()
    for number, line in enumerate(page_lines, 1):
        if line.startswith("|") and line not in allowed:
            problems.append(f"page line {number} is in no table the runs give: {line[:160]}")
    for line in manifest["header_lines"]:
        if line not in page_lines:
            problems.append(f"header line missing from the page: {line[:160]}")
    for table in manifest["tables"]:
        absent = [line for line in table["lines"] if line not in page_lines]
        if absent:
            problems.append(f"table {table['kind']} of {table['dataset']}: {len(absent)} line(s) not on the page")
        if table["kind"] == "report" and all((root / n / "results.json").is_file() for n in table["runs"]):
            unlisted = [line for line in flag_lines(root, table["runs"]) if line not in page_lines]
            if unlisted:
                problems.append(f"flags of {table['dataset']}: {len(unlisted)} line(s) not on the page")
    return problems


# --- command line ----------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="experiments/results.py", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the few-second version for CI (digits, 1 epoch, 1 seed)")
    parser.add_argument("--out", type=Path, help="where results.md, its manifest and results/ go (default: docs)")
    parser.add_argument("--workdir", type=Path, help="the run directories (default: runs/results)")
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fashion_mnist", "adrenal3d"])
    parser.add_argument("--seeds", type=int, nargs="+", help="default: 0 1 2 (--tiny: 0)")
    parser.add_argument("--train-subset", type=int, help="training images per 2D dataset (default: 2000; 0 = all)")
    parser.add_argument("--test-subset", type=int, default=2000, help="test images per 2D dataset (0 = all 10000)")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of the 2D training sets for validation")
    parser.add_argument("--epochs", type=int, default=15, help="epoch cap of every 2D training (trainer.max_epochs)")
    parser.add_argument(
        "--min-delta",
        type=float,
        default=0.002,
        help="2D trainings: an epoch improves only by more than this validation accuracy (engine.min_delta)",
    )
    parser.add_argument(
        "--lr-drop",
        type=float,
        default=0.2,
        help="2D trainings: multiply the learning rate by this after every epoch whose validation accuracy did not "
        "improve (ReduceLROnPlateau; 0 = a constant rate)",
    )
    parser.add_argument("--patience", type=int, default=2, help="early stopping of every training (engine.patience)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch of every 2D full-image training")
    parser.add_argument("--oof-folds", type=int, default=3, help="k of the out-of-fold coarse DNN's local nets")
    parser.add_argument("--curve-points", type=int, default=4, help="test evaluations per training for the curves")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every training")
    parser.add_argument("--jobs", type=int, default=1, help="ddcnn-train runs at once (e.g. one per core)")
    parser.add_argument("--run-timeout", type=float, help="seconds after which one ddcnn-train is killed")
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="only copy the finished runs of WORKDIR into OUT/results/runs (commit them: a later invocation restores "
        "them instead of training them again); trains nothing, writes no page",
    )
    parser.add_argument("--check", action="store_true", help="only check OUT's page against its manifest and runs")
    parser.add_argument("--root", type=Path, help="with --check: the run directories (default: OUT/results/runs)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.tiny and not args.check and args.out is None:
        _parser().error("--tiny needs --out: its page must never replace docs/results.md")
    out = (args.out or ROOT / "docs").resolve()
    if args.check:
        manifest = json.loads((out / MANIFEST).read_text())
        problems = check_manifest((out / PAGE).read_text(), manifest, args.root or out / ASSETS / "runs")
        print("\n".join(problems) or f"{out / PAGE}: every table line is what the runs wrote")
        return 1 if problems else 0
    if args.train_subset is None and not args.tiny:
        args.train_subset = 2000
    seeds = args.seeds if args.seeds is not None else ([0] if args.tiny else [0, 1, 2])
    workdir = (args.workdir or ROOT / "runs" / ("results_tiny" if args.tiny else "results")).resolve()
    datasets = plan(args)
    specs = run_specs(datasets, seeds)
    if args.snapshot:
        done = [s.name for s in specs if _finished(workdir / s.name)]
        for name in done:
            save_snapshot(workdir / name, out / ASSETS / "runs" / name)
        print(f"results.py: {len(done)} of {len(specs)} runs finished, snapshotted into {out / ASSETS / 'runs'}")
        return 0
    given = argv if argv is not None else sys.argv[1:]
    command = "python experiments/results.py " + " ".join(shlex.quote(a) for a in given)
    start, load_start = time.time(), _loadavg()
    print(f"results.py: {len(specs)} runs into {workdir}, page into {out} (load {load_start})", flush=True)

    def log(message: str) -> None:
        print(f"[{time.time() - start:7.0f} s] {message}", flush=True)

    def one(numbered: tuple[int, RunSpec]) -> None:
        i, spec = numbered
        record = train(spec, workdir, args.threads, args.run_timeout, log, out / ASSETS / "runs")
        log(f"{i}/{len(specs)} {spec.name}: {record['wall_s']:.0f} s wall, {record['cpu_s']:.0f} s CPU")

    # --jobs runs at once, in plan order (the global CNN of a dataset and seed is trained by the first run that needs
    # it; a run started beside it waits for it in the store, then copies it).
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, enumerate(specs, 1)))
    report(specs, workdir, args.threads, plots=not args.tiny)
    log("ddcnn-report done")
    out.mkdir(parents=True, exist_ok=True)
    (out / ASSETS).mkdir(exist_ok=True)
    meta = {
        **_machine(),
        "threads": str(args.threads),
        "load_start": load_start,
        "load_end": _loadavg(),
        "started": datetime.fromtimestamp(start, timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "finished": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git_commit(),
        "command": command,
        "wall_s": f"{time.time() - start:.0f}",
    }
    page, manifest = write_page(datasets, specs, workdir, out, meta, args.tiny)
    problems = check_manifest(page, manifest, workdir)
    log(f"wrote {out / PAGE} and {out / MANIFEST}" + (f"; CHECK FAILED: {problems}" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
