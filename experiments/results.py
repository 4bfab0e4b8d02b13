"""The results page: ``docs/results.md`` regenerated from scratch by one command, with a manifest that checks it.

    DDCNN_DATA=../shared/data python experiments/results.py --jobs 2   # the real page (hours; see the cost below)
    python experiments/results.py --tiny --out /tmp/results --workdir /tmp/results/runs  # CI's few-second version
    python experiments/results.py --check [--out docs] [--root DIR]   # page and generated blocks == what the runs wrote
    python experiments/results.py --snapshot          # keep the finished runs of an unfinished invocation (commit them)
    python experiments/results.py --interim           # the page of those finished runs, marked interim (commit it)
    python experiments/results.py --write             # refill the generated blocks of the docs from the committed page
    python experiments/results.py --estimate [flags]  # the CPU the page would cost at these flags
    python experiments/results.py --rewrite           # the page again from its snapshots, with today's report code

What it does, in order:

1. **Runs** every training of the plan with ``ddcnn-train`` (one subprocess per run directory, ``OMP_NUM_THREADS=1``
   unless ``--threads``; each run records its CPU time, the commit it ran at, the machine, the invocation and how many
   runs shared the cores with it): MNIST and Fashion-MNIST with ``vgg_small`` local nets and global CNN, grids 2x2
   and 4x4, overlap 0 and 2, the methods that bear on the primary comparisons of ``docs/protocol.md`` section 5a
   (:data:`PAGE_ARMS` beside ``methods=default``: the CNN-DNN on the local logits, :data:`PAGE_INPUT`, and on
   probabilities as the paper's row; the averaging combiners, the stacker, the validation-fit coarse DNN, global DDP
   on 2 CPU processes, the equal-time ensemble of global CNNs by mean probability and by the coarse fit, and at 2x2
   the global CNN widened to the CNN-DNN's parameter count; since issue 44 not ``local_oof``, ``e2e``, ``transfer``,
   ``global_transfer``); the larger-data point ``mnist_10k`` (MNIST 2x2, overlap 0, 10,000 training images, seeds
   0-2); AdrenalMNIST3D 28^3 (``experiment=adrenal3d``: 2x2x2, overlap 8, checkpoint by validation loss, batch-norm
   statistics recomputed before each validation: ``engine.precise_bn=50``; the global-CNN arms at half the local
   nets' learning rate, ``global_lr_scale=0.5``, by their own sweep: docs/protocol.md 5b) with the same methods;
   seeds ``--seeds`` (default 0 to 4), each with its own training subset and validation split (``data.split_seed``
   left at its default: the run's seed), every 2D run on the full official test set (``--test-subset`` = 0: 10,000
   images), every training evaluated on ``val_target`` at every epoch (``--curve-points`` = all; the test split at 6
   epochs). The ensemble's ``k`` is fixed before any accuracy run:
   the first seed's timing run of a dataset trains with ``methods.global_ensemble.k=auto`` (the CNN-DNN's one-device
   training time over the global CNN's, rounded, at least 2), and every other run of the dataset gets the ``k`` it
   chose (:func:`ensemble_k`). The global CNN, the global DDP and the ensemble's members do not depend on the
   decomposition: the store (``store.reuse``, under ``WORKDIR/store``) trains each
   once per dataset and seed and copies it into the other runs (the wide global CNN once per width: 2x2 at overlap 0
   and 2). Per seed, the **timing runs** come first: the first
   run of each dataset, which trains the global CNN, the DDP and its own local nets, runs with ``--timing-jobs`` = 1
   run at a time, alone on the machine; then the **accuracy runs** (the other grids and overlaps) with ``--jobs`` at
   once (``--jobs 2``: one per core). A run directory that holds ``results.json`` of the planned command is reused,
   so an interrupted invocation resumes where it stopped (and ``ddcnn-train`` itself resumes a half-finished run from
   its stages' checkpoints); one of another command (say ``--epochs 20`` over runs made with 15) is refused, naming
   the flag, unless ``--retrain`` trains it again. Each finished run is snapshotted at once under
   ``OUT/results/runs/`` (``--snapshot`` does it for the finished runs of a workdir), and a run whose run directory
   is gone but whose snapshot of the planned command is there is restored from it, not trained again: commit the
   snapshots of an unfinished invocation and a later one, on another machine, trains only the rest. One invocation
   trains into a workdir at a time: a second one is refused at once, naming the first (``WORKDIR/.results.lock``,
   released by the kernel however the first ends).
2. **Reports** them with ``ddcnn-report`` (tables with accuracy mean ± std over the seeds, times, speedups at equal
   device counts and to the fixed target of ``docs/protocol.md``; the paired differences with their 95% intervals and
   verdicts; plots) into ``WORKDIR/report``.
3. **Writes** ``OUT/results.md`` (the page: its header describes the training of its runs, from their records:
   machine, load, the span from the first start to the last end, CPU seconds, commits, jobs, the invocations that
   trained them, then the invocation that wrote the page; per dataset a glance table whose CNN-DNN leads carry their
   paired 95% interval and verdict (:mod:`ddcnn.report.stats`), the report's paired differences and its table of
   every method; the equal-devices table where the runs have ``projected_time_s_by_devices``; its plots and each
   configuration's accuracy-versus-time curves, copied under ``OUT/results/``; the AdrenalMNIST3D AUC beside
   MedMNIST's published 3D baselines), a
   snapshot of every run (``results.json``, ``config.yaml``, ``fingerprint.json``, ``experiment_run.json``, and each
   stage's ``meta.json`` and ``logs/metrics.csv``) under ``OUT/results/runs/``, and ``OUT/results_manifest.json``:
   every run directory, its fingerprint and the SHA-256 of its ``results.json``, the figures the page took from it,
   and every table line of the page. :func:`check_manifest` recomputes each table from the run directories with the
   report's own code and fails on any line of the page that differs. Writing ``docs`` also refills the generated
   blocks of ``README.md``, ``docs/methods.md`` and this docstring (:data:`BLOCKS`), which ``--check`` compares with
   what the runs give, as it compares every ``--flag`` = value of this docstring with the parser's default.

**The training rule, one for every 2D training** (local nets, out-of-fold local nets, global CNN, end to end,
transfer, global transfer, global DDP): an epoch improves only when its validation accuracy beats the best before it
by more than ``--min-delta`` = 0.002 (``engine.min_delta``); the same absolute threshold drives the plateau schedule
(``ReduceLROnPlateau``, ``threshold_mode: abs``), which multiplies the learning rate by ``--lr-drop`` = 0.2 after
more than ``--lr-patience`` = 0 epochs in a row without improvement; early stopping ends a training after
``--patience`` = 2 epochs without improvement (at least the schedule's patience + 2, so the rate has dropped before a
training stops: twice at these defaults), not before ``--min-epochs`` (default half the cap, rounded up:
``engine.min_epochs``, passed where the engine has the setting), capped at ``--epochs`` = 15; the weights kept are
the best epoch's. Every coarse DNN stops the same way after ``coarse.patience`` epochs of its own. AdrenalMNIST3D
keeps its recipe's cosine schedule over 12 epochs and is never cut short (``engine.patience=null``). 2D sizes:
``--train-subset`` = 2000 training images, ``--val-fraction`` = 0.05 of the training set for validation, of which
``--val-target-fraction`` = 0.5 is the held-out target split that no choice sees (``data.val_target_fraction``: both
fixed targets of ``docs/protocol.md`` are accuracies there; AdrenalMNIST3D's 98 validation volumes are too few to
halve, so its target split is ``--val-target-fraction-3d`` = 0.1 of its 1,188 training volumes, 119, carved out of
training: ``data.val_target_from=train``, the nets train on the other 1,069),
``--batch-size`` = 64.

**Cost.** The page may cost 14 CPU-hours (:data:`CPU_BUDGET_S`, raised from 10 for issue #44's arms, full test sets
and every-epoch target curves). The page of before them cost about 12, and fewer training images did not bring
it under 10. Seeds 0 and 1 at 2000 images (trained at 2a56737, every run's CPU recorded) put the page at 12.0
CPU-hours. At 1500 images, seed 0's two timing runs (trained at 58c5f6d) cost 737 and 741 s CPU against 645 and 808
s at 2000: a training stops when it has converged, not at a fixed epoch, and ran as many epochs or more on fewer
images (the MNIST local nets 8-14 against 8-11), while the validation (3000 images, half of them the target split)
and test evaluations do not shrink with the training set. So the page trains 2000 images and reports its cost
against the budget where it is read (its header, ``docs/methods.md``); issue #44 dropped the arms that do not bear
on the primary comparisons (``local_oof``, ``e2e``, ``transfer``, ``global_transfer``) on 2D. The estimate of the
page at the defaults comes from the CPU its runs recorded at the same training set (:func:`estimate`: 5 seeds, the
global CNN and the DDP trained once per dataset and seed):

<!-- results.py:estimate begin (generated by experiments/results.py; --check compares) -->
- at the defaults, 5 seeds, 2000 training images per 2D dataset: about 53854 s CPU (15.0 CPU-hours, over the 14 allowed;
  mnist 11868 s, fashion_mnist 13229 s, adrenal3d 22616 s, mnist_10k 6141 s).
<!-- results.py:estimate end -->

Read them as the development machine's (2 cores, one torch thread per training): on another machine of the same kind,
under a second job's load, the same runs had taken about twice the CPU. An invocation stopped part-way is simply
started again, also on a fresh machine from the committed snapshots (step 1); the CPU it spent on a run it did not
finish (sampled every :data:`SAMPLE_S` seconds into the run directory) joins the record of the invocation that
finishes the run (``earlier_invocations``). To commit what a part-way invocation
measured, ``--interim`` (with the same flags, ``--out`` the page's folder) writes the page from the finished runs of
the plan alone, checked like any page, its header marked interim with the runs still missing; its snapshots are those
the next invocation restores (a development session's machine keeps only what is committed to main).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
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
# And of every stage (local/<NN>/, global/, ..., local_oof/<NN>/fold_<k>/): where its training stopped and why
# (meta.json) and its epoch-by-epoch log (logs/metrics.csv), so that what the page says of each training can be checked.
SNAPSHOT_STAGE_FILES = ("meta.json", "logs/metrics.csv")
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
# The page lives in docs/ beside the protocol it follows (a --tiny page elsewhere keeps the same relative link).
PROTOCOL_LINK = "protocol.md"
# The summary table of each dataset: the CNN-DNN against its two cheap combiners and the global CNN, per grid/overlap.
GLANCE_HEAD = (
    "| backbone | grid | overlap | seeds | global CNN (%) | CNN-DNN (%) | mean probability (%) | majority vote (%) "
    "| CNN-DNN − mean probability (points, 95% interval, verdict) | CNN-DNN − global CNN (points, 95% interval, "
    "verdict) | most accurate method (%) |"
)


# Datasets of the plan outside the protocol's primary family (section 5a) and its `coarse.input` criteria (section 6,
# "the page's 5 seeds"): the larger-data point (3 seeds) and the 64³ row of issue #47 (its own invocation: a page of it
# alone makes its own family).
SECONDARY_DATASETS = ("mnist_10k", "adrenal3d_64")


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
    seeds: tuple[int, ...] | None = None  # None: --seeds
    # overrides of one grid only (the wide global CNN at 2x2: its width follows the CNN-DNN's parameter count)
    grid_overrides: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # the equal-time ensemble of global CNNs: k from the first seed's timing run (k=auto there), passed to the others
    ensemble: bool = False
    # overrides of one seed only (the 64³ row's global DDP, on its first seed)
    seed_overrides: tuple[tuple[int, tuple[str, ...]], ...] = ()
    # in the page's family of primary verdicts (docs/protocol.md 5a names MNIST, Fashion-MNIST and AdrenalMNIST3D 28³;
    # SECONDARY_DATASETS are not: their per-configuration tables)
    primary: bool = True


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
        grid += list(dict(self.dataset.grid_overrides).get(self.grid, ()))
        common = ["report.export=false", "trainer.enable_progress_bar=false", f"store.root={workdir / 'store'}"]
        ensemble = [f"methods.global_ensemble.k={ensemble_k(self, workdir)}"] if self.dataset.ensemble else []
        seed = list(dict(self.dataset.seed_overrides).get(self.seed, ()))
        return [*self.dataset.overrides, *grid, *ensemble, *seed, f"seed={self.seed}", *common]


def k_source(dataset: Dataset) -> RunSpec:
    """The run that fixes the ensemble's ``k`` for every run of ``dataset``: the first seed's timing run (its first
    grid and overlap), trained alone with ``methods.global_ensemble.k=auto`` (the CNN-DNN's one-device training time
    over the global CNN's, rounded, at least 2) before any accuracy run."""
    seed = _FIRST_SEED.get(dataset.key, (dataset.seeds or SEEDS)[0])
    return RunSpec(dataset, dataset.grids[0], dataset.overlaps[0], seed)


def ensemble_k(spec: RunSpec, workdir: Path) -> str:
    """``auto`` for the run that fixes ``k`` (:func:`k_source`), else the ``k`` that run chose (its
    ``global_ensemble/meta.json``, in the work directory or restored there from its snapshot).

    Raises:
        SystemExit: When that run has not finished: the plan trains it first (the first seed's timing phase).
    """
    source = k_source(spec.dataset)
    if spec == source:
        return "auto"
    meta = workdir / source.name / "global_ensemble" / "meta.json"
    if not meta.is_file():
        raise SystemExit(
            f"results.py: {spec.name} takes the ensemble's k from {source.name}, which has not finished in {workdir}; "
            f"the plan trains it first (the first seed's timing phase): run the page again from there."
        )
    return str(int(json.loads(meta.read_text())["k"]))


# dataset key -> its first seed in this invocation (set by run_specs: the k of the ensemble comes from that seed)
_FIRST_SEED: dict[str, int] = {}


def _engine_has(setting: str) -> bool:
    """Whether this checkout's engine has ``engine.<setting>`` (``conf/engine/default.yaml``)."""
    from omegaconf import OmegaConf

    return setting in OmegaConf.load(ROOT / "conf" / "engine" / "default.yaml")


def recipe(args: argparse.Namespace) -> list[str]:
    """The training rule of every 2D training (module doc): early stopping after ``--patience`` epochs without an
    improvement by more than ``--min-delta``, not before ``--min-epochs``, capped at ``--epochs``, and the plateau
    schedule that counts improvements by the same absolute threshold."""
    rule = [
        f"trainer.max_epochs={args.epochs}",
        # stated, not inherited: a later change of the engine's default monitor must not change the page's runs
        "engine.monitor=val_acc",
        "engine.monitor_mode=max",
        f"engine.patience={args.patience}",
        f"engine.min_delta={args.min_delta}",
    ]
    if _engine_has("min_epochs"):  # the engine's own default is half the cap; stated here so the command shows it
        rule.append(f"engine.min_epochs={args.min_epochs}")
    if args.lr_drop:
        rule.append(
            "scheduler={_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true,mode:max,"
            f"factor:{args.lr_drop},patience:{args.lr_patience},threshold:{args.min_delta},threshold_mode:abs}}"
        )
    elif _engine_has("min_steps"):  # the default recipe of issue #45 (plateau, 200 steps): the page states its own
        rule.append("scheduler=null")
    if _engine_has("min_steps"):
        rule.append("engine.min_steps=0")
    return rule


# The optional methods every dataset of the page runs besides methods=default's (coarse_alt, stacker, coarse_val).
PAGE_ARMS = ("global_ddp", "global_ensemble", "global_ensemble_coarse")
# The page's CNN-DNN: the coarse DNN on the local logits, the default when its runs trained (issue #44). Its re-check
# under docs/protocol.md section 6 returned the default to probs; the page states logits so that its runs stay the
# planned ones (each run trains the other input too, coarse_alt: the paper's probabilities are the row beside it).
PAGE_INPUT = "coarse.input=logits"
LARGE_TRAIN, LARGE_SEEDS = 10000, (0, 1, 2)  # the larger-data point (MNIST 2x2/0)
CT64_SEEDS = (0, 1, 2)  # the 64³ row (--datasets adrenal3d_64)


def plan(args: argparse.Namespace) -> list[Dataset]:
    """The datasets of the page (``--tiny``: one small dataset, one epoch, the default methods)."""
    if args.tiny:
        tiny = ["data=digits", "model=vgg_tiny", *recipe(args), "methods=default", PAGE_INPUT, "report.plots=false"]
        tiny += ["methods.enabled.global_ensemble=true"]  # the k of the page's ensemble, fixed by a timing run
        tiny += ["methods.enabled.coarse_alt=false", "methods.enabled.coarse_val=false", "report.curves.enabled=false"]
        tiny += [f"data.val_target_fraction={args.val_target_fraction}"] if args.val_target_fraction else []
        if args.train_subset:
            tiny.append(f"data.train_subset={args.train_subset}")
        return [Dataset("digits", "Digits (tiny mode)", tuple(tiny), ("2x2",), (0, 2), auc_table=True, ensemble=True)]
    subset = [f"data.test_subset={args.test_subset}"] if args.test_subset else []
    # The methods that bear on the primary comparisons (docs/protocol.md section 5a): the CNN-DNN on the local logits
    # (PAGE_INPUT) and, as the paper's row beside it, on probabilities (coarse_alt), the averaging combiners,
    # the stacker, the validation-fit coarse DNN, DDP, the equal-time ensemble of global CNNs (by mean probability and
    # by the coarse fit) and, at 2x2 (2x2x2), the global CNN of the CNN-DNN's parameter count. Left out on 2D since
    # issue 44: local_oof, e2e, transfer and global_transfer (a third of a run's CPU; none is a primary comparison).
    arms = ["methods=default", PAGE_INPUT, *(f"methods.enabled.{m}=true" for m in PAGE_ARMS)]
    two_d = ["model=vgg_small", *arms, *recipe(args), *subset]
    two_d += [f"data.val_fraction={args.val_fraction}", f"data.batch_size={args.batch_size}"]
    two_d += [f"data.val_target_fraction={args.val_target_fraction}"] if args.val_target_fraction else []
    two_d += [f"report.curves.points={args.curve_points}"]
    wide = (("2x2", ("methods.enabled.global_wide=true",)),)
    train = [f"data.train_subset={args.train_subset}"] if args.train_subset else []

    def two_d_set(key: str, title: str, experiment: str, **extra) -> Dataset:
        sizes = extra.pop("train", train)
        return Dataset(
            key,
            title,
            (f"experiment={experiment}", *two_d, *sizes),
            ("2x2", "4x4"),
            (0, 2),
            grid_overrides=wide,
            ensemble=True,
            **extra,
        )

    # AdrenalMNIST3D's 98 validation volumes are too few to halve: the target split comes out of training
    target_3d = (
        [f"data.val_target_fraction={args.val_target_fraction_3d}", "data.val_target_from=train"]
        if args.val_target_fraction_3d
        else []
    )
    datasets = {
        "mnist": two_d_set("mnist", "MNIST", "mnist"),
        "fashion_mnist": two_d_set("fashion_mnist", "Fashion-MNIST", "fashion_mnist"),
        # the larger-data point: MNIST 2x2, overlap 0, at 10,000 training images, 3 seeds
        "mnist_10k": dataclasses.replace(
            two_d_set(
                "mnist_10k",
                f"MNIST, {LARGE_TRAIN} training images",
                "mnist",
                train=[f"data.train_subset={LARGE_TRAIN}"],
            ),
            grids=("2x2",),
            overlaps=(0,),
            seeds=LARGE_SEEDS,
            primary="mnist_10k" not in SECONDARY_DATASETS,
        ),
        # Its recipe's cosine schedule over 12 epochs, never cut short: no early stopping (engine.patience=null).
        "adrenal3d": Dataset(
            "adrenal3d",
            "AdrenalMNIST3D 28³",
            (
                "experiment=adrenal3d",
                *arms,
                "methods.enabled.global_wide=true",
                "engine.patience=null",
                # batch norm's running statistics lag the 3D nets' weights (validation loss spiking on a smooth
                # training loss, issue #45): every net's recomputed from 50 training batches before each validation
                # (stated: what its runs trained with, before the default on volumes became 10; on the command line)
                "engine.precise_bn=50",
                # the global CNN's own learning rate, 0.001 (the recipe's 0.002 x 0.5), by its sweep (protocol 5b)
                "global_lr_scale=0.5",
                f"report.curves.points={args.curve_points}",
                *target_3d,
            ),
            ("2x2x2",),
            (None,),
            auc_table=True,
            published=PUBLISHED_3D,
            ensemble=True,
        ),
        # Issue #47 item 5, opt-in (--datasets adrenal3d_64): the CT row at 64³, where a local net saves more than
        # at 28³. The recipe of experiment=adrenal3d (half-width 3D VGG, cosine over 12 epochs, selection on the
        # validation loss) at overlap 2 (33³ sub-volumes), all training volumes but the target split, 3 seeds, the
        # global DDP on the first; within 10 CPU-hours there is no room for the equal-time ensemble (k >= 2 global
        # CNNs a seed) nor the wide global CNN.
        "adrenal3d_64": Dataset(
            "adrenal3d_64",
            "AdrenalMNIST3D 64³",
            (
                "experiment=adrenal3d",
                "data=adrenal3d_64",
                "methods=default",
                PAGE_INPUT,
                "engine.patience=null",
                "engine.precise_bn=50",
                f"report.curves.points={args.curve_points}",
                *target_3d,
            ),
            ("2x2x2",),
            (2,),
            auc_table=True,
            seeds=CT64_SEEDS,
            seed_overrides=((CT64_SEEDS[0], ("methods.enabled.global_ddp=true",)),),
            primary="adrenal3d_64" not in SECONDARY_DATASETS,
        ),
    }
    unknown = [d for d in args.datasets if d not in datasets]
    if unknown:
        raise SystemExit(f"results.py: unknown dataset(s) {unknown}; choose from {sorted(datasets)}")
    return [datasets[d] for d in args.datasets]


def dataset_seeds(dataset: Dataset, seeds: list[int]) -> list[int]:
    """The seeds ``dataset`` runs at: ``seeds`` (``--seeds``), within its own where it has them (``mnist_10k``)."""
    return [s for s in seeds if dataset.seeds is None or s in dataset.seeds]


def run_specs(datasets: list[Dataset], seeds: list[int]) -> list[RunSpec]:
    # Seed-major: the first pass gives one seed of everything (a usable page if time runs out).
    for d in datasets:
        if mine := dataset_seeds(d, seeds):
            _FIRST_SEED[d.key] = mine[0]
    return [
        RunSpec(d, g, o, s)
        for s in seeds
        for d in datasets
        if s in dataset_seeds(d, seeds)
        for g in d.grids
        for o in d.overlaps
    ]


def phases(specs: list[RunSpec]) -> list[tuple[str, list[RunSpec]]]:
    """The order of the runs: per seed, first its timing runs, then the rest.

    The timing run of a dataset and seed is its first run: it trains the global CNN and the global DDP (2 processes),
    which every other run of that dataset and seed copies from the store, and its own local nets, so it runs with
    ``--timing-jobs`` (default 1: alone, its clocks not shared with another training). The other runs train only
    decomposition-dependent stages and may share the cores (``--jobs``).
    """
    ordered: list[tuple[str, list[RunSpec]]] = []
    for seed in dict.fromkeys(s.seed for s in specs):
        mine = [s for s in specs if s.seed == seed]
        first = {s.dataset.key: s for s in reversed(mine)}
        timing = [s for s in mine if first[s.dataset.key] is s]
        ordered += [("timing", timing), ("accuracy", [s for s in mine if s not in timing])]
    return [(phase, runs) for phase, runs in ordered if runs]


# --- running ------------------------------------------------------------------------------------------------------
def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


# Seconds between two samples of a training's CPU (:func:`_wait`): what an invocation stopped part-way loses at most.
SAMPLE_S = 30.0
# In a run directory: the CPU of the invocations that trained it part-way and were stopped, each sampled every
# SAMPLE_S seconds; the invocation that finishes the run adds them to its record (:func:`train`).
LEDGER = ".invocations.json"


def tree_cpu(pid: int) -> float | None:
    """CPU seconds (user + sys) so far of process ``pid`` and its descendants: the live ones' own, the ended ones'
    through the children times of the process that waited for them; ``None`` without Linux's ``/proc``."""
    if not Path(f"/proc/{pid}/stat").is_file():
        return None
    ticks, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime (proc(5) fields 14-17)
            todo += [
                int(c) for task in Path(f"/proc/{p}/task").iterdir() for c in (task / "children").read_text().split()
            ]
        except (OSError, ValueError, IndexError):  # ended meanwhile
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def _wait(
    proc: subprocess.Popen, timeout_s: float | None, progress: Callable[[float], None] | None = None
) -> tuple[int, float]:
    """Wait for ``proc`` (killed after ``timeout_s``); its exit code and the CPU seconds (user + sys) of it and the
    children it waited for, its own rusage, so that runs in parallel each count only their own. Meanwhile
    ``progress(cpu_so_far)`` every :data:`SAMPLE_S` seconds."""
    timer = threading.Timer(timeout_s, proc.kill) if timeout_s else None
    if timer is not None:
        timer.start()
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_S):
            cpu = tree_cpu(proc.pid)
            if cpu is not None and not done.is_set():
                progress(cpu)

    sampler = threading.Thread(target=sample, daemon=True) if progress is not None else None
    if sampler is not None:
        sampler.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        done.set()
        if timer is not None:
            timer.cancel()
        if sampler is not None:
            sampler.join()
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
    a snapshot folder is whole or absent. Besides its files (:data:`SNAPSHOT_FILES`, the stages' meta.json and logs),
    every method's per-image test predictions, compactly (``predictions_test.pt``: :mod:`ddcnn.report.predictions`)."""
    partial = snapshot.with_name(snapshot.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    stage_files = [
        p.relative_to(run_dir).as_posix()
        for name in SNAPSHOT_STAGE_FILES
        for p in sorted(run_dir.rglob(Path(name).name))
        if p.relative_to(run_dir).as_posix().endswith(name) and p.parent != run_dir
    ]
    for file in (*SNAPSHOT_FILES, *SNAPSHOT_EXTRA, *stage_files):
        if (run_dir / file).is_file():
            (partial / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / file, partial / file)
    from ddcnn.report.predictions import PREDICTIONS_FILE, write_compact_predictions
    from ddcnn.rundir import RunDir

    # Every method's per-image test predictions, compactly (paired tests over test images need them): written from the
    # run's probs_test.pt files, or kept from a snapshot that was restored as the run directory.
    if (run_dir / PREDICTIONS_FILE).is_file():
        shutil.copy2(run_dir / PREDICTIONS_FILE, partial / PREDICTIONS_FILE)
    elif RunDir(run_dir).is_done("local", 0):  # a snapshot of a page from before them has no test outputs to keep
        write_compact_predictions(run_dir, partial / PREDICTIONS_FILE)
    shutil.rmtree(snapshot, ignore_errors=True)
    partial.rename(snapshot)


def planned_command(spec: RunSpec, workdir: Path) -> str:
    """The ``ddcnn-train`` command line of ``spec`` as its ``experiment_run.json`` records it."""
    overrides = spec.overrides(workdir)
    return "ddcnn-train " + " ".join(shlex.quote(o) for o in overrides) + f" hydra.run.dir={spec.name}"


def command_differences(recorded: str, planned: str, config: Path | None = None) -> list[str]:
    """The overrides in which a run's recorded command and the planned one differ (``key: recorded -> planned``),
    the store's folder left out (:func:`_portable`). With the run's ``config.yaml`` (``config``), an override the
    planned command adds (the recorded one did not set it) is no difference where the run trained with that value
    anyway: the page's command now states a setting whose default changed since (``engine.min_steps=0``: a run
    recorded before the setting existed trained without it, :data:`ddcnn.rundir.RECORD_ABSENT_MEANS`)."""

    def settings(command: str) -> dict[str, str]:
        parts = shlex.split(_portable(command))[1:]
        return dict(part.split("=", 1) if "=" in part else (part, "") for part in parts)

    old, new = settings(recorded), settings(planned)
    trained = _trained_with(config) if config is not None and config.is_file() else None
    return [
        f"{key}: {old.get(key, '(not set)')} -> {new.get(key, '(not set)')}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key) and not (trained is not None and key not in old and trained(key, new[key]))
    ]


def _trained_with(config: Path) -> Callable[[str, str], bool]:
    """Whether the run of ``config`` (its recorded ``config.yaml``) trained with setting ``key`` at the override value
    ``value`` (read as YAML; a value Hydra's grammar writes otherwise, a dict say, never matches): its recorded value,
    or where the record holds no such key, what an absent key means (``RECORD_ABSENT_MEANS``)."""
    import yaml

    from ddcnn.rundir import RECORD_ABSENT_MEANS

    record = yaml.safe_load(config.read_text()) or {}
    absent = object()

    def recorded(key: str):
        node = record
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return RECORD_ABSENT_MEANS.get(key, absent)
            node = node[part]
        return node

    def same(key: str, value: str) -> bool:
        try:
            planned = yaml.safe_load(value)
        except yaml.YAMLError:
            return False
        return not isinstance(planned, (dict, list)) and recorded(key) == planned

    return same


def stale_runs(specs: list[RunSpec], workdir: Path) -> dict[str, list[str]]:
    """The finished run directories of ``specs`` under ``workdir`` that were trained with another command than the
    one planned now (another ``--epochs``, say): per run, how they differ."""
    stale = {}
    for spec in specs:
        record = workdir / spec.name / "experiment_run.json"
        if _finished(workdir / spec.name):
            differ = command_differences(
                json.loads(record.read_text()).get("command", ""),
                planned_command(spec, workdir),
                workdir / spec.name / "config.yaml",
            )
            if differ:
                stale[spec.name] = differ
    return stale


def stale_message(stale: dict[str, list[str]], workdir: Path) -> str:
    name, differ = next(iter(stale.items()))
    return (
        f"results.py: {len(stale)} finished run(s) under --workdir {workdir} were trained with other settings than "
        f"this invocation plans, e.g. {name}: {'; '.join(differ)}. Their results would be published under this "
        "command: add --retrain to train them again with the planned settings, give another --workdir, or run with "
        "the flags they were made with (each run's command is in its experiment_run.json)."
    )


def train(
    spec: RunSpec,
    workdir: Path,
    threads: int,
    timeout_s: float | None,
    log,
    snapshots: Path | None = None,
    retrain: bool = False,
    context: dict | None = None,
) -> dict:
    """Train one run directory (or reuse it when it holds ``results.json`` of the planned command, or restore it from
    its snapshot under ``snapshots`` when only that is left: a committed, unfinished invocation); its record (times,
    command, ``context``: the invocation, its jobs, the machine). A run trained here is snapshotted under
    ``snapshots`` at once, so that committing ``OUT/results/runs`` keeps it.

    A finished run directory or snapshot of another command is never passed off as one of the planned command: a
    snapshot is trained again, a run directory too with ``retrain`` and refused (:func:`stale_message`) without it.
    """
    run_dir = workdir / spec.name
    record_file = run_dir / "experiment_run.json"
    command = planned_command(spec, workdir)
    if _finished(run_dir):
        record = json.loads(record_file.read_text())
        differ = command_differences(record.get("command", ""), command, run_dir / "config.yaml")
        if not differ:
            log(f"{spec.name}: finished earlier ({record.get('wall_s', 0):.0f} s wall), reused")
            return record
        if not retrain:
            raise SystemExit(stale_message({spec.name: differ}, workdir))
        log(f"{spec.name}: trained earlier with other settings ({'; '.join(differ)}); --retrain: training it again")
        shutil.rmtree(run_dir)
    if snapshots is not None and _finished(snapshots / spec.name):
        saved = json.loads((snapshots / spec.name / "experiment_run.json").read_text())
        differ = command_differences(saved.get("command", ""), command, snapshots / spec.name / "config.yaml")
        if not differ:
            shutil.rmtree(run_dir, ignore_errors=True)  # a half-finished training of it: the snapshot is finished
            shutil.copytree(snapshots / spec.name, run_dir)
            log(f"{spec.name}: restored from its snapshot {snapshots / spec.name} (trained at {saved.get('commit')})")
            return saved
        log(f"{spec.name}: its snapshot was run with other settings ({'; '.join(differ)}); training it again")
    cmd = [*_entry("ddcnn-train"), *spec.overrides(workdir), f"hydra.run.dir={run_dir}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    load_before, started = _loadavg(), time.time()
    ledger = run_dir / LEDGER
    earlier = json.loads(ledger.read_text()) if ledger.is_file() else []
    this = {"started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds")}

    def progress(cpu: float) -> None:  # what a stop before the end leaves for the invocation that finishes the run
        this.update(wall_s=round(time.time() - started, 1), cpu_s=round(cpu, 1))
        from ddcnn.io import atomic_write_text

        atomic_write_text(ledger, json.dumps([*earlier, this], indent=1) + "\n")

    with open(run_dir.parent / f"{run_dir.name}.log", "a") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(threads), stdout=out, stderr=subprocess.STDOUT)
        code, cpu = _wait(proc, timeout_s, progress)
    wall = time.time() - started
    if code != 0 or not (run_dir / "results.json").is_file():
        tail = (run_dir.parent / f"{run_dir.name}.log").read_text().splitlines()[-20:]
        raise RuntimeError(f"ddcnn-train failed for {spec.name} (exit {code}):\n" + "\n".join(tail))
    record = {
        "command": command,
        "commit": _git_commit(),
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu + sum(e.get("cpu_s", 0.0) for e in earlier), 1),  # with the stopped invocations'
        "load_before": load_before,
        "load_after": _loadavg(),
        "threads": threads,
        **({"earlier_invocations": earlier} if earlier else {}),
        **(context or {}),
    }
    record_file.write_text(json.dumps(record, indent=1) + "\n")
    ledger.unlink(missing_ok=True)
    if snapshots is not None:
        save_snapshot(run_dir, snapshots / spec.name)
    return record


def report(specs: list[RunSpec], workdir: Path, threads: int, plots: bool) -> Path:
    """``ddcnn-report`` over each page dataset's runs on its own, into ``workdir/report/<dataset key>/``: two page
    datasets of one data source (MNIST and the larger-data point ``mnist_10k``) would otherwise share one report
    table, which the page's per-dataset tables (:func:`report_lines`) never equal."""
    out = workdir / "report"
    for key in dict.fromkeys(s.dataset.key for s in specs):
        names = [str(workdir / s.name) for s in specs if s.dataset.key == key]
        cmd = [*_entry("ddcnn-report"), *names, "--out", str(out / key), *([] if plots else ["--no-plots"])]
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(threads), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ddcnn-report of {key} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
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


def _coarse_input(results: dict) -> str:
    """The input a run's coarse DNN trained on (``results.json`` ``coarse_input``; a run from before it: probs)."""
    return (results.get("coarse_input") or {}).get("coarse", "probs")


def _cnn_dnn_key(run) -> str:
    """The results key of the run's CNN-DNN row (its coarse DNN's input)."""
    return f"cnn_dnn_{_coarse_input(run.results)}"


def paired_table(root: Path, names: list[str], pairs: tuple | None = None) -> list[dict]:
    """The paired differences of the runs ``names`` (one dataset) as ``ddcnn-report`` computes them
    (:func:`ddcnn.report.compare.paired_rows`: per configuration and comparison of ``pairs``, by default
    :data:`ddcnn.report.stats.PAIRS`, test accuracy in points paired by seed, mean, 95% t-interval, verdict)."""
    from ddcnn.report.compare import paired_rows
    from ddcnn.report.stats import PAIRS

    tables = paired_rows(_load_runs(root, names), pairs=PAIRS if pairs is None else pairs)
    return [row for rows in tables.values() for row in rows]


def paired_lines(root: Path, names: list[str]) -> list[str]:
    """The lines of the report's "Paired differences" table of the runs ``names`` (one dataset), as ``ddcnn-report``
    writes it after the dataset's first table (:func:`ddcnn.report.compare.paired_markdown`); empty without pairs."""
    from ddcnn.report.compare import paired_markdown

    rows = paired_table(root, names)
    return paired_markdown(rows).splitlines() if rows else []


POOLED_HEAD = (
    "| difference | seeds | configurations | mean ± std over the seeds (points) | 95% interval (points) | p "
    "| Holm-adjusted p | verdict |"
)


def pooled_rows(root: Path, names: list[str], pairs: tuple | None = None) -> list[dict]:
    """Per comparison of ``pairs`` (by default :data:`ddcnn.report.stats.PAIRS`), the dataset's difference averaged
    over its configurations (backbone, grid, overlap) within each seed, then paired by seed as the paired table is:
    one interval for the dataset where the paired table has one per configuration (section 5 of the protocol). Only
    seeds that hold every configuration count; a seed's first run counts where it has several. Empty where the runs
    hold fewer than two configurations (the paired table is already the dataset's). Rows keyed as
    :func:`paired_table`'s, with ``configurations``."""
    from ddcnn.report.compare import CONFIGURATION_FREE, holm_adjust, paired_columns
    from ddcnn.report.stats import PAIRS, all_converged, paired_difference

    runs = sorted(_load_runs(root, names), key=lambda r: str(r.path))
    rows = []
    for what, method, baseline, training in PAIRS if pairs is None else pairs:
        if (method, baseline) in CONFIGURATION_FREE:  # one comparison whatever the grid: the paired table's one row
            continue
        per_seed: dict[int, dict[tuple, float]] = {}
        states = []
        for run in runs:
            acc = run.results.get("accuracy") or {}
            if acc.get(method) is None or acc.get(baseline) is None:
                continue
            config = (run.backbone, run.grid_label, run.overlap_label)
            per_seed.setdefault(run.seed, {}).setdefault(config, 100 * (acc[method] - acc[baseline]))
            states.append(run.converged(training))
        configs = set().union(*per_seed.values())
        seeds = sorted(seed for seed, diffs in per_seed.items() if set(diffs) == configs)
        if len(configs) < 2 or not seeds:
            continue
        means = [sum(per_seed[s].values()) / len(configs) for s in seeds]
        stats = paired_difference(means, all_converged(states), seeds)
        rows.append({**paired_columns(what, method, baseline, stats), "configurations": len(configs)})
    holm_adjust(rows)
    return rows


def pooled_lines(root: Path, names: list[str]) -> list[str]:
    """The table of :func:`pooled_rows` of the runs ``names`` (their p Holm-adjusted over its rows)."""
    return pooled_markdown(pooled_rows(root, names))


def pooled_markdown(rows: list[dict]) -> list[str]:
    """The lines of a table of :func:`pooled_rows` (empty without rows)."""
    lines = []
    for row in rows:
        spread = f"{row['mean_points']:+.2f}" + ("" if row["std_points"] is None else f" ± {row['std_points']:.2f}")
        low, high = row["ci_low_points"], row["ci_high_points"]
        interval = "-" if low is None else f"[{low:+.2f}, {high:+.2f}]"
        cells = [row["comparison"], str(row["n"]), str(row["configurations"]), spread, interval]
        cells += ["-" if row[k] is None else f"{row[k]:.2g}" for k in ("p", "p_holm")] + [row["verdict"]]
        lines.append("| " + " | ".join(cells) + " |")
    return [POOLED_HEAD, "|" + "---|" * (POOLED_HEAD.count("|") - 1), *lines] if lines else []


def secondary_tables(root: Path, family: list[str], primary: list[str]) -> dict[str, tuple[list[str], list[str]]]:
    """Per dataset (key) of the page's runs ``family``, the lines of its paired table (per configuration, as
    ``ddcnn-report`` has them) and of its table over the configurations (:func:`pooled_lines`), their p Holm-adjusted
    over every row of both tables of every dataset: the page's secondary family (docs/protocol.md 5a). A comparison
    that the primary table prints (``primary``: its lines) is left out of the table over the configurations, where it
    would be printed twice; the per-configuration rows stay (secondary)."""
    from ddcnn.report.compare import holm_adjust, paired_markdown

    labels = {label: (method, baseline) for label, method, baseline, _ in PRIMARY}
    printed = set()
    for line in primary[2:]:
        dataset, comparison = (cell.strip() for cell in line.strip("|").split("|")[:2])
        if comparison in labels:
            printed.add((dataset, *labels[comparison]))
    by_dataset: dict[str, list[str]] = {}
    for name in family:
        by_dataset.setdefault(_dataset_of(name), []).append(name)
    tables = {
        key: (
            paired_table(root, names),
            [r for r in pooled_rows(root, names) if (key, r["method_key"], r["baseline_key"]) not in printed],
        )
        for key, names in by_dataset.items()
    }
    holm_adjust([row for paired, pooled in tables.values() for row in (*paired, *pooled)])
    return {
        key: (paired_markdown(paired).splitlines() if paired else [], pooled_markdown(pooled))
        for key, (paired, pooled) in tables.items()
    }


# The page's primary comparisons (docs/protocol.md section 5a): (label, method, baseline, the training whose
# convergence is the baseline's), keys of a run's compact test predictions (``cnn_dnn``: the run's main coarse DNN).
PRIMARY = (
    ("CNN-DNN − global CNN", "cnn_dnn", "global", "global"),
    ("CNN-DNN − equal-time ensemble of global CNNs", "cnn_dnn", "global_ensemble", "global_ensemble"),
    ("CNN-DNN − mean probability", "cnn_dnn", "mean_prob", "local"),
)
# Where balanced accuracy and ROC AUC are primary beside accuracy (docs/protocol.md 5a: AdrenalMNIST3D, whose majority
# class is 77%; and the 64³ row of issue #47), the same three comparisons of each, in points of the metric (x 100).
# The trainings the method under test of :data:`PRIMARY` builds on (the CNN-DNN at the default ``coarse.input``: every
# local net and the coarse DNN on their logits): a run where one of them did not converge is named beside the verdict.
METHOD_TRAININGS = {"cnn_dnn": ("local", "coarse")}
PRIMARY_METRICS = {"adrenal3d": ("balanced_accuracy", "auc"), "adrenal3d_64": ("balanced_accuracy", "auc")}
METRIC_LABELS = {"balanced_accuracy": "balanced accuracy", "auc": "AUC x 100"}
PRIMARY_HEAD = (
    "| dataset | comparison | seeds | configurations | test images | difference (points) | 95% interval over seeds "
    "and test images (points) | 95% t-interval over seeds (points) | p | Holm-adjusted p | verdict |"
)
# The seeds a headline verdict needs (docs/protocol.md 5a, "What a verdict requires"); a row of fewer says so.
HEADLINE_SEEDS = 5


def _compact(predictions: dict, key: str, field: str):
    """Method ``key``'s (the run's main coarse DNN for ``cnn_dnn``) compact test ``field`` (``pred``, ``prob1``)."""
    entry = predictions["methods"].get(predictions["aliases"].get(key, key))
    return None if entry is None or field not in entry else entry[field].numpy()


def _correct(predictions: dict, key: str):
    """Per test image, whether method ``key`` (or the run's main coarse DNN for ``cnn_dnn``) predicted its label."""
    pred = _compact(predictions, key, "pred")
    return None if pred is None else pred == predictions["labels"].numpy()


def _stacked(grid: list[list[dict]], key: str, field: str):
    """Method ``key``'s compact test ``field`` of each run of ``grid`` (per seed, per configuration: compact
    predictions) as one array (seeds, configurations, images); None where a run lacks it."""
    import numpy as np

    got = [[_compact(pred, key, field) for pred in row] for row in grid]
    return None if any(g is None for row in got for g in row) else np.stack([np.stack(row) for row in got])


# primary_rows of one set of run directories, by what they hold (:func:`_run_stamps`): the bootstrap is the slow part
# of a check, which needs the rows for the page's table and for README's summary alike
_PRIMARY_ROWS: dict[tuple, list[dict]] = {}


def _run_stamps(root: Path, names: list[str]) -> tuple:
    """Every file of the run directories ``names`` under ``root``, with its size and modification time: a key that
    changes when anything a run's figures are read from changes."""
    stamps = []
    for name in sorted(names):
        for path in sorted((root / name).rglob("*")):
            if path.is_file():
                stat = path.stat()
                stamps.append((path.relative_to(root).as_posix(), stat.st_size, stat.st_mtime_ns))
    return tuple(stamps)


def primary_rows(root: Path, names: list[str]) -> list[dict]:
    """:func:`compute_primary_rows`, computed once per state of the run directories in this process."""
    import copy

    key = (str(Path(root).resolve()), _run_stamps(root, names))
    if key not in _PRIMARY_ROWS:
        _PRIMARY_ROWS[key] = compute_primary_rows(root, names)
    return copy.deepcopy(_PRIMARY_ROWS[key])


def compute_primary_rows(root: Path, names: list[str]) -> list[dict]:
    """The page's primary verdicts (docs/protocol.md section 5a): per dataset and comparison of :data:`PRIMARY`, the
    per-seed difference of test accuracy averaged over the dataset's configurations (and of balanced accuracy and AUC
    where :data:`PRIMARY_METRICS` names them), with a two-level paired bootstrap over seeds and test images
    (:func:`ddcnn.report.stats.two_level_bootstrap`, ``two_level_bootstrap_metric``; seeded 0), its p-value
    Holm-adjusted over the whole family (every row of every dataset: :func:`ddcnn.report.stats.holm`), and the verdict
    with the equivalence margin. Only seeds that hold every configuration count, and only runs whose snapshot kept its
    test predictions (``predictions_test.pt``) on the same test images; a baseline that did not converge in any of
    the runs counted gives no verdict, and the runs counted where the method under test holds an unconverged training
    (:data:`METHOD_TRAININGS`) are named beside its verdict, which they may have moved either way."""
    import numpy as np

    from ddcnn.report.compare import load_run
    from ddcnn.report.predictions import PREDICTIONS_FILE, compact_test_predictions, read_compact_predictions
    from ddcnn.report.stats import (
        BASELINE_NOT_CONVERGED,
        EQUIVALENCE_MARGIN_POINTS,
        all_converged,
        holm,
        holm_verdict,
        paired_difference,
        two_level_bootstrap,
        two_level_bootstrap_metric,
    )
    from ddcnn.rundir import RunDir

    def predictions(run_dir: Path) -> dict | None:  # a snapshot's file, or made from a run directory's outputs
        if (run_dir / PREDICTIONS_FILE).is_file():
            return read_compact_predictions(run_dir / PREDICTIONS_FILE)
        if RunDir(run_dir).is_done("local", 0):  # a run directory (a snapshot of before them has no test outputs)
            made = compact_test_predictions(run_dir)
            methods = {k: {**v, "pred": v["pred"].long()} for k, v in made["methods"].items()}
            return {**made, "labels": made["labels"].long(), "methods": methods}
        return None

    # per dataset, per (seed, configuration): the first run's compact test predictions and the run
    by_dataset: dict[str, dict[tuple[int, str], tuple]] = {}
    for name in sorted(names):
        if (pred := predictions(root / name)) is not None:
            run = load_run(root / name)
            config = name.split("/", 1)[1].rsplit("_s", 1)[0]
            by_dataset.setdefault(_dataset_of(name), {}).setdefault((run.seed, config), (pred, run))
    rows = []
    for key, cells in by_dataset.items():
        if len({tuple(pred["labels"].tolist()) for pred, _ in cells.values()}) != 1:
            continue  # test images that differ between runs (test subsets): no pairing over images
        labels = next(iter(cells.values()))[0]["labels"].numpy()
        for what, method, baseline, training in PRIMARY:
            held = {
                cell: (pred, run)
                for cell, (pred, run) in cells.items()
                if _correct(pred, method) is not None and _correct(pred, baseline) is not None
            }
            configs = sorted({config for _, config in held})
            seeds = sorted({seed for seed, _ in held if all((seed, c) in held for c in configs)})
            if not seeds:
                continue
            grid = [[held[seed, config][0] for config in configs] for seed in seeds]  # (seeds, configurations)
            a, b = ((_stacked(grid, k, "pred") == labels).astype(np.int8) for k in (method, baseline))
            boots = [(what, two_level_bootstrap((a - b).mean(axis=1)))]
            for metric in PRIMARY_METRICS.get(key, ()):
                scores = [_stacked(grid, k, "prob1" if metric == "auc" else "pred") for k in (method, baseline)]
                if all(score is not None for score in scores):
                    comparison = f"{what} ({METRIC_LABELS[metric]})"
                    boots.append((comparison, two_level_bootstrap_metric(metric, labels, *scores)))
            counted = [held[seed, config][1] for seed in seeds for config in configs]
            converged = all_converged([run.converged(training) for run in counted])
            method_unconverged = [
                f"{run.path.parent.name}/{run.path.name}"
                for run in counted
                if all_converged([run.converged(t) for t in METHOD_TRAININGS[method]]) is False
            ]
            for comparison, boot in boots:
                rows.append(
                    {
                        "dataset": key,
                        "comparison": comparison,
                        "seeds": len(seeds),
                        "configurations": len(configs),
                        "images": boot["images"],
                        "difference": 100 * boot["difference"],
                        "low": 100 * boot["low"],
                        "high": 100 * boot["high"],
                        "p": boot["p"],
                        "t_interval": paired_difference([100 * v for v in boot["per_seed"]]),
                        "converged": converged,
                        "method_unconverged": method_unconverged,
                        "runs": len(counted),
                    }
                )
    for row, adjusted in zip(rows, holm([row["p"] for row in rows]), strict=True):
        row["p_holm"] = adjusted
        row["verdict"] = (
            BASELINE_NOT_CONVERGED
            if row["converged"] is False
            else holm_verdict(row["low"], row["high"], adjusted, EQUIVALENCE_MARGIN_POINTS)
        )
        if row["seeds"] < HEADLINE_SEEDS and row["verdict"] != BASELINE_NOT_CONVERGED:
            row["verdict"] += f" ({row['seeds']} of the {HEADLINE_SEEDS} seeds a headline needs)"
        if unconverged := row["method_unconverged"]:  # the method under test is flagged where its verdict is read
            row["verdict"] += (
                f"; the CNN-DNN holds an unconverged training in {len(unconverged)} of its {row['runs']} runs "
                f"({', '.join(unconverged)})"
            )
    return rows


def primary_lines(root: Path, names: list[str]) -> list[str]:
    """The page's table of :func:`primary_rows` (empty without rows)."""
    lines = [
        "| "
        + " | ".join(
            [
                row["dataset"],
                row["comparison"],
                str(row["seeds"]),
                str(row["configurations"]),
                f"{row['images']:,}",
                f"{row['difference']:+.2f}",
                f"[{row['low']:+.2f}, {row['high']:+.2f}]",
                (
                    f"[{row['t_interval']['low']:+.2f}, {row['t_interval']['high']:+.2f}]"
                    if row["t_interval"]["low"] is not None
                    else row["t_interval"]["verdict"]
                ),
                f"{row['p']:.2g}",
                f"{row['p_holm']:.2g}",
                row["verdict"],
            ]
        )
        + " |"
        for row in primary_rows(root, names)
    ]
    return [PRIMARY_HEAD, "|" + "---|" * (PRIMARY_HEAD.count("|") - 1), *lines] if lines else []


def lead_cell(row: dict | None) -> str:
    """One paired difference in a cell of the glance table: the mean difference in points, its 95% interval and the
    verdict of :mod:`ddcnn.report.stats` (the verdict the paired table prints: ``baseline not converged`` where the
    baseline of any seed did not converge, ``(convergence unknown)`` added where the runs did not record it)."""
    from ddcnn.report.stats import NO_VERDICT

    if row is None:
        return "-"
    verdict = row["verdict"]
    if row["baseline_converged"] == "unknown" and verdict not in NO_VERDICT:
        verdict += " (convergence unknown)"
    if row["ci_low_points"] is None:
        return f"{row['mean_points']:+.2f} ({verdict})"
    return f"{row['mean_points']:+.2f} [{row['ci_low_points']:+.2f}, {row['ci_high_points']:+.2f}] {verdict}"


def glance_lines(root: Path, names: list[str]) -> list[str]:
    """The summary table of the runs ``names`` (one dataset): per backbone, grid and overlap, the test accuracy of
    the global CNN, the CNN-DNN, the mean probability and the majority vote (mean ± std over the seeds, as the
    report's table has them), the CNN-DNN's lead over the mean probability and over the global CNN paired by seed
    with its 95% interval and verdict (the report's paired rows, :func:`paired_table`), and the most accurate method
    of the family."""
    from ddcnn.report.compare import _accuracy, comparison_rows
    from ddcnn.report.stats import PAIRS

    runs = _load_runs(root, names)
    (rows,) = comparison_rows(runs).values()
    pairs: dict[tuple, list[dict]] = {}
    for row in paired_table(root, names):
        pairs.setdefault((row["backbone"], row["grid"], row["overlap"], row["comparison"]), []).append(row)
    labels = {(method, baseline): label for label, method, baseline, _ in PAIRS}
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
        for baseline in ("mean_prob", "global"):
            # one paired row per configuration; several (settings that split the runs) are in the paired table only
            found = pairs.get((*config, labels[("cnn_dnn", baseline)])) or []
            cells.append(lead_cell(found[0]) if len(found) == 1 else "-" if not found else "see the paired table")
        best = max(mine.values(), key=lambda r: r["accuracy_mean"])
        cells.append(f"{best['method']}: {_accuracy(best)}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


DEVICES_HEAD = (
    "| backbone | grid | overlap | seeds | devices P | global CNN on 1 device (s) | global CNN, DDP on P devices (s) "
    "| CNN-DNN projected on P devices (s) | CNN-DNN speedup over DDP on P devices |"
)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _by_devices(run) -> dict[int, float]:
    """The run's CNN-DNN projected time per device count (``projected_time_s_by_devices``; a key ``"N"`` is its
    number of sub-domains)."""
    times = run.results.get("projected_time_s_by_devices") or {}
    counts = {
        key: int(key) if str(key).isdigit() else math.prod(run.grid)
        for key in times
        if key == "N" or str(key).isdigit()
    }
    return {counts[key]: float(value) for key, value in times.items() if key in counts and value is not None}


def _ddp(run) -> tuple[int, float] | None:
    """The devices and the training time of the run's global DDP, if it has one."""
    time_s = (run.results.get("time_s") or {}).get("global_ddp")
    devices = (run.results.get("devices") or {}).get("global_ddp")
    return (int(devices), float(time_s)) if time_s is not None and devices else None


def devices_lines(root: Path, names: list[str]) -> list[str]:
    """The equal-devices table of the runs ``names`` (one dataset): per configuration and device count P, the global
    CNN on one device, DDP really run on P devices (where the run has it) and the CNN-DNN projected on P devices
    (``results.json`` ``projected_time_s_by_devices``: its local nets placed on P devices from their recorded times),
    means over the seeds, and DDP's time over the CNN-DNN's paired by seed. Empty when no run has the projection."""
    runs = [r for r in _load_runs(root, names) if _by_devices(r)]
    if not runs:
        return []
    groups: dict[tuple, list] = {}
    for run in sorted(runs, key=lambda r: (r.backbone, math.prod(r.grid), r.grid, r.overlap, r.seed)):
        groups.setdefault((run.backbone, run.grid_label, run.overlap_label), []).append(run)
    lines = [DEVICES_HEAD, "|" + "---|" * (DEVICES_HEAD.count("|") - 1)]
    for (backbone, grid, overlap), group in groups.items():
        single = [float(t) for run in group if (t := (run.results.get("time_s") or {}).get("global")) is not None]
        for devices in sorted({p for run in group for p in _by_devices(run)}):
            projected = {run.seed: t for run in group if (t := _by_devices(run).get(devices)) is not None}
            ddp = {run.seed: d[1] for run in group if (d := _ddp(run)) is not None and d[0] == devices}
            pairs = [ddp[seed] / projected[seed] for seed in ddp if projected.get(seed)]
            cells = [backbone, grid, overlap, str(len(group)), str(devices)]
            for values in (single, list(ddp.values()), list(projected.values())):
                mean = _mean(values)
                cells.append("-" if mean is None else f"{mean:.1f}")
            mean = _mean(pairs)
            cells.append("-" if mean is None else f"{mean:.2f}x (paired over {len(pairs)} seed(s))")
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


KEPT_LABELS = {"trained": "the trained DNN", "linear": "its linear path", "averaging": "averaging the local nets"}


def coarse_kept_lines(root: Path, names: list[str]) -> list[str]:
    """Per coarse stage of the runs ``names`` (the CNN-DNN at ``coarse.input``; the paper's probabilities beside it),
    which candidate its fit kept on validation (``meta.json`` ``fit.kept``, docs/coarse.md): where it kept averaging,
    the CNN-DNN's predictions are the mean probability's, and their difference is 0 by construction, not by
    measurement. Empty when no run records it."""
    lines = []
    for stage, label in (("coarse", "CNN-DNN"), ("coarse_alt", "CNN-DNN on the other coarse input")):
        kept: dict[str, list[str]] = {}
        for name in names:
            meta = root / name / stage / "meta.json"
            if meta.is_file():
                choice = (json.loads(meta.read_text()).get("fit") or {}).get("kept")
                if choice:
                    kept.setdefault(choice, []).append(name)
        if not kept:
            continue
        counts = ", ".join(f"{KEPT_LABELS.get(k, k)} in {len(v)}" for k, v in sorted(kept.items()))
        runs = sum(map(len, kept.values()))
        line = f"- {label} (`{stage}/meta.json` `fit.kept`), of {runs} run{'s' * (runs != 1)}: {counts}"
        averaged = kept.get("averaging", [])
        if averaged:
            shown = ", ".join(f"`{n}`" for n in averaged[:5]) + (", ..." if len(averaged) > 5 else "")
            line += (
                f"; where it kept averaging ({shown}) its predictions are the mean probability's, a difference of 0 "
                "to that row by construction"
            )
        lines.append(line + ".")
    return lines


def _machine() -> dict[str, str]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from ddcnn.runtime import cpu_capability

    return {
        "cpu": model,
        "cpu_capability": cpu_capability(),  # one model name, other vector instructions: other times and rounding
        "cores": str(os.cpu_count()),
        "system": f"{platform.system()} {platform.release()}",
    }


def _git_commit(root: Path = ROOT) -> str:
    """The checkout's commit, "(with uncommitted changes)" where a tracked file outside ``docs/`` differs from it:
    the page writes its snapshots into ``docs/`` of the checkout that trains it, which are not uncommitted code."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs"],
            cwd=root,
            capture_output=True,
        )
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


def runs_summary(root: Path, names: list[str]) -> dict:
    """What the runs ``names`` under ``root`` recorded of their training (``experiment_run.json``): count, CPU
    seconds, first start and last end, machines, load, commits, jobs, the invocations that trained them."""
    records = {n: json.loads((root / n / "experiment_run.json").read_text()) for n in names}
    starts = {n: datetime.fromisoformat(r["started"]) for n, r in records.items()}
    first = min(starts.values())
    last = max(starts[n].timestamp() + r["wall_s"] for n, r in records.items())
    loads = [float(r[k].split()[0]) for r in records.values() for k in ("load_before", "load_after") if r.get(k)]
    machines = sorted(
        {
            f"{m['cpu']}{f' ({isa})' if (isa := m.get('cpu_capability')) else ''}, {m['cores']} cores, {m['system']}"
            for r in records.values()
            if (m := r.get("machine"))
        }
    )
    jobs: dict[str, dict[int, int]] = {}
    for r in records.values():
        if "jobs" in r:
            counts = jobs.setdefault(r.get("phase", "all"), {})
            counts[r["jobs"]] = counts.get(r["jobs"], 0) + 1
    return {
        "records": records,
        "runs": len(records),
        "cpu_s": sum(r["cpu_s"] for r in records.values()),
        "first": first,
        "last_end": datetime.fromtimestamp(last, timezone.utc),
        "span_h": (last - first.timestamp()) / 3600,
        "machines": machines,
        "unrecorded_machine": sum("machine" not in r for r in records.values()),
        "load": (min(loads), max(loads)) if loads else None,
        "jobs": jobs,
        "unrecorded_jobs": sum("jobs" not in r for r in records.values()),
        "invocations": sorted({r["invocation"] for r in records.values() if r.get("invocation")}),
    }


def runs_overrides(root: Path, names: list[str]) -> str:
    """The ``ddcnn-train`` overrides that the runs ``names`` share, as their records give them (each run's grid,
    overlap, seed and folders left out)."""
    own = ("decomposition=", "decomposition.overlap=", "seed=", "hydra.run.dir=")
    commands = [
        shlex.split(_portable(json.loads((root / n / "experiment_run.json").read_text())["command"]))[1:] for n in names
    ]
    return " ".join(t for t in commands[0] if not t.startswith(own) and all(t in c for c in commands[1:]))


def training_header(root: Path, names: list[str], meta: dict[str, str]) -> list[str]:
    """The page's header table: the training of its runs (machine, load, dates, CPU, commits, jobs, the invocations
    that trained them), then the invocation that wrote the page, which may have only reused them."""
    runs = runs_summary(root, names)
    budget, why = page_budget(names)
    n = runs["runs"]
    machine = "; ".join(runs["machines"]) or "not recorded"
    if runs["machines"] and runs["unrecorded_machine"]:
        machine += f" ({runs['unrecorded_machine']} run(s) did not record theirs)"
    load = runs["load"]
    jobs = "; ".join(
        f"{phase} runs: " + ", ".join(f"{count} with {j} at a time" for j, count in sorted(counts.items()))
        for phase, counts in sorted(runs["jobs"].items(), key=lambda item: item[0] != "timing")
    )
    if runs["unrecorded_jobs"]:
        jobs = (jobs + "; " if jobs else "") + f"{runs['unrecorded_jobs']} run(s) did not record theirs"
    trained_by = ", ".join(f"`{c}`" for c in runs["invocations"]) or "not recorded"
    return [
        "| | |",
        "|---|---|",
        f"| machine of the runs | {machine} |",
        f"| torch threads per training | {_threads(root, names)} (`OMP_NUM_THREADS={meta['threads']}`) |",
        "| load of the runs (1 min) | "
        + (f"{load[0]:.2f} to {load[1]:.2f} at their starts and ends" if load else "not recorded")
        + " (each run's in `results/runs/*/experiment_run.json`) |",
        f"| training dates | {n} runs trained from {runs['first']:%Y-%m-%d %H:%M} to {runs['last_end']:%Y-%m-%d %H:%M} "
        f"UTC: {runs['span_h']:.2f} h from the first start to the last end |",
        f"| CPU | {runs['cpu_s']:.0f} s over the {n} runs (user + sys of their `ddcnn-train` processes, as each run "
        f"recorded it): {runs['cpu_s'] / 3600:.1f} of the {budget // 3600} CPU-hours the page may cost"
        + (f" (**over**: {why} says why)" if runs["cpu_s"] > budget else "")
        + " |",
        f"| code | {_commits_line(meta['commit'], runs['records'])} |",
        f"| jobs | {jobs} |",
        f"| runs trained by | {trained_by} |",
        f"| page written by | `{meta['command']}` at {meta['written']} in {meta['wall_s']} s (runs it found finished "
        "were reused) |",
        *([f"| **interim** | {meta['interim']} |"] if meta.get("interim") else []),
    ]


def write_page(
    datasets: list[Dataset], specs: list[RunSpec], workdir: Path, out: Path, meta: dict[str, str], tiny: bool
) -> tuple[str, dict]:
    """Write ``OUT/results.md``, ``OUT/results_manifest.json`` and ``OUT/results/`` (plots, run snapshots)."""
    assets = out / ASSETS
    snapshot = assets / "runs"
    names = [s.name for s in specs]
    # the snapshots are written beside the committed ones and replace them only when all are written: a failure
    # leaves the committed snapshots as they were (--rewrite reads them back through a copy)
    fresh = assets / "runs.partial"
    shutil.rmtree(fresh, ignore_errors=True)
    for name in names:
        (fresh / name).parent.mkdir(parents=True, exist_ok=True)
        save_snapshot(workdir / name, fresh / name)
    shutil.rmtree(snapshot, ignore_errors=True)
    fresh.rename(snapshot)
    head = training_header(workdir, names, meta)
    page = [
        "# Results: the CNN-DNN and its method family against the global CNN",
        "",
        f"Generated by `experiments/results.py`{' --tiny' if tiny else ''}; do not edit by hand: rerun it. Every "
        f"table line below is checked against the runs by `python experiments/results.py --check` (the manifest "
        f"`{MANIFEST}` lists every run directory, its fingerprint and the figures taken from it).",
        "",
        f"Every comparison on this page follows [the comparison protocol]({PROTOCOL_LINK}) (`docs/protocol.md`): "
        "differences paired by seed with their 95% interval and the verdict that follows it, times to a fixed "
        "target set by the global CNN alone, speedups at equal device counts, and no verdict against a baseline "
        "that did not converge.",
        "",
        *head,
        "",
        "**Training rule, one for every method.** Every training (local nets, out-of-fold local nets, global CNN, end"
        " to end, transfer, global transfer, global DDP) stops once its monitored validation metric "
        "(`engine.monitor`) has not improved by more than `engine.min_delta` for `engine.patience` epochs, counted "
        "from its kept epoch and, under the plateau scheduler, from its last drop of the rate (each rate gets "
        "`patience` epochs; runs of a ddcnn before that counted from the kept epoch only); not before "
        "`engine.min_epochs` epochs and `engine.min_steps` optimizer steps where the engine has them, and a stop that "
        "these held back waits while the training still improves (docs/protocol.md section 2); capped at "
        "`trainer.max_epochs` (all in each run's `config.yaml`; `engine.patience: null`: every epoch of the cap), and "
        "keeps the weights of its best epoch; "
        "every coarse DNN stops the same way after `coarse.patience` epochs. Where each training stopped is in its "
        "`meta.json` (`stopped_epoch` where early stopping ended it, `best_epoch` the epoch kept) and its epochs in "
        "`logs/metrics.csv`, both in the run's snapshot "
        "(`results/runs/<run>/<stage>/`; runs snapshotted before these files were kept have neither). The "
        "learning-rate schedule of every training is the `scheduler` of its `config.yaml` (MNIST and Fashion-MNIST: "
        "the rate multiplied by `factor` once the validation accuracy has not improved by more than its `threshold` "
        "for more than `patience` epochs, so that one noisy epoch makes the step smaller rather than ending the "
        "training; never below `min_lr` and not again for `cooldown` epochs after a drop, where the config sets "
        "them). Whether each training converged is its `meta.json` `convergence` record, by the test of section 2 "
        "of the protocol that the run was trained under.",
        "",
        "Each run's settings are its `config.yaml` in `results/runs/<run>/`; the command of each is in its "
        "`experiment_run.json`. Accuracy: mean ± sample standard deviation over the seeds. Times: training clocks of "
        "the stages (process start-up and warm-up excluded), on the machine above; the jobs line says which runs "
        "shared its cores, and each stage's `context` in its `meta.json` what ran beside it.",
        "",
    ]
    manifest_tables: list[dict] = []
    report_dir = workdir / "report"
    # the protocol's family; a page of secondary datasets alone (the 64³ row's invocation) makes its own
    in_family = [s.name for s in specs if s.dataset.primary] or [s.name for s in specs]
    primary = primary_lines(workdir, in_family)
    secondary = sorted({s.dataset.title for s in specs if s.name not in in_family})
    if primary:
        page += [
            "## Primary verdicts",
            "",
            f"The comparisons fixed in advance by [the protocol]({PROTOCOL_LINK}), section 5a: per dataset, the "
            "CNN-DNN's test accuracy minus its baseline's, per seed averaged over the dataset's configurations; its "
            "95% interval and p from a two-level paired bootstrap (10,000 resamples drawing the seeds and, once per "
            "resample, the test images, with replacement); p Holm-adjusted over every row of this table (one family); "
            "better or worse only where the adjusted p is at most 0.05 and the interval excludes 0, equivalent only "
            "where the whole interval lies within ±0.5 points, not distinguishable otherwise. The per-configuration "
            "tables below are secondary"
            + (f", and so is {' and '.join(secondary)} (not in the protocol's family)" if secondary else "")
            + ". Where balanced accuracy and AUC are primary beside accuracy (AdrenalMNIST3D), their differences are "
            "in points of the metric (AUC x 100), with the same margin.",
            "",
            *primary,
            "",
        ]
        manifest_tables.append({"kind": "primary", "dataset": "all", "runs": in_family, "lines": primary})
    secondary_family = secondary_tables(workdir, names, primary)
    taken: set[str] = set()
    for dataset in datasets:
        ds_names = [s.name for s in specs if s.dataset == dataset]
        tables = report_lines(workdir, ds_names)
        ((data_name, lines),) = tables.items()
        slug = _slug(data_name)
        written = (report_dir / dataset.key / f"{slug}.md").read_text().splitlines()
        # the figures' prefix: the data's name, or the dataset's key where an earlier dataset took that name (mnist_10k)
        prefix, taken = (slug if slug not in taken else dataset.key), taken | {slug}
        # the report's table comes first; the paired differences (ddcnn.report.compare.paired_markdown) follow it
        table_lines = [line for line in written if line.startswith("|")]
        if table_lines[: len(lines)] != lines:
            raise RuntimeError(f"ddcnn-report's table of {data_name} differs from the one recomputed from the runs")
        if table_lines[len(lines) :] != paired_lines(workdir, ds_names):
            raise RuntimeError(
                f"ddcnn-report's paired differences of {data_name} differ from the ones recomputed from the runs"
            )
        # the page's: as ddcnn-report's, their p Holm-adjusted over the page's secondary family instead of the dataset
        paired, pooled = secondary_family[dataset.key]
        overrides = runs_overrides(workdir, ds_names)
        page += [
            f"## {dataset.title}",
            "",
            f"Runs: `ddcnn-train {overrides}`, with the grid, overlap and seed of each.",
            "",
        ]
        glance = glance_lines(workdir, ds_names)
        page += [
            "At a glance: test accuracy in percent, mean ± std over the seeds; the CNN-DNN's lead over the mean "
            "probability and over the global CNN in accuracy points, paired by seed (same data split and local nets): "
            "the mean of the per-seed differences, its 95% t-interval [low, high] and the verdict that follows it "
            f"(section 5 of [the protocol]({PROTOCOL_LINK})): better or worse when the interval lies above or below "
            "0, within noise when it holds 0, n<2: no interval for one seed, no spread: no interval where every seed "
            "gave the same difference, baseline not converged where the baseline "
            "of any seed did not converge (no verdict is given against it), and (convergence unknown) where the runs "
            "did not record whether their baseline converged (runs of a ddcnn before the convergence record).",
            "",
            *glance,
            "",
        ]
        manifest_tables.append({"kind": "glance", "dataset": data_name, "runs": ds_names, "lines": glance})
        secondary = {"dataset": data_name, "runs": ds_names, "family": names}
        if paired:
            page += [
                "Paired differences (secondary: no headline rests on them; test accuracy, points; `ddcnn-report`'s "
                "table): each method minus its baseline per seed within a configuration, mean ± sample std, 95% "
                "t-interval and verdict (as above); p the paired t-test's, and Holm-adjusted over every row of this "
                "page's paired tables and tables over configurations (the page's secondary family; the verdict stays "
                "the interval's); where the runs trained one, the global DDP against the global CNN on one device, "
                "one row of grid and overlap all (the same two trainings serve every grid of a seed):",
                "",
                *paired,
                "",
            ]
            manifest_tables.append({"kind": "paired", **secondary, "lines": paired})
        if pooled:
            page += [
                "Over the dataset's configurations (secondary, p as in the paired table): each difference of the "
                "paired table averaged over the configurations within each seed, then paired by seed (one interval "
                "for the dataset; seeds that hold every configuration), but for those the primary table gives:",
                "",
                *pooled,
                "",
            ]
            manifest_tables.append({"kind": "pooled", **secondary, "lines": pooled})
        page += [
            "Every method. Times: training clocks in seconds. Speedup vs global, 1 device: the global CNN's time over "
            "the method's with its stages one after another on one device. Speedup vs DDP, P devices: the global "
            "DDP's time on P devices over the CNN-DNN's with its local nets placed on as many devices, then its "
            "coarse DNN. Speedup to target, 1 device: the time to a fixed target set by the global CNN alone, its "
            "accuracy on the held-out target split (`val_target`, which no selection of any method saw) minus one "
            "binomial standard error of that split (runs without that split: its best validation accuracy minus one "
            "standard error of the validation split). Each method's time to the target is its training "
            "clock at its first evaluation at or above it, the CNN-DNN's on one device: its local nets one after "
            "another with their output inference, then the coarse fit's training clock. The column is the global "
            "CNN's time over the CNN-DNN's: the geometric mean over the runs where both reached the target and whose "
            "timing is comparable, with its 95% interval on the log scale (reached/runs; runs whose timing is not "
            "comparable, a global CNN reused from another run or trained beside another load, are counted and left "
            "out); - where the runs recorded no target (runs of a ddcnn before it).",
            "",
        ]
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
        lines = devices_lines(workdir, ds_names)
        if lines:
            page += [
                "Equal devices: every time against the same device count P (the CNN-DNN's N local nets placed on P "
                "devices from their recorded times; DDP really run on P processes):",
                "",
                *lines,
                "",
            ]
            manifest_tables.append({"kind": "devices", "dataset": data_name, "runs": ds_names, "lines": lines})
        page += ["Flagged rows:", "", *flag_lines(workdir, ds_names), ""]
        kept = coarse_kept_lines(workdir, ds_names)
        if kept:
            page += [
                "What the coarse fit kept, per run: the candidate it chose on the validation split (docs/coarse.md):",
                "",
                *kept,
                "",
            ]
        figures = []
        for png in sorted((report_dir / dataset.key).glob(f"{slug}_*.png")):
            name = prefix + png.name[len(slug) :]
            shutil.copy2(png, assets / name)
            figures.append(name)
        for spec in specs:
            curve = workdir / spec.name / "plots" / "accuracy_vs_time.png"
            if spec.dataset == dataset and spec.seed == min(s.seed for s in specs) and curve.is_file():
                name = f"{prefix}_{spec.name.split('/')[-1]}_accuracy_vs_time.png"
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
        **({"interim": meta["interim"]} if meta.get("interim") else {}),
    }
    (out / PAGE).write_text(text)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return text, manifest


def recompute_tables(manifest: dict, root: Path) -> list[list[str] | None]:
    """Each table of the manifest recomputed from the run directories under ``root`` with the report's code, in the
    manifest's order (``None`` where a run of it is missing): what :func:`check_manifest` compares, computed once for
    several pages of one manifest (the slow part: the bootstrap of the primary verdicts, the report's tables)."""
    primary = next((t["lines"] for t in manifest["tables"] if t["kind"] == "primary"), [])
    secondary: dict[tuple, dict] = {}  # the page's secondary family, recomputed once
    out: list[list[str] | None] = []
    for table in manifest["tables"]:
        if any(not (root / n / "results.json").is_file() for n in table["runs"]):
            out.append(None)
        elif table["kind"] == "report":
            out.append(report_lines(root, table["runs"]).get(table["dataset"]))
        elif table["kind"] == "glance":
            out.append(glance_lines(root, table["runs"]))
        elif table["kind"] in ("paired", "pooled"):
            family = tuple(table.get("family") or table["runs"])
            if family not in secondary:
                secondary[family] = secondary_tables(root, list(family), primary)
            paired, pooled = secondary[family].get(_dataset_of(table["runs"][0]), ([], []))
            out.append(paired if table["kind"] == "paired" else pooled)
        elif table["kind"] == "primary":
            out.append(primary_lines(root, table["runs"]))
        elif table["kind"] == "devices":
            out.append(devices_lines(root, table["runs"]))
        else:
            published = tuple((str(n), float(a)) for n, a in table.get("published", ()))
            out.append(auc_lines(root, table["runs"], published))
    return out


def check_manifest(page: str, manifest: dict, root: Path, tables: list[list[str] | None] | None = None) -> list[str]:
    """What is wrong between the page, its manifest and the run directories under ``root`` (empty: nothing).

    ``root`` holds the run directories under their manifest names: the original ``--workdir`` or the snapshot
    ``OUT/results/runs``. Checked: each run's fingerprint and ``results.json`` hash are the manifest's; the figures the
    manifest took from each run are those of its ``results.json``; every table recomputed from the runs with the
    report's code (``tables``: :func:`recompute_tables` of the same manifest and ``root``, computed here if not given)
    is the manifest's, line for line; and every table line of the page is one of the manifest's (its header table or a
    recomputed one), so a figure on the page that no run wrote fails.
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
    for table, recomputed in zip(
        manifest["tables"], recompute_tables(manifest, root) if tables is None else tables, strict=True
    ):
        if recomputed is None:
            missing = [n for n in table["runs"] if not (root / n / "results.json").is_file()]
            problems.append(f"table {table['kind']} of {table['dataset']}: runs {missing} missing under {root}")
            continue
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
            for what, lines_of in (("flags", flag_lines), ("coarse fits kept", coarse_kept_lines)):
                unlisted = [line for line in lines_of(root, table["runs"]) if line not in page_lines]
                if unlisted:
                    problems.append(f"{what} of {table['dataset']}: {len(unlisted)} line(s) not on the page")
    return problems


# --- generated blocks of the docs, and the cost estimate -----------------------------------------------------------
# Markdown files (and this script's docstring) whose description of the page is generated from its runs: the text
# between the markers is written by the page's invocation and by --write, and compared by --check.
BLOCKS = (
    ("README.md", "summary"),
    ("docs/methods.md", "recipe"),
    ("docs/coarse.md", "coarse_input"),
    ("experiments/results.py", "estimate"),
)
CPU_BUDGET_S = 14 * 3600  # what the page may cost (issue 44)
# A dataset run as a page of its own (--datasets KEY) with its own budget (issue #47: the 64³ row within 10 CPU-hours),
# and where an overrun is explained
OWN_BUDGETS = {"adrenal3d_64": (10 * 3600, 'docs/cost.md ("The 64³ row")')}


def page_budget(names: list[str]) -> tuple[int, str]:
    """What the page of runs ``names`` may cost in CPU seconds, and where an overrun is explained: the sum of the own
    budgets where every dataset of the page has one (:data:`OWN_BUDGETS`), else :data:`CPU_BUDGET_S`."""
    keys = {_dataset_of(name) for name in names}
    if keys and keys <= OWN_BUDGETS.keys():
        return sum(OWN_BUDGETS[k][0] for k in keys), "; ".join(OWN_BUDGETS[k][1] for k in sorted(keys))
    return CPU_BUDGET_S, "the script's docstring"


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- results.py:{name} begin (generated by experiments/results.py; --check compares) -->", (
        f"<!-- results.py:{name} end -->"
    )


def _dataset_of(name: str) -> str:
    return name.split("/")[0]


def _by_dataset(manifest: dict) -> dict[str, list[str]]:
    datasets: dict[str, list[str]] = {}
    for name in manifest["runs"]:
        datasets.setdefault(_dataset_of(name), []).append(name)
    return datasets


INPUTS_PAIR = ("cnn_dnn_logits", "cnn_dnn_probs")  # the comparison that decides coarse.input (protocol section 6)


def _page_input(root: Path, names: list[str]) -> str:
    """What the CNN-DNN of the runs ``names`` is, by the coarse input each run's coarse DNN trained on
    (``results.json`` ``coarse_input``), beside today's default (``conf/coarse/mlp.yaml``) where it is the other."""
    from ddcnn.settings.read import yaml_default

    used = sorted({_coarse_input(json.loads((root / n / "results.json").read_text())) for n in names})
    label = {"probs": "probabilities", "logits": "logits"}
    text = (
        "the coarse DNN on the local " + " or ".join(label.get(u, u) for u in used) + ", as the page's runs trained it"
    )
    default = yaml_default("coarse.input")
    if used != [default]:
        text += f"; `coarse.input`'s default is `{default}`, and why, with the CNN-DNN on either input: docs/coarse.md"
    else:
        text += "; `coarse.input`'s evidence: docs/coarse.md"
    return text


def summary_block(manifest: dict, root: Path) -> list[str]:
    """README's lines on the committed page: what it ran, what it cost, and its primary verdicts (docs/protocol.md
    5a, :func:`primary_rows`); for a page from before them (no kept test predictions), a table of the CNN-DNN's paired
    differences, each with its 95% interval and verdict (:func:`lead_cell`, as the page's glance tables print them)."""
    names = sorted(manifest["runs"])
    runs = runs_summary(root, names)
    interim = manifest.get("interim")
    head = (
        (
            f"The committed page is interim ({interim.split(' are finished')[0]}; its header names the rest)"
            if interim
            else "The committed page"
        )
        + f": {runs['runs']} runs, {runs['cpu_s'] / 3600:.1f} CPU-hours, {runs['span_h']:.1f} h from "
        f"the first run's start to the last one's end ({'; '.join(runs['machines']) or 'machine not recorded'}). "
    )
    family = next((t["runs"] for t in manifest.get("tables", []) if t.get("kind") == "primary"), None)
    primary = primary_rows(root, family) if family else []
    if primary:
        return [
            head
            + "Its primary verdicts (fixed in advance: docs/protocol.md section 5a): the CNN-DNN ("
            + _page_input(root, family)
            + ") minus each baseline, per seed averaged over the dataset's configurations, in points of test accuracy "
            "(AdrenalMNIST3D also of balanced accuracy and AUC x 100); the 95% interval over seeds and test images (a "
            "two-level paired bootstrap); p Holm-adjusted over the family; equivalent only within ±0.5 points. "
            "Per-configuration rows, the cost and the time to target are on the page.",
            "",
            "| dataset | comparison | seeds | difference (points) | 95% interval | Holm-adjusted p | verdict |",
            "|---|---|---|---|---|---|---|",
            *(
                f"| {r['dataset']} | {r['comparison']} | {r['seeds']} | {r['difference']:+.2f} | "
                f"[{r['low']:+.2f}, {r['high']:+.2f}] | {r['p_holm']:.2g} | {r['verdict']} |"
                for r in primary
            ),
        ]
    lines = [
        head + "The CNN-DNN (the paper's: the coarse DNN on the local probabilities, as the page's command pins it) "
        "minus the other method in test-accuracy points, paired by seed: the mean, its 95% interval and the verdict "
        "the interval gives. The last column is the coarse DNN on the local logits minus on the probabilities, the "
        "evidence that decides `coarse.input`'s default (docs/protocol.md section 6, docs/coarse.md).",
        "",
        "| dataset | seeds | grid, overlap | CNN-DNN − global CNN | CNN-DNN − mean probability "
        "| logits − probabilities |",
        "|---|---|---|---|---|---|",
    ]
    for group in _by_dataset(manifest).values():
        cells: dict[tuple, dict[str, str]] = {}
        seeds: dict[tuple, int] = {}  # per row, the seeds its differences pair (an interim page's rows differ)
        for row in paired_table(root, group):
            key = (row["grid"], row["overlap"])
            if row["method_key"] == "cnn_dnn":
                cells.setdefault(key, {})[row["baseline_key"]] = lead_cell(row)
                seeds[key] = max(seeds.get(key, 0), row["n"])
            elif (row["method_key"], row["baseline_key"]) == INPUTS_PAIR:
                cells.setdefault(key, {})["inputs"] = lead_cell(row)
        for (grid, overlap), by in cells.items():
            lines.append(
                f"| {_dataset_of(group[0])} | {seeds[grid, overlap]} | {grid}, {overlap} | {by.get('global', '-')} | "
                f"{by.get('mean_prob', '-')} | {by.get('inputs', '-')} |"
            )
    return lines


def coarse_input_block(manifest: dict, root: Path) -> list[str]:
    """docs/coarse.md's lines on the evidence of the committed page for ``coarse.input``: per dataset the coarse DNN on
    logits minus on probabilities over its configurations (:func:`pooled_rows`; a dataset of one configuration: its
    row) and the verdicts of its rows, and the first two criteria of section 6 of docs/protocol.md as they hold."""
    lines = [
        "The committed results page: the coarse DNN on the local logits minus on the local probabilities, in "
        "test-accuracy points paired by seed (the mean, its 95% interval and verdict), over each dataset's "
        "configurations and per configuration (its rows).",
        "",
        "| dataset | seeds | over its configurations | rows better / within noise / worse | lowest row |",
        "|---|---|---|---|---|",
    ]
    two_d_better, worse = True, []
    for name, group in _by_dataset(manifest).items():
        rows = [r for r in paired_table(root, group) if (r["method_key"], r["baseline_key"]) == INPUTS_PAIR]
        if not rows or name in SECONDARY_DATASETS:  # section 6 counts the page's datasets of 5 seeds
            continue
        pooled = [r for r in pooled_rows(root, group) if (r["method_key"], r["baseline_key"]) == INPUTS_PAIR]
        overall = pooled[0] if pooled else (rows[0] if len(rows) == 1 else None)
        if len(rows[0]["grid"].split("x")) == 2 and (overall is None or overall["verdict"] != "better"):
            two_d_better = False
        counts = [sum(r["verdict"] == v for r in rows) for v in ("better", "within noise", "worse")]
        worse += [f"{name} {r['grid']}, {r['overlap']}" for r in rows if r["verdict"] == "worse"]
        lowest = min(rows, key=lambda r: r["mean_points"])
        lines.append(
            f"| {name} | {max(r['n'] for r in rows)} | {lead_cell(overall)} | {' / '.join(map(str, counts))} | "
            f"{lowest['grid']}, {lowest['overlap']}: {lead_cell(lowest)} |"
        )
    lines += [
        "",
        "Section 6 of docs/protocol.md on these runs: (1) better over the configurations of every 2D dataset: "
        + ("met" if two_d_better else "not met")
        + "; (2) no row worse: "
        + ("met" if not worse else f"not met ({', '.join(worse)})")
        + ". Criterion (3), a few hundred images with tens of classes, is the row `mnist_fashion20` of the table "
        "below.",
    ]
    return lines + default_standing_lines(manifest, root)


# The CNN-DNN at either coarse input against the global CNN (docs/coarse.md: what the default gives a user)
STANDING_PAIRS = (
    ("coarse DNN on probabilities − global CNN", "cnn_dnn_probs", "global", "global"),
    ("coarse DNN on logits − global CNN", "cnn_dnn_logits", "global", "global"),
)


def default_standing_lines(manifest: dict, root: Path) -> list[str]:
    """The CNN-DNN on each coarse input minus the global CNN, per dataset of the committed page over its
    configurations (:func:`pooled_rows` of :data:`STANDING_PAIRS`; a dataset of one configuration: its paired row): the
    cost of the coarse input that section 6 leaves as the default, where the page's primary rows are the other's."""
    lines = [
        "",
        "The CNN-DNN on either input minus the global CNN on the same runs, in test-accuracy points paired by seed "
        "over each dataset's configurations (one configuration: its row), with the t-interval of the page's tables "
        "over configurations (the page's primary verdict on logits uses the bootstrap over seeds and test images):",
        "",
        "| dataset | seeds | on probabilities − global CNN | on logits − global CNN |",
        "|---|---|---|---|",
    ]
    for name, group in _by_dataset(manifest).items():
        rows = pooled_rows(root, group, STANDING_PAIRS) or paired_table(root, group, STANDING_PAIRS)
        cells = {r["method_key"]: r for r in rows}
        if len(cells) < len(STANDING_PAIRS):  # a run without coarse_alt: no row of the other input
            continue
        row = [cells[method] for _, method, *_ in STANDING_PAIRS]
        lines.append(f"| {name} | {max(r['n'] for r in row)} | " + " | ".join(lead_cell(r) for r in row) + " |")
    return lines


def _config(root: Path, name: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(root / name / "config.yaml"), resolve=False)


def _schedule(cfg: dict) -> str:
    from ddcnn.settings.loop import scheduler_spec

    node = scheduler_spec(cfg.get("scheduler")) or {}
    target = str(node.get("_target_", "none")).rsplit(".", 1)[-1]
    if target == "ReduceLROnPlateau":
        threshold = (
            f", threshold {node['threshold']} ({node.get('threshold_mode', 'rel')})" if "threshold" in node else ""
        )
        return f"ReduceLROnPlateau (factor {node.get('factor')}, patience {node.get('patience')}{threshold})"
    return target


def recipe_block(manifest: dict, root: Path) -> list[str]:
    """docs/methods.md's lines on the committed page's recipe and cost, read from its runs' config.yaml and
    experiment_run.json."""
    lines = []
    for key, group in _by_dataset(manifest).items():
        cfg = _config(root, group[0])
        engine, data, trainer = cfg.get("engine") or {}, cfg.get("data") or {}, cfg.get("trainer") or {}
        seeds = sorted({int(_config(root, n).get("seed", 0)) for n in group})
        cpu = [json.loads((root / n / "experiment_run.json").read_text())["cpu_s"] for n in group]
        stop = (
            "every epoch of the cap"
            if engine.get("patience") is None
            else f"patience {engine['patience']}, min_delta {engine.get('min_delta')}"
            + (f", min_epochs {engine['min_epochs']}" if engine.get("min_epochs") is not None else "")
        )
        sizes = f"train_subset {data.get('train_subset') or 'all'}, val_fraction {data.get('val_fraction')}, "
        sizes += f"test_subset {data.get('test_subset') or 'all'}, batch {data.get('batch_size')}"
        lines.append(
            f"- `{key}`: {len(group)} runs, seeds {seeds[0]}-{seeds[-1]}; cap {trainer.get('max_epochs')} epochs, "
            f"{stop}, monitor {engine.get('monitor')}; schedule {_schedule(cfg)}; {sizes}; "
            f"{sum(cpu):.0f} s CPU (a run {min(cpu):.0f}-{max(cpu):.0f} s)."
        )
    runs = runs_summary(root, sorted(manifest["runs"]))
    lines.append(
        f"- In all: {runs['runs']} runs, {runs['cpu_s']:.0f} s CPU ({runs['cpu_s'] / CPU_BUDGET_S:.0%} of the "
        f"{CPU_BUDGET_S // 3600} CPU-hours allowed), {runs['span_h']:.2f} h from the first run's start to the last "
        "one's end."
    )
    return lines


def estimate(root: Path, args: argparse.Namespace) -> dict[str, float | None]:
    """CPU seconds of the page at ``args``, per dataset, from the recorded CPU of the runs under ``root`` made at the
    same training set (2D: ``data.train_subset``; nothing is scaled from another size: fewer images do not cost
    proportionally less, see the module doc).

    Per run: its CPU less the DDP it trained (2 processes: twice its training clock and start-up); per dataset and
    seed the sum, averaged over the seeds that have every planned run of the dataset, plus one DDP per dataset and
    seed (reused by its other runs), times the seeds of ``args``. ``None`` for a dataset without such a seed (an
    interim page's), also one without any run at this size yet.
    """
    per_seed: dict[str, dict[int, float]] = {}
    runs: dict[str, dict[int, int]] = {}
    ddp: dict[str, list[float]] = {}
    datasets = {d.key: d for d in plan(args)}
    for record in sorted(root.glob("*/*/experiment_run.json")):
        run_dir = record.parent
        name = run_dir.relative_to(root).as_posix()
        key = _dataset_of(name)
        if key not in args.datasets or key not in datasets:
            continue
        cfg, res = _config(root, name), json.loads((run_dir / "results.json").read_text())
        size = (cfg.get("data") or {}).get("train_subset")
        if size is not None and size != _train_size(datasets[key], args):  # a 2D run at another training set
            continue
        times, startup = res.get("time_s") or {}, res.get("startup_s") or {}
        trained_ddp = times.get("global_ddp") is not None and "global_ddp" not in (res.get("reused") or {})
        ddp_cpu = 2 * (times["global_ddp"] + startup.get("global_ddp", 0)) if trained_ddp else 0.0
        cpu = json.loads(record.read_text())["cpu_s"]
        seed = int(cfg.get("seed", 0))
        per_seed.setdefault(key, {})
        per_seed[key][seed] = per_seed[key].get(seed, 0.0) + cpu - ddp_cpu
        runs.setdefault(key, {})
        runs[key][seed] = runs[key].get(seed, 0) + 1
        if trained_ddp:
            ddp.setdefault(key, []).append(ddp_cpu)
    planned = {key: len(d.grids) * len(d.overlaps) for key, d in datasets.items()}
    out: dict[str, float | None] = dict.fromkeys(planned)  # a dataset with no run yet: no estimate either
    for key, costs in per_seed.items():  # the seeds with every planned run of the dataset (an interim page's fewer)
        whole = [cost for seed, cost in costs.items() if runs[key][seed] >= planned[key]]
        seeds = len(dataset_seeds(datasets[key], args.seeds))
        out[key] = seeds * (sum(whole) / len(whole) + (_mean(ddp.get(key, [])) or 0.0)) if whole else None
    return out


def _train_size(dataset: Dataset, args: argparse.Namespace) -> int | None:
    """The ``data.train_subset`` the plan gives ``dataset`` (its own override, else ``--train-subset``)."""
    given = [o.split("=", 1)[1] for o in dataset.overrides if o.startswith("data.train_subset=")]
    return int(given[-1]) if given else args.train_subset


def estimate_text(root: Path, args: argparse.Namespace) -> str:
    cost = estimate(root, args)
    unknown = [key for key, value in cost.items() if value is None]
    if unknown:
        return (
            f"{len(args.seeds)} seeds, {args.train_subset} training images per 2D dataset: no estimate yet, the page's "
            f"runs hold no seed with every run of {', '.join(unknown)} (an interim page)"
        )
    total = sum(cost.values())
    each = ", ".join(f"{key} {value:.0f} s" for key, value in cost.items())
    return (
        f"{len(args.seeds)} seeds, {args.train_subset} training images per 2D dataset: about {total:.0f} s CPU "
        f"({total / 3600:.1f} CPU-hours, {'over' if total > CPU_BUDGET_S else 'within'} the {CPU_BUDGET_S // 3600} "
        f"allowed; {each})"
    )


def estimate_block(manifest: dict, root: Path) -> list[str]:
    """The docstring's estimate of the page at the default flags, from the page's runs."""
    return [f"- at the defaults, {estimate_text(root, _resolve(_parser().parse_args([])))}."]


def _generated(name: str, manifest: dict, root: Path) -> list[str]:
    """The lines of block ``name``, wrapped at the docs' 120 columns (a list item's continuation indented; table rows
    and blank lines as they are)."""
    blocks = {
        "summary": summary_block,
        "recipe": recipe_block,
        "coarse_input": coarse_input_block,
        "estimate": estimate_block,
    }
    lines = blocks[name](manifest, root)
    wrapped = []
    for line in lines:
        if not line or line.startswith("|"):
            wrapped.append(line)
            continue
        indent = "  " if line.startswith("- ") else ""
        wrapped += textwrap.wrap(line, 120, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)
    return wrapped


def _fill(text: str, name: str, lines: list[str]) -> str | None:
    begin, end = _markers(name)
    if begin not in text or end not in text:
        return None
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + begin + "\n" + "\n".join(lines) + "\n" + end + tail


def write_blocks(manifest: dict, root: Path) -> list[str]:
    """Rewrite every generated block (:data:`BLOCKS`) from the page's manifest and runs; the files changed."""
    changed = []
    for file, name in BLOCKS:
        path = ROOT / file
        text = path.read_text()
        filled = _fill(text, name, _generated(name, manifest, root))
        if filled is not None and filled != text:
            path.write_text(filled)
            changed.append(file)
    return changed


# The page's figures that a reader could copy: signed differences in points (+0.53), means with their spread
# (97.85 ± 0.22) and speedups (1.10x); README and docs/ may hold them only inside a generated block.
_PAGE_FIGURES = (
    re.compile(r"(?<![\w.])[+\-−]\d+\.\d{2}(?!\d)"),
    re.compile(r"\d+\.\d+ ± \d+\.\d+"),
    re.compile(r"(?<![\w.])\d+\.\d{2}x(?!\w)"),
)
_ANY_BLOCK = re.compile(r"<!-- ([\w.]+):(\w+) begin.*?<!-- \1:\2 end -->", re.S)


def _page_figures(text: str) -> set[str]:
    return {m.group(0).replace("−", "-") for pattern in _PAGE_FIGURES for m in pattern.finditer(text)}


def figures_outside_blocks(page: str, files: Sequence[Path], docstring: str = "") -> list[str]:
    """Where a figure of the ``page`` (:data:`_PAGE_FIGURES`) stands in ``files`` outside every generated block
    (``<!-- name:block begin ... -->`` to its end; any generator's), or in ``docstring``: copied by hand, so no
    ``--check`` keeps it equal to the runs (issue #44 item 6). ``path:line: figure`` each."""
    figures = _page_figures(page)
    problems = []
    for file in files:
        text = _ANY_BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), file.read_text())
        for number, line in enumerate(text.splitlines(), 1):
            for figure in sorted(_page_figures(line) & figures):
                problems.append(
                    f"{file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}:{number}: the "
                    f"page's figure {figure} outside a generated block (generate it or leave it out)"
                )
    for figure in sorted(_page_figures(docstring) & figures):
        problems.append(f"experiments/results.py docstring: the page's figure {figure} (generate it or leave it out)")
    return problems


def prose_files() -> list[Path]:
    """README.md and docs/*.md but the page itself: where :func:`figures_outside_blocks` looks."""
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != PAGE)]


def check_blocks(manifest: dict, root: Path) -> list[str]:
    """The generated blocks (:data:`BLOCKS`) that are missing or differ from what the page's runs give, and the
    docstring's flag defaults that differ from the parser's (:func:`docstring_problems`)."""
    problems = []
    for file, name in BLOCKS:
        text = (ROOT / file).read_text()
        filled = _fill(text, name, _generated(name, manifest, root))
        if filled is None:
            problems.append(f"{file}: no generated block {name!r} (its markers {_markers(name)[0]} ... are gone)")
        elif filled != text:
            problems.append(f"{file}: the block {name!r} is not what the page's runs give: run results.py --write")
    return problems + docstring_problems()


def docstring_problems() -> list[str]:
    """The flag defaults that the script's docstring states (``--flag`` = value) and the parser does not have."""
    problems = []
    defaults = vars(_resolve(_parser().parse_args([])))
    for flag, value in re.findall(r"``--([a-z-]+)`` = ([0-9][0-9.]*)", __doc__ or ""):
        default = defaults.get(flag.replace("-", "_"))
        if isinstance(default, list):
            default = len(default)
        if default is None or float(value) != float(default):
            problems.append(f"the script's docstring says --{flag} = {value}, its default is {default}")
    return problems


# --- command line ----------------------------------------------------------------------------------------------------
TRAIN_SUBSET = 2000  # training images per 2D dataset by default (module doc: the cost)
SEEDS = (0, 1, 2, 3, 4)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="experiments/results.py", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the few-second version for CI (digits, 1 epoch, 1 seed)")
    parser.add_argument("--out", type=Path, help="where results.md, its manifest and results/ go (default: docs)")
    parser.add_argument("--workdir", type=Path, help="the run directories (default: runs/results)")
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fashion_mnist", "adrenal3d", "mnist_10k"])
    parser.add_argument("--seeds", type=int, nargs="+", help=f"default: {' '.join(map(str, SEEDS))} (--tiny: 0)")
    parser.add_argument(
        "--train-subset", type=int, help=f"training images per 2D dataset (default: {TRAIN_SUBSET}; 0 = all)"
    )
    parser.add_argument("--test-subset", type=int, default=0, help="test images per 2D dataset (0 = all 10000)")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of the 2D training sets for validation")
    parser.add_argument(
        "--val-target-fraction",
        type=float,
        default=0.5,
        help="share of the 2D validation splits no choice sees, for the fixed targets (data.val_target_fraction)",
    )
    parser.add_argument(
        "--val-target-fraction-3d",
        type=float,
        default=0.1,
        help="share of the 3D training split no choice sees, for the fixed targets (data.val_target_from=train)",
    )
    parser.add_argument(
        "--epochs", type=int, help="epoch cap of every 2D training (trainer.max_epochs; default 15, --tiny: 1)"
    )
    parser.add_argument(
        "--min-epochs",
        type=int,
        help="2D trainings: no early stop before this epoch (engine.min_epochs, passed where the engine has it; "
        "default: half of --epochs, rounded up)",
    )
    parser.add_argument(
        "--min-delta",
        type=float,
        default=0.002,
        help="2D trainings: an epoch improves only by more than this validation accuracy, for early stopping, "
        "selection and the plateau schedule alike (engine.min_delta, the scheduler's absolute threshold)",
    )
    parser.add_argument(
        "--lr-drop",
        type=float,
        default=0.2,
        help="2D trainings: multiply the learning rate by this after --lr-patience + 1 epochs in a row without "
        "improvement (ReduceLROnPlateau; 0 = a constant rate)",
    )
    parser.add_argument("--lr-patience", type=int, default=0, help="the plateau schedule's patience (its p)")
    parser.add_argument(
        "--patience", type=int, default=2, help="early stopping of every 2D training (engine.patience >= p + 2)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="batch of every 2D full-image training")
    parser.add_argument(
        "--curve-points",
        default="all",
        help="report.curves.points: all (every epoch on val_target, the test split at 6 of them) or a count",
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every training")
    parser.add_argument("--jobs", type=int, default=1, help="accuracy runs at once (e.g. one per core)")
    parser.add_argument(
        "--timing-jobs",
        type=int,
        default=1,
        help="timing runs at once (the first run of each dataset and seed, which trains the global CNN and DDP)",
    )
    parser.add_argument("--run-timeout", type=float, help="seconds after which one ddcnn-train is killed")
    parser.add_argument(
        "--retrain",
        action="store_true",
        help="train again the finished runs of WORKDIR whose command is not the planned one (else refused)",
    )
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="only copy the finished runs of WORKDIR into OUT/results/runs (commit them: a later invocation restores "
        "them instead of training them again); trains nothing, writes no page",
    )
    parser.add_argument(
        "--interim",
        action="store_true",
        help="only write OUT's page from the finished runs of the planned ones (their snapshots in OUT/results/runs), "
        "marked interim with what is missing; trains nothing (commit it: the next invocation restores those runs)",
    )
    parser.add_argument("--check", action="store_true", help="only check OUT's page against its manifest and runs")
    parser.add_argument("--root", type=Path, help="with --check: the run directories (default: OUT/results/runs)")
    parser.add_argument(
        "--write",
        action="store_true",
        help="only rewrite the generated blocks of README.md, docs/methods.md and this script's docstring from the "
        "committed page (docs) and its runs; trains nothing",
    )
    parser.add_argument(
        "--rewrite",
        action="store_true",
        help="only write OUT's page again from its snapshotted runs with today's report code (after a change of "
        "ddcnn-report's tables); trains nothing, each run as it was recorded",
    )
    parser.add_argument(
        "--estimate", action="store_true", help="only print the CPU estimate of the page at these flags (module doc)"
    )
    return parser


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """The defaults that depend on other flags, and the checks of the training rule."""
    if args.epochs is None:
        args.epochs = 1 if args.tiny else 15
    if args.min_epochs is None:
        args.min_epochs = math.ceil(args.epochs / 2)
    if args.train_subset is None and not args.tiny:
        args.train_subset = TRAIN_SUBSET
    if args.seeds is None:
        args.seeds = [0] if args.tiny else list(SEEDS)
    if args.lr_drop and args.patience < args.lr_patience + 2:
        raise SystemExit(
            f"results.py: --patience {args.patience} may stop a training before the plateau schedule (--lr-patience "
            f"{args.lr_patience}) has lowered its rate: the protocol wants early stopping's patience at least the "
            f"schedule's + 2; give --patience {args.lr_patience + 2} or more (or a smaller --lr-patience)."
        )
    if not 1 <= args.min_epochs <= args.epochs:
        raise SystemExit(f"results.py: --min-epochs {args.min_epochs} must be between 1 and --epochs {args.epochs}.")
    return args


def spec_of(name: str, datasets: dict[str, Dataset]) -> RunSpec:
    """The plan entry of a run directory name (``mnist/4x4_o2_s1``, ``adrenal3d/2x2x2_s0``; :attr:`RunSpec.name`)."""
    key, rest = name.split("/", 1)
    parts = rest.split("_")
    overlap = int(parts[1][1:]) if len(parts) == 3 else None
    return RunSpec(datasets[key], parts[0], overlap, int(parts[-1][1:]))


def _page_from_snapshots(
    out: Path,
    workdir: Path,
    datasets: list[Dataset],
    specs: list[RunSpec],
    command: str,
    threads: str,
    tiny: bool,
    start: float,
    interim: str | None = None,
) -> list[str]:
    """Report the runs copied from ``OUT/results/runs`` into ``workdir``, write the page and its manifest (pointing at
    the snapshots), check them, and refill the docs' generated blocks when ``OUT`` is ``docs`` and the check passed;
    the check's problems."""
    report(specs, workdir, int(threads), plots=not tiny)
    meta = {
        "commit": _git_commit(),
        "command": command,
        "written": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": f"{time.time() - start:.0f}",
        "threads": threads,
        "interim": interim,
    }
    page, manifest = write_page(datasets, specs, workdir, out, meta, tiny)
    manifest["workdir"] = str(out / ASSETS / "runs")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    problems = check_manifest(page, manifest, out / ASSETS / "runs")
    if not problems and out == (ROOT / "docs").resolve():
        write_blocks(manifest, out / ASSETS / "runs")
    return problems


def rewrite(out: Path, command: str) -> int:
    """Write ``OUT/results.md`` and its manifest again from the snapshots of its runs (``OUT/results/runs``), with
    today's ``ddcnn-report``: no run is trained, each keeps its record; ``--check`` then compares the page with them."""
    manifest = json.loads((out / MANIFEST).read_text())
    names = list(manifest["runs"])
    runs = out / ASSETS / "runs"
    unlisted = sorted(
        f"{d.parent.name}/{d.name}"
        for d in runs.glob("*/*")
        if (d / "experiment_run.json").is_file() and f"{d.parent.name}/{d.name}" not in names
    )
    if unlisted:  # the page is written from the manifest's runs, and the snapshots become those: these would go
        raise SystemExit(
            f"results.py --rewrite: {runs} holds {len(unlisted)} finished run(s) that {out / MANIFEST} does not list "
            f"({', '.join(unlisted)}); rewriting would drop them. Write the page with --interim (and the page's "
            "flags) or the full command first, which takes them in."
        )
    tiny = _resolve(_parser().parse_args(["--tiny"]))
    full = _resolve(_parser().parse_args([]))
    datasets = {d.key: d for d in (*plan(tiny), *plan(full))}
    specs = [spec_of(name, datasets) for name in names]
    used = list(dict.fromkeys(s.dataset for s in specs))
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name in names:
            shutil.copytree(out / ASSETS / "runs" / name, workdir / name)
        records = [json.loads((workdir / n / "experiment_run.json").read_text()) for n in names]
        threads = str(records[0].get("threads", 1))
        is_tiny = all(s.dataset.key == "digits" for s in specs)
        problems = _page_from_snapshots(
            out, workdir, used, specs, command, threads, is_tiny, start, manifest.get("interim")
        )
    print(
        f"results.py: {out / PAGE} written again from {len(names)} snapshotted runs"
        + (f"; CHECK FAILED: {problems}" if problems else "")
    )
    return 1 if problems else 0


LOCK = ".results.lock"  # in WORKDIR: held by the invocation that trains into it, released by the kernel at its exit


def hold_workdir(workdir: Path):
    """The workdir's lock (an exclusive ``flock``, ``filelock.FileLock``), taken at once or refused: two invocations
    training into one workdir would each remove what the other is training (``--retrain``), write the same snapshots
    and race for the page. A dead holder's lock is free (the kernel releases it), so a killed invocation never blocks
    the next. The returned lock is held until it is released or collected."""
    from filelock import FileLock, Timeout

    workdir.mkdir(parents=True, exist_ok=True)
    lock, owner = FileLock(workdir / LOCK, thread_local=False), workdir / f"{LOCK}.owner"
    try:
        lock.acquire(timeout=0)
    except Timeout:
        holder = owner.read_text().strip() if owner.is_file() else "another process"
        raise SystemExit(
            f"results.py: {holder} is training into {workdir}; wait for it to finish or stop it (kill its process "
            "group) before starting another invocation, or give this one another --workdir."
        ) from None
    owner.write_text(f"results.py (pid {os.getpid()} on {platform.node()}, since {time.strftime('%Y-%m-%d %H:%M')})\n")
    return lock


def interim(out: Path, datasets: list[Dataset], specs: list[RunSpec], command: str, threads: int, tiny: bool) -> int:
    """Write ``OUT/results.md`` from the finished runs of an unfinished invocation: those of ``specs`` whose snapshot
    under ``OUT/results/runs`` holds the planned command; the header says the page is interim, with what is missing.
    Committed, it is a checked page of what has been measured, and its snapshots are what the next invocation restores
    instead of training them again."""
    snapshots = out / ASSETS / "runs"
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        done = []
        for spec in specs:
            saved = snapshots / spec.name
            if _finished(saved) and not command_differences(
                json.loads((saved / "experiment_run.json").read_text()).get("command", ""),
                planned_command(spec, workdir),
                saved / "config.yaml",
            ):
                shutil.copytree(saved, workdir / spec.name)
                done.append(spec)
        if not done:
            print(f"results.py: none of the {len(specs)} planned runs is finished in {snapshots}; no page written")
            return 1
        seeds = {d.key: sorted({s.seed for s in done if s.dataset == d}) for d in datasets}
        missing = [s.name for s in specs if s not in done]
        used = [d for d in datasets if seeds[d.key]]
        text = (
            f"{len(done)} of the {len(specs)} planned runs are finished (seeds "
            + "; ".join(f"{k}: {', '.join(map(str, v)) or 'none'}" for k, v in seeds.items())
            + f"); missing: {', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''}. The same invocation "
            "without --interim restores these runs from their snapshots and trains the rest."
        )
        problems = _page_from_snapshots(out, workdir, used, done, command, str(threads), tiny, start, text)
    print(
        f"results.py: interim {out / PAGE} from {len(done)} of {len(specs)} planned runs"
        + (f"; CHECK FAILED: {problems}" if problems else "")
    )
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.tiny and not (args.check or args.estimate) and args.out is None:
        _parser().error("--tiny needs --out: its page must never replace docs/results.md")
    out = (args.out or ROOT / "docs").resolve()
    if args.check:
        manifest = json.loads((out / MANIFEST).read_text())
        root = args.root or out / ASSETS / "runs"
        problems = check_manifest((out / PAGE).read_text(), manifest, root)
        if out == (ROOT / "docs").resolve():
            problems += check_blocks(manifest, root)
            problems += figures_outside_blocks((out / PAGE).read_text(), prose_files(), __doc__ or "")
        print("\n".join(problems) or f"{out / PAGE}: every table line and generated figure is what the runs wrote")
        return 1 if problems else 0
    if args.write:
        manifest = json.loads((out / MANIFEST).read_text())
        changed = write_blocks(manifest, out / ASSETS / "runs")
        print(f"results.py: generated blocks rewritten in {', '.join(changed) or 'no file (all current)'}")
        return 0
    if args.rewrite:
        return rewrite(out, " ".join(["python experiments/results.py", *(argv if argv is not None else sys.argv[1:])]))
    args = _resolve(args)
    if args.estimate:
        print(estimate_text(ROOT / "docs" / ASSETS / "runs", args))
        return 0
    workdir = (args.workdir or ROOT / "runs" / ("results_tiny" if args.tiny else "results")).resolve()
    datasets = plan(args)
    specs = run_specs(datasets, args.seeds)
    if args.snapshot:
        done = [s.name for s in specs if _finished(workdir / s.name)]
        for name in done:
            save_snapshot(workdir / name, out / ASSETS / "runs" / name)
        print(f"results.py: {len(done)} of {len(specs)} runs finished, snapshotted into {out / ASSETS / 'runs'}")
        return 0
    given = argv if argv is not None else sys.argv[1:]
    command = "python experiments/results.py " + " ".join(shlex.quote(a) for a in given)
    if args.interim:
        return interim(out, datasets, specs, command, args.threads, args.tiny)
    stale = stale_runs(specs, workdir)
    if stale and not args.retrain:
        raise SystemExit(stale_message(stale, workdir))
    lock = hold_workdir(workdir)
    try:
        return train_and_write(args, datasets, specs, workdir, out, command)
    finally:
        lock.release()


def train_and_write(
    args: argparse.Namespace, datasets: list[Dataset], specs: list[RunSpec], workdir: Path, out: Path, command: str
) -> int:
    """Train every run of ``specs`` not finished yet into ``workdir`` (``args.jobs`` at a time, the timing runs first),
    then the report and the page into ``out``; 1 when the page's own check fails."""
    start = time.time()
    print(f"results.py: {len(specs)} runs into {workdir}, page into {out} (load {_loadavg()})", flush=True)

    def log(message: str) -> None:
        print(f"[{time.time() - start:7.0f} s] {message}", flush=True)

    for phase, runs in phases(specs):
        jobs = max(1, args.timing_jobs if phase == "timing" else args.jobs)
        context = {"invocation": command.strip(), "phase": phase, "jobs": jobs, "machine": _machine()}

        def one(spec: RunSpec, context: dict = context) -> None:
            record = train(
                spec, workdir, args.threads, args.run_timeout, log, out / ASSETS / "runs", args.retrain, context
            )
            log(
                f"{specs.index(spec) + 1}/{len(specs)} {spec.name}: {record['wall_s']:.0f} s wall, "
                f"{record['cpu_s']:.0f} s CPU"
            )

        # In plan order; a run started beside the one that trains its global CNN (or DDP) waits for it in the store.
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, runs))
    report(specs, workdir, args.threads, plots=not args.tiny)
    log("ddcnn-report done")
    out.mkdir(parents=True, exist_ok=True)
    (out / ASSETS).mkdir(exist_ok=True)
    meta = {
        "commit": _git_commit(),
        "command": command,
        "written": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": f"{time.time() - start:.0f}",
        "threads": str(args.threads),
    }
    page, manifest = write_page(datasets, specs, workdir, out, meta, args.tiny)
    problems = check_manifest(page, manifest, workdir)
    if not problems and out == (ROOT / "docs").resolve():
        log(f"generated blocks rewritten in {write_blocks(manifest, out / ASSETS / 'runs') or 'no file'}")
    log(f"wrote {out / PAGE} and {out / MANIFEST}" + (f"; CHECK FAILED: {problems}" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
