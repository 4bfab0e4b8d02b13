"""The stage registry: the one list of the stages of a run, in run order, as plain data.

Each entry says what a stage is called, which module trains it, which stages it needs, its seed offset and the row
it adds to the results table: its display name, the devices it uses and which recorded times add up to its time.
The pipeline (``stage=all``, ``methods.enabled``), the executors in :mod:`ddcnn.parallel`, the evaluate stage
(``results.json``, ``results.md``) and ``ddcnn-report`` all read it, so a stage cannot be trained and then silently
left out of the table. Nothing here imports a stage module: :func:`load` does that by name, when a stage runs, so
a coordinating process or the report never imports the training engine (Lightning Fabric).

A row's time is a sum of *terms*: ``local_total`` (all local nets one after another), ``local_max`` (the slowest
local net: the local nets in parallel), ``local_oof_max`` (the slowest sub-domain's local net and its out-of-fold
trainings, one device per sub-domain) or a stage name (that stage's recorded ``time_s``). A ``key`` or ``name``
may contain ``{input}``, filled from the stage's ``meta.json`` (the coarse DNN's input: ``probs`` or ``logits``).

Adding a method (README, "Add a method"): its module in ``ddcnn/stages/`` with ``run(ctx, device) -> meta``, one
:class:`Stage` entry below, its switch and defaults in ``conf/methods/``, its settings class in
``ddcnn/settings/run.py`` (without it its keys are refused), its keys in ``ddcnn.rundir.NEUTRAL_SETTINGS``, its test.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ResultRow", "Stage", "STAGES", "OPTIONAL_STAGES", "STAGE_NAMES", "TIME_TERMS", "get", "load", "run"]

# Time terms besides stage names: every local net one after another, and the slowest one.
TIME_TERMS = ("local_total", "local_max", "local_oof_max")


@dataclass(frozen=True)
class ResultRow:
    """How a finished stage appears in the results table.

    Attributes:
        key: Key of the method in ``results.json`` (``accuracy``, ``metrics``, ``methods``).
        name: Display name.
        sequential: Time terms that add up to its training time on one device, one stage after another; ``None``
            when it has no one-device time (it trained on several devices at once).
        projected: Time terms that add up to its time on the devices it can use.
        devices: ``1``, ``"N"`` (one per sub-domain) or ``"meta:<key>"`` (read from the stage's ``meta.json``).
        order: Position in the table (rows sort by it, then by key).
    """

    key: str
    name: str
    sequential: tuple[str, ...] | None
    projected: tuple[str, ...]
    devices: int | str
    order: float


@dataclass(frozen=True)
class Stage:
    """One stage of a run.

    Attributes:
        name: Stage name: ``stage=<name>`` and the folder ``RUN_DIR/<name>/``.
        module: The module whose ``run(ctx, device, ...)`` trains it.
        requires: Stages that must have finished before it starts.
        seed_offset: Offset of its seed (:func:`ddcnn.context.subdomain_seed`); ``None`` for the local nets, which
            use their sub-domain index.
        optional: Whether it is a method of the family that ``methods.enabled.<name>`` turns on for ``stage=all``.
        row: Its row in the results table, or ``None`` (the local nets have one row each, made by the report).
        summary: One line for ``--help`` texts and the docs.
        ranks: Under ``srun -n G``: ``"zero"`` (rank 0 trains it while the others are done or wait) or ``"all"``
            (every task joins: one training with DDP across the G tasks, world size and ranks from SLURM).
        reusable: Its result depends on nothing of the decomposition (``decomposition``, ``coarse``, ``methods``) or
            the devices of a run: with ``store.reuse`` it is trained once per settings and copied into every run of a
            sweep that shares them (:mod:`ddcnn.stages.reuse`).
    """

    name: str
    module: str
    requires: tuple[str, ...]
    seed_offset: int | None
    optional: bool
    row: ResultRow | None
    summary: str
    ranks: str = "zero"
    reusable: bool = False


_N = "N"
STAGES: tuple[Stage, ...] = (
    Stage("local", "ddcnn.stages.local", (), None, False, None, "one local CNN per sub-domain, on its sub-images"),
    Stage(
        "coarse",
        "ddcnn.stages.coarse",
        ("local",),
        -1,
        False,
        ResultRow(
            "cnn_dnn_{input}",
            "CNN-DNN (coarse DNN on {input})",
            ("local_total", "coarse"),
            ("local_max", "coarse"),
            _N,
            3,
        ),
        "the coarse DNN on the concatenated local outputs",
    ),
    Stage(
        "global",
        "ddcnn.stages.global_cnn",
        (),
        -2,
        False,
        ResultRow("global", "global CNN", ("global",), ("global",), 1, 0),
        "the baseline: the same network family on full images",
        reusable=True,
    ),
    Stage(
        "coarse_alt",
        "ddcnn.stages.coarse_alt",
        ("local",),
        -1,
        True,
        ResultRow(
            "cnn_dnn_{input}",
            "CNN-DNN (coarse DNN on {input})",
            ("local_total", "coarse_alt"),
            ("local_max", "coarse_alt"),
            _N,
            3,
        ),
        "a second coarse DNN on the other local output (logits vs probabilities)",
    ),
    Stage(
        "stacker",
        "ddcnn.stages.stacker",
        ("local",),
        -6,
        True,
        ResultRow(
            "stacker",
            "convex stacker (logistic regression)",
            ("local_total", "stacker"),
            ("local_max", "stacker"),
            _N,
            4,
        ),
        "the convex stacker: multinomial logistic regression on the local outputs, L2 chosen on validation",
    ),
    Stage(
        "local_oof",
        "ddcnn.stages.local_oof",
        (),
        -7,
        True,
        None,
        "out-of-fold local outputs: k local nets per sub-domain, each predicting the training rows it did not see",
    ),
    Stage(
        "coarse_oof",
        "ddcnn.stages.coarse_oof",
        ("local", "local_oof"),
        -1,
        True,
        ResultRow(
            "cnn_dnn_oof",
            "CNN-DNN, coarse DNN fit on out-of-fold outputs",
            ("local_total", "local_oof", "coarse_oof"),
            ("local_oof_max", "coarse_oof"),
            _N,
            3.2,
        ),
        "the coarse DNN fit on out-of-fold local outputs (cross-fitting)",
    ),
    Stage(
        "coarse_val",
        "ddcnn.stages.coarse_val",
        ("local",),
        -1,
        True,
        ResultRow(
            "cnn_dnn_val",
            "CNN-DNN, coarse DNN fit on validation outputs",
            ("local_total", "coarse_val"),
            ("local_max", "coarse_val"),
            _N,
            3.4,
        ),
        "the coarse DNN fit on half of the validation split's local outputs, selected on the other half",
    ),
    Stage(
        "e2e",
        "ddcnn.stages.e2e",
        (),
        -3,
        True,
        ResultRow("e2e", "CNN-DNN end to end", ("e2e",), ("e2e",), 1, 5),
        "the CNN-DNN trained end to end from scratch on full images",
    ),
    Stage(
        "transfer",
        "ddcnn.stages.transfer",
        ("local", "coarse"),
        -4,
        True,
        ResultRow(
            "transfer",
            "CNN-DNN transfer (local nets + coarse DNN, trained further)",
            ("local_total", "coarse", "transfer"),
            ("local_max", "coarse", "transfer"),
            _N,
            6,
        ),
        "the assembled CNN-DNN trained further end to end",
    ),
    Stage(
        "global_transfer",
        "ddcnn.stages.global_transfer",
        ("local",),
        -5,
        True,
        ResultRow(
            "global_transfer",
            "global CNN transfer (init. from local nets)",
            ("local_total", "global_transfer"),
            ("local_max", "global_transfer"),
            _N,
            7,
        ),
        "the global CNN initialised from the local nets",
    ),
    Stage(
        "global_ddp",
        "ddcnn.stages.global_ddp",
        (),
        -2,
        True,
        ResultRow("global_ddp", "global CNN, DDP", None, ("global_ddp",), "meta:num_devices", 8),
        "the global CNN trained with DDP on several devices",
        ranks="all",
    ),
    Stage(
        "global_ensemble",
        "ddcnn.stages.global_ensemble",
        ("local", "coarse", "global"),
        -8,
        True,
        ResultRow(
            "global_ensemble",
            "ensemble of k global CNNs (mean probability)",
            ("global_ensemble",),
            ("global_ensemble",),
            1,
            0.4,
        ),
        "k global CNNs from new initialisations (k: the CNN-DNN's one-device time over the global CNN's), mean "
        "probability",
    ),
    Stage(
        "global_ensemble_coarse",
        "ddcnn.stages.global_ensemble_coarse",
        ("global_ensemble",),
        -1,
        True,
        ResultRow(
            "global_ensemble_coarse",
            "ensemble of k global CNNs (coarse DNN)",
            ("global_ensemble", "global_ensemble_coarse"),
            ("global_ensemble", "global_ensemble_coarse"),
            1,
            0.5,
        ),
        "the coarse DNN fit on the k global CNNs' outputs as on N local nets' (the same fit and seed)",
    ),
    Stage(
        "global_wide",
        "ddcnn.stages.global_wide",
        (),
        -9,
        True,
        ResultRow(
            "global_wide", "global CNN, the CNN-DNN's parameter count", ("global_wide",), ("global_wide",), 1, 0.6
        ),
        "the global CNN widened (model.width_mult) to the CNN-DNN's parameter count: local nets and coarse DNN",
    ),
)

STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
# The optional method stages, in the order stage=all runs them: after global, before evaluate.
OPTIONAL_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.optional)


def get(name: str) -> Stage:
    """The registry entry of stage ``name`` (a ``ValueError`` naming the stages when there is none)."""
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise ValueError(f"unknown stage {name!r}; the stages are {list(STAGE_NAMES)}.")


def load(name: str) -> Callable[..., dict]:
    """The ``run`` function of stage ``name``, importing its module now (and the engine, Lightning Fabric, with it)."""
    return importlib.import_module(get(name).module).run


def run(name: str, ctx, device=None, rank: int = 0, **kwargs) -> dict:
    """Run stage ``name`` as the one owner of its folder (:meth:`ddcnn.rundir.RunDir.lock`): a second process for the
    same stage waits, then finds the work done and skips it. The peers (``rank > 0``) of a stage that every
    ``srun`` task joins take no lock: rank 0 holds it for the step, and they train with it."""
    if rank > 0:
        return load(name)(ctx, device, **kwargs)
    with ctx.run.lock(name, kwargs.get("subdomain")):
        return load(name)(ctx, device, **kwargs)
