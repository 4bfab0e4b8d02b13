"""``train(cfg)``: run the configured stages of one CNN-DNN run in order (the CLI's entry point), then evaluate.

It builds the run's :class:`~ddcnn.settings.RunSettings` from the composed configuration, which checks every setting
once, before anything is read, written or started; the stages and executors below read those settings.

The only module that imports every layer: the executors (:mod:`ddcnn.parallel`) for the local stage, the stage
modules through the registry (:mod:`ddcnn.registry`), and the report and export for the evaluate stage.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from pathlib import Path

from omegaconf import DictConfig, open_dict

from ddcnn import registry
from ddcnn.context import Context, build_context, write_split_manifest
from ddcnn.runtime import keep_freed_host_memory, resolve_device, run_generation, srun_task
from ddcnn.settings import STAGES, RunSettings

log = logging.getLogger(__name__)

__all__ = ["train", "STAGES", "OPTIONAL_STAGES", "enabled_stages", "run_evaluate"]

OPTIONAL_STAGES = registry.OPTIONAL_STAGES


def enabled_stages(settings: RunSettings) -> list[str]:
    """The optional stages that ``stage=all`` runs, in order (``methods.enabled.<stage>: true``)."""
    wanted = {name for name, on in settings.methods.enabled.items() if on}
    for name in list(wanted):  # an enabled method brings the optional stages it needs (coarse_oof: local_oof)
        wanted |= {r for r in registry.get(name).requires if r in OPTIONAL_STAGES}
    return [name for name in OPTIONAL_STAGES if name in wanted]


def _subdomains(settings: RunSettings, num_subdomains: int) -> list[int]:
    return list(range(num_subdomains)) if settings.subdomain is None else list(settings.subdomain)


def run_evaluate(ctx: Context) -> dict:
    """Accuracy of every local net, the combiners, the CNN-DNN and the global CNN; times and speedup; plots, export."""
    from ddcnn.report.results import evaluate_run

    start = time.perf_counter()
    results = evaluate_run(ctx.run, ctx.decomposition, ctx.data, ctx.settings)
    if ctx.settings.report.plots:
        from ddcnn.report.plots import save_run_plots

        save_run_plots(ctx.run, ctx.decomposition, ctx.data, results)
    if ctx.settings.report.export and ctx.run.is_done("coarse"):
        from ddcnn.export import export_context

        export_context(ctx)
    acc = results["accuracy"]
    one_device = (results.get("speedup_equal_devices") or {}).get("1") or {}  # equal devices (docs/protocol.md)
    log.info(
        "evaluate: CNN-DNN test acc %s, global CNN %s, speedup on 1 device %s, in %.1f s",
        *(f"{v:.4f}" if v is not None else "-" for v in (acc["cnn_dnn"], acc["global"], one_device.get("speedup"))),
        time.perf_counter() - start,
    )
    return results


def _wait_for_rank_zero(ctx: Context, stages: list[str], poll_s: float = 1.0) -> None:
    """Block until rank 0 finished ``stages`` in this run generation (with ``force=true``; else finished at all)."""
    generation = ctx.settings.run_generation if ctx.settings.force else None
    while not all(ctx.run.is_done(name, generation=generation) for name in stages):
        time.sleep(poll_s)


def train(cfg: DictConfig, run_dir: str | Path | None = None) -> dict:
    """Run ``cfg.stage`` (``all`` or one of :data:`STAGES`) in ``run_dir`` (default ``cfg.paths.run_dir``).

    Returns:
        The results of the evaluate stage when it ran, else a dict with the metadata of the stages that ran.
    """
    # One run generation for everything this call trains (its worker processes receive it with the configuration):
    # with force=true each stage is cleared once, and only markers of this generation count as its work.
    # Freed host memory kept for reuse, in this process and every one it starts (workers, DDP ranks): first, so that
    # all the run's stages are timed under one allocator.
    keep_freed_host_memory()
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.run_generation = run_generation(cfg.get("run_generation"))
    # Every setting checked once, before anything is read, written or started (and the srun step a DDP stage spans).
    settings = RunSettings.from_config(cfg)
    stage = settings.stage
    optional = enabled_stages(settings) if stage == "all" else [stage] if stage in OPTIONAL_STAGES else []
    run_dir = run_dir if run_dir is not None else settings.run_dir
    settings = settings.in_run_dir(run_dir)  # before any worker starts: a directory of the old split seed keeps it
    pool = None
    if stage in ("all", "local") and settings.parallel.workers > 1:
        from ddcnn.parallel.workers import start_workers_early

        # Worker processes start now: their start-up overlaps the loading of the data below.
        n = math.prod(settings.decomposition.grid)
        early = [i for i in _subdomains(settings, n) if 0 <= i < n]
        pool = start_workers_early(settings, run_dir, early)
    try:
        return _train(cfg, settings, run_dir, optional, pool)
    finally:
        if pool is not None:
            pool.close()


def _train(cfg: DictConfig, settings: RunSettings, run_dir, optional: list[str], pool) -> dict:
    stage = settings.stage
    ctx = build_context(cfg, run_dir, claim=False, settings=settings)
    indices = _subdomains(settings, ctx.decomposition.num_subdomains) if stage in ("all", "local") else []
    bad = [i for i in indices if not 0 <= i < ctx.decomposition.num_subdomains]
    if bad:
        raise ValueError(
            f"subdomain {bad} does not exist: the {ctx.decomposition.describe()} has sub-domains "
            f"0..{ctx.decomposition.num_subdomains - 1} (row-major, last axis fastest)."
        )
    ctx.run.claim(ctx.identity)  # data.num_classes, data.in_channels as resolved from the data
    write_split_manifest(ctx)
    log.info("run directory %s: %s", ctx.run.root, ctx.decomposition.describe())
    device = resolve_device(settings.device)  # auto: every stage of this process on the same kind of device
    out: dict = {}
    start = time.perf_counter()
    task = srun_task(settings.parallel.mode)
    rank = task.rank if task is not None else 0
    if stage in ("all", "local"):
        # In this process, in parallel.workers processes, or this srun task's share: ddcnn.parallel decides.
        from ddcnn.parallel.workers import run_local_stage

        out["local"] = run_local_stage(ctx, indices, pool)
    later = [name for name in ("coarse", "global") if stage in ("all", name)] + optional
    for k, name in enumerate(later):
        # Under srun -n G, rank 0 trains the one-device stages; every task joins those the registry marks "all".
        if rank == 0 or registry.get(name).ranks == "all":
            if rank != 0:  # join when rank 0 gets there, not before (DDP's rendezvous would time out meanwhile)
                _wait_for_rank_zero(ctx, [n for n in later[:k] if registry.get(n).ranks == "zero"])
            out[name] = registry.run(name, ctx, device, rank=rank)
    if rank != 0:
        log.info("srun task %d: its share finished; rank 0 finishes the run", rank)
        return out
    if stage in ("all", "evaluate"):
        results = run_evaluate(ctx)
        from ddcnn.report.results import results_markdown

        print(results_markdown(results))
        log.info("stages %s finished in %.1f s", stage, time.perf_counter() - start)
        return results
    log.info("stage %s finished in %.1f s", stage, time.perf_counter() - start)
    return out
