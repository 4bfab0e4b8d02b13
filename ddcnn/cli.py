"""Console entry points: ``ddcnn-train``, ``ddcnn-slurm``, ``ddcnn-scaling``. Thin: they parse and call the library.

``ddcnn-report`` (:mod:`ddcnn.report.cli`), ``ddcnn-export`` / ``ddcnn-predict`` (:mod:`ddcnn.predict`) and
``ddcnn-nifti-convert`` (:mod:`ddcnn.data.convert`) live with the code they wrap.
"""

from __future__ import annotations

import argparse
import logging
import math
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ddcnn.config import CONFIG_DIR
from ddcnn.runtime import quiet_process

__all__ = ["CONFIG_DIR", "train_main", "optimized_value", "scaling_main", "slurm_main", "slurm_commands"]

log = logging.getLogger(__name__)


def optimized_value(cfg: DictConfig, results: dict) -> float | None:
    """The value a Hydra sweeper optimises: ``optimized_metric`` (a validation figure of ``results.json``).

    ``optimized_metric`` is a path into ``results["val"]`` such as ``val/accuracy/cnn_dnn`` (the default) or
    ``val/balanced_accuracy/global``. Test figures are refused: a sweep that tunes on the test split reports
    numbers that are no longer test numbers.
    """
    path = str(cfg.get("optimized_metric") or "val/accuracy/cnn_dnn")
    parts = [p for p in path.split("/") if p]
    if not parts or parts[0] != "val":
        raise ValueError(
            f"optimized_metric={path!r} must name a validation figure (val/<metric>/<method>, e.g. "
            f"val/accuracy/cnn_dnn): a sweep must never be tuned on the test split."
        )
    value = results
    for part in parts:
        if not isinstance(value, dict) or part not in value:
            raise ValueError(
                f"optimized_metric={path!r} is not in results.json (no {part!r}); the validation figures are "
                f"{sorted((results.get('val') or {}).get('accuracy', {}))} under val/accuracy/..."
            )
        value = value[part]
    return None if value is None else float(value)


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def _train_main(cfg: DictConfig) -> float | None:
    from ddcnn.parallel.workers import LocalStageFailed
    from ddcnn.pipeline import train
    from ddcnn.rundir import StageBusy

    quiet_process()
    try:
        results = train(cfg)
        # What Hydra sweepers optimise: a validation figure, never a test one.
        return optimized_value(cfg, results) if isinstance(results, dict) and "val" in results else None
    except (ValueError, OSError, LocalStageFailed, StageBusy) as err:  # ours say what is wrong and what to do
        print(f"ddcnn-train: error: {err}", file=sys.stderr)
        sys.exit(2)


def train_main() -> None:
    """``ddcnn-train [hydra overrides]``: run the CNN-DNN pipeline (or one stage of it)."""
    _train_main()
    # Reached only when the run's work is done: an srun task that joined a DDP stage leaves before the interpreter's
    # teardown, which can abort it (and so end the other tasks under srun --kill-on-bad-exit=1).
    from ddcnn.engine.launch import exit_past_a_lingering_process_group

    exit_past_a_lingering_process_group()


# --- ddcnn-scaling -------------------------------------------------------------------------------
def scaling_main(argv: list[str] | None = None) -> None:
    """``ddcnn-scaling RUN_DIR [--devices 1,2,4,8] [--mixed 2x1.0,6x0.25] [--startup-s S]``."""
    from ddcnn.parallel.schedule import parse_device_counts, parse_mixed
    from ddcnn.report.scaling import scaling_table

    parser = argparse.ArgumentParser(
        prog="ddcnn-scaling",
        description="Predicted wall time and speedup of a finished run's CNN-DNN on P devices (LPT placement of "
        "the measured local-net times), against the global CNN on one device.",
    )
    parser.add_argument("run_dir", help="run directory of a run whose local nets have finished")
    parser.add_argument("--devices", help="device counts, e.g. 1,2,4,8 (default: 1, 2, 4, ... up to N)")
    parser.add_argument("--mixed", help="a mixed device set as COUNTxSPEED groups, e.g. 2x1.0,6x0.25")
    parser.add_argument("--startup-s", type=float, default=0.0, help="fixed start-up seconds added to each row")
    args = parser.parse_args(argv)
    try:
        counts = parse_device_counts(args.devices) if args.devices else None
        mixed = parse_mixed(args.mixed) if args.mixed else None
        text, _ = scaling_table(args.run_dir, counts, mixed, args.startup_s)
    except (ValueError, OSError) as err:
        parser.exit(2, f"ddcnn-scaling: error: {err}\n")
    print(text)


# --- ddcnn-slurm ---------------------------------------------------------------------------------
def _ddcnn_train() -> list[str]:
    script = Path(sys.executable).parent / "ddcnn-train"
    found = str(script) if script.is_file() else shutil.which("ddcnn-train")
    return [found] if found else [sys.executable, "-c", "from ddcnn.cli import train_main; train_main()"]


def _num_subdomains(overrides: list[str]) -> int:
    from ddcnn.config import compose

    cfg = compose([o for o in overrides if not o.startswith("hydra")])
    return math.prod(int(g) for g in cfg.decomposition.grid)


def slurm_commands(run_dir: str | Path, overrides: list[str], launcher: str = "slurm") -> list[list[str]]:
    """The two Hydra multiruns of a whole CNN-DNN run on SLURM.

    1. one array task per sub-domain (``stage=local``), all writing into ``run_dir``;
    2. once they all succeeded, one job with ``stage=all``: it finds every local net done, trains the
       coarse DNN and the global CNN, and evaluates.
    """
    run_dir = Path(run_dir).resolve()
    n = _num_subdomains(overrides)
    train = _ddcnn_train()
    common = [f"hydra/launcher={launcher}", f"hydra.sweep.dir={run_dir}", f"paths.run_dir={run_dir}"]
    if not any(o.split("=", 1)[0].lstrip("+") == "run_generation" for o in overrides):
        # One generation for the array and the final job: with force=true the final job finds the array's local
        # nets done in this generation and never trains them again.
        common.append(f"run_generation=slurm-{uuid.uuid4().hex[:12]}")
    local = [
        *train,
        "-m",
        *common,
        "stage=local",
        f"subdomain={','.join(str(i) for i in range(n))}",
        "hydra.sweep.subdir=hydra/local_${hydra.job.num}",
        *overrides,
    ]
    final = [*train, "-m", *common, "stage=all", "hydra.sweep.subdir=hydra/final", *overrides]
    return [local, final]


def one_job_script(
    run_dir: str | Path,
    overrides: list[str],
    nodes: int = 1,
    ntasks_per_node: int = 1,
    gpus_per_task: int = 0,
    sbatch: list[str] = (),
) -> str:
    """The batch script of a whole run in one allocation: ``srun`` starts one ``ddcnn-train`` per task.

    The tasks share the local nets (sub-domain ``i`` on task ``i % G``); rank 0 trains the coarse DNN and the global
    CNN; every task joins the stages that train across the allocation (``global_ddp`` with DDP on the G tasks, world
    size and ranks from SLURM); rank 0 evaluates. ``--requeue``: a requeued job resumes every stage from its last
    checkpoint and skips what is done.
    """
    run_dir = Path(run_dir).resolve()
    tasks = int(nodes) * int(ntasks_per_node)
    generation = (
        []
        if any(o.split("=", 1)[0].lstrip("+") == "run_generation" for o in overrides)
        else [f"run_generation=slurm-{uuid.uuid4().hex[:12]}"]
    )
    train = [
        *_ddcnn_train(),
        "stage=all",
        f"paths.run_dir={run_dir}",
        f"hydra.run.dir={run_dir}/hydra/rank${{oc.env:SLURM_PROCID}}",
        *generation,
        *overrides,
    ]
    given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    if tasks > 1:  # the fair baseline: the global CNN with DDP on the same G devices
        for key, value in (("methods.enabled.global_ddp", "true"), ("methods.global_ddp.num_devices", tasks)):
            if key not in given:
                train.append(f"{key}={value}")
    lines = [
        "#!/bin/bash",
        "#SBATCH --job-name=ddcnn",
        f"#SBATCH --nodes={int(nodes)}",
        f"#SBATCH --ntasks-per-node={int(ntasks_per_node)}",
        *([f"#SBATCH --gpus-per-task={int(gpus_per_task)}"] if gpus_per_task else []),
        "#SBATCH --requeue",
        f"#SBATCH --output={run_dir}/slurm/%j.out",
        *(f"#SBATCH {arg}" for arg in sbatch),
        "set -euo pipefail",
        # Every task's failure ends the step: a rank that died would leave the others waiting in DDP.
        "srun --kill-on-bad-exit=1 " + shlex.join(train),
    ]
    return "\n".join(lines) + "\n"


def slurm_main(argv: list[str] | None = None) -> None:
    """``ddcnn-slurm RUN_DIR [--launcher slurm] [--print] [hydra overrides ...]``: a whole run on SLURM."""
    parser = argparse.ArgumentParser(
        prog="ddcnn-slurm",
        description="Train a whole CNN-DNN run on SLURM through Hydra's submitit launcher: one array task per "
        "local net, then one job for the coarse DNN, the global CNN and the evaluation. Blocks until the jobs "
        "finish (run it in tmux/screen or as a small job); run it again to resume: finished stages are skipped.",
    )
    parser.add_argument("run_dir", help="the run directory every job writes into (shared file system)")
    parser.add_argument("--launcher", default="slurm", help="config of conf/hydra/launcher/ (default: slurm)")
    parser.add_argument("--print", action="store_true", help="print the commands (or the script) instead of running")
    one = parser.add_argument_group(
        "one allocation (--one-job)",
        "the whole comparison in one job: the local nets sharded over the tasks, the coarse DNN and the global CNN on "
        "rank 0, the global CNN with DDP on all tasks (docs/slurm.md: when to pick which)",
    )
    one.add_argument("--one-job", action="store_true", help="submit one job with srun instead of an array")
    one.add_argument("--nodes", type=int, default=1)
    one.add_argument("--ntasks-per-node", type=int, default=1, help="one task per device (GPU or CPU share)")
    one.add_argument("--gpus-per-task", type=int, default=0)
    one.add_argument("--sbatch", action="append", default=[], help="another sbatch option, e.g. --sbatch=--time=120")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every job, e.g. decomposition=4x4")
    args = parser.parse_intermixed_args(argv)
    if args.one_job:
        script = one_job_script(
            args.run_dir, args.overrides, args.nodes, args.ntasks_per_node, args.gpus_per_task, args.sbatch
        )
        path = Path(args.run_dir).resolve() / "slurm" / "one_job.sh"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(script)
        command = ["sbatch", "--wait", str(path)]
        print(f"+ {shlex.join(command)}\n{script}", flush=True)
        if not args.print and subprocess.call(command) != 0:
            parser.exit(1, f"ddcnn-slurm: the job failed (see {path.parent}/*.out); fix it and submit again.\n")
        return
    try:
        commands = slurm_commands(args.run_dir, args.overrides, args.launcher)
    except Exception as err:  # a bad override: Hydra's message says which
        parser.exit(2, f"ddcnn-slurm: error: {err}\n")
    for cmd in commands:
        print("+ " + shlex.join(cmd), flush=True)
        if not args.print and subprocess.call(cmd) != 0:
            parser.exit(1, "ddcnn-slurm: a job failed (see the log above); fix it and run the same command again.\n")
