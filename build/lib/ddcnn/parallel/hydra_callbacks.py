"""A Hydra callback that makes every job of a multirun over sub-domains write into one run directory.

Hydra gives each multirun job its own output directory (``sweep.dir/<subdir>``), but the local nets of one
CNN-DNN run must meet in one run directory. :class:`SharedRunDir`, named under ``hydra.callbacks`` by
``conf/hydra/launcher/slurm.yaml``, adds ``paths.run_dir=<absolute sweep dir>`` to the overrides every job
receives, unless the command line sets ``paths.run_dir`` itself or the sweep varies anything but
``subdomain`` (``seed=0,1,2`` sweeps whole runs, each of which needs its own directory). Each job keeps its
own Hydra output directory for its ``.hydra/`` record and log; the override shows in its
``.hydra/overrides.yaml``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, read_write

log = logging.getLogger(__name__)

__all__ = ["SharedRunDir"]


class SharedRunDir(Callback):
    """``on_multirun_start``: point ``paths.run_dir`` of every job at the sweep directory."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        task = config.hydra.overrides.task
        parsed = OverridesParser.create().parse_overrides([str(o) for o in task])
        if any(o.key_or_group == "paths.run_dir" for o in parsed):
            return
        swept = sorted(o.key_or_group for o in parsed if o.is_sweep_override() and o.key_or_group != "subdomain")
        if swept:  # e.g. seed=0,1,2: separate runs, each in its own directory
            log.info("the sweep varies %s: each job keeps its own run directory", ", ".join(swept))
            return
        run_dir = Path(str(config.hydra.sweep.dir)).resolve()
        with read_write(config.hydra.overrides):
            task.append(f"paths.run_dir={run_dir}")
        log.info("every job of this sweep writes into the run directory %s", run_dir)
