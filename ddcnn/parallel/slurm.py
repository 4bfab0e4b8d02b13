"""SLURM: job ids for the record, ranks of ``srun`` tasks, requeue ownership and the Hydra launcher.

Requeueing has exactly one owner: submitit (through Hydra's submitit launcher). On preemption or time-out
submitit catches its signal (``USR2``), re-pickles the job and requeues it; a job requeued by any other means
(``scontrol requeue``, a preempting partition) simply starts again. Either way the local stage skips the
sub-domains whose ``done`` marker exists and resumes the interrupted one from ``local/i/last.ckpt``.
Lightning's own SLURM auto-requeue (``USR1``) is therefore switched off (:func:`slurm_plugins`): two owners
would each requeue the job.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = ["SrunTask", "slurm_info", "srun_task", "shard", "slurm_plugins", "independent_ranks"]

_INFO_KEYS = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "restart_count": "SLURM_RESTART_COUNT",
    "procid": "SLURM_PROCID",
    "ntasks": "SLURM_NTASKS",
    "partition": "SLURM_JOB_PARTITION",
    "nodelist": "SLURM_JOB_NODELIST",
}


def slurm_info() -> dict | None:
    """The SLURM job this process runs in (ids, restart count, rank), or ``None`` outside SLURM.

    ``restart_count`` is 0 on the first run and counts requeues, so a local net's meta shows whether it
    survived a preemption.
    """
    if "SLURM_JOB_ID" not in os.environ:
        return None
    info: dict = {"host": socket.gethostname()}
    for key, env in _INFO_KEYS.items():
        value = os.environ.get(env)
        info[key] = int(value) if value is not None and value.isdigit() else value
    info["restart_count"] = info["restart_count"] or 0
    return info


@dataclass(frozen=True)
class SrunTask:
    """Rank of this process among the tasks of one ``srun`` step."""

    rank: int
    ntasks: int
    local_rank: int = 0


def srun_task(mode: str = "auto") -> SrunTask | None:
    """This process's rank when it is one of several tasks of an ``srun`` step, else ``None``.

    Args:
        mode: ``auto`` detects ``srun`` with more than one task from ``SLURM_STEP_NUM_TASKS`` (set by ``srun``
            for its tasks, not in a batch script that merely asked for ``-n G``, whose single process must
            not train only a 1/G share); ``srun`` requires it; ``single`` never shards.
    """
    if mode not in ("auto", "srun", "single"):
        raise ValueError(f"parallel.mode must be auto, srun or single, got {mode!r}.")
    if mode == "single":
        return None
    ntasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "0") or 0)
    if ntasks > 1 and "SLURM_PROCID" in os.environ:
        return SrunTask(int(os.environ["SLURM_PROCID"]), ntasks, int(os.environ.get("SLURM_LOCALID", "0") or 0))
    if mode == "srun":
        raise ValueError(
            "parallel.mode=srun but this process is not one of several srun tasks (SLURM_STEP_NUM_TASKS is "
            f"{ntasks or 'unset'}); start it as `srun -n G ddcnn-train ...` inside an allocation."
        )
    return None


def shard(indices: Sequence[int], task: SrunTask) -> list[int]:
    """The sub-domains task ``rank`` of ``ntasks`` trains: those with ``i % ntasks == rank``."""
    return [i for i in indices if i % task.ntasks == task.rank]


def independent_ranks() -> None:
    """Let a process that is one of several SLURM tasks train on its own, as rank 0 of a world of one.

    Lightning sets its rank-zero guard from ``SLURM_PROCID`` at import; for an independent local net every
    task must log and write like rank 0.
    """
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    rank_zero_only.rank = 0


def slurm_plugins(num_devices: int = 1) -> list:
    """Trainer plugins under SLURM: Lightning must not requeue (submitit owns that) nor take tasks for ranks.

    A single-device training in a one-task job gets ``SLURMEnvironment(auto_requeue=False)``; a task of a
    multi-task ``srun`` step, or a training that spans several devices inside one task (``ddp_spawn``), gets a
    plain ``LightningEnvironment`` because its processes are not SLURM's tasks. Outside SLURM: no plugins.
    """
    if "SLURM_JOB_ID" not in os.environ:
        return []
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    ntasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS") or 1)
    if ntasks > 1 or num_devices > 1 or os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return [LightningEnvironment()]
    return [SLURMEnvironment(auto_requeue=False)]
