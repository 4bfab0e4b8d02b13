"""Console entry points of the parallel package: ``ddcnn-scaling`` and ``ddcnn-slurm``. Thin wrappers."""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["scaling_main", "slurm_main", "slurm_commands"]


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


def _ddcnn_train() -> list[str]:
    script = Path(sys.executable).parent / "ddcnn-train"
    found = str(script) if script.is_file() else shutil.which("ddcnn-train")
    return [found] if found else [sys.executable, "-c", "from ddcnn.cli import train_main; train_main()"]


def _num_subdomains(overrides: list[str]) -> int:
    from hydra import compose, initialize_config_dir

    from ddcnn.cli import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[o for o in overrides if not o.startswith("hydra")])
    n = 1
    for g in cfg.decomposition.grid:
        n *= int(g)
    return n


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
    parser.add_argument("--print", action="store_true", help="print the two commands instead of running them")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every job, e.g. decomposition=4x4")
    args = parser.parse_intermixed_args(argv)
    try:
        commands = slurm_commands(args.run_dir, args.overrides, args.launcher)
    except Exception as err:  # a bad override: Hydra's message says which
        parser.exit(2, f"ddcnn-slurm: error: {err}\n")
    for cmd in commands:
        print("+ " + shlex.join(cmd), flush=True)
        if not args.print and subprocess.call(cmd) != 0:
            parser.exit(1, "ddcnn-slurm: a job failed (see the log above); fix it and run the same command again.\n")
