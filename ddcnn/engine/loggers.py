"""What a training shows and logs: a progress bar or one line per epoch, and the loggers of the ``logger`` group.

``logs/metrics.csv`` is written by the loop itself (with its checkpoints, so it holds every epoch once across a
resume). The ``logger`` group adds, per stage: :class:`TensorBoardLogger` (torch's ``SummaryWriter``, ``<stage>/tb/``)
and :class:`MLflowLogger` (mlflow's own client: one MLflow run per stage). Any object with
``log_metrics(metrics, step)`` (and optionally ``save()`` and ``finalize(status)``) can be configured the same way
(``_target_`` + ``_partial_: true``). Lightning Fabric's loggers would log only where its ``rank_zero_only`` says rank
0, a rank it reads from ``SLURM_PROCID`` at import: the tasks of an srun step that train their own local nets (task 1,
2, ...) would write nothing, which is why the TensorBoard logger here is ddcnn's own (tests/engine/test_loggers.py).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra

from ddcnn.data.progress import open_bar

log = logging.getLogger(__name__)

__all__ = ["TensorBoardLogger", "MLflowLogger", "build_loggers", "EpochReporter", "stage_name"]


def stage_name(folder: Path) -> str:
    """``local 3`` for ``.../local/03``, else the folder's name (the stage)."""
    folder = Path(folder)
    return f"local {int(folder.name)}" if folder.parent.name == "local" and folder.name.isdigit() else folder.name


class TensorBoardLogger:
    """Scalars to TensorBoard event files in ``save_dir/name[/version]`` through torch's ``SummaryWriter``.

    Args:
        save_dir: The stage folder (set by :func:`build_loggers`).
        name: Sub-folder of the event files.
        version: A further sub-folder, or ``""``/``None`` for none.
    """

    def __init__(self, save_dir: str | Path, name: str = "tb", version: str | int | None = None) -> None:
        self.log_dir = Path(save_dir) / name / (str(version) if version not in (None, "") else "")
        self._writer = None

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), global_step=step)

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str = "success") -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class MLflowLogger:
    """Metrics to one MLflow run through mlflow's own client (``MlflowClient``), sent in batches.

    Args:
        experiment_name: The MLflow experiment (created when missing).
        tracking_uri: Where MLflow stores runs (``sqlite:///RUN_DIR/mlflow.db``, a server's URL); ``None``: mlflow's
            default (``MLFLOW_TRACKING_URI``).
        run_name: The run's name (set by :func:`build_loggers` to the stage: ``local 3``, ``global``).
        tags: Tags of the run.
        log_model: Must stay false: ddcnn logs metrics; the trained weights are ``RUN_DIR/<stage>/net.pt``.
    """

    def __init__(
        self,
        experiment_name: str = "ddcnn",
        tracking_uri: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        log_model: bool = False,
    ) -> None:
        if log_model:
            raise ValueError(
                "logger.mlflow.log_model=true: ddcnn logs metrics to MLflow; the trained weights are in "
                "RUN_DIR/<stage>/net.pt (and the CNN-DNN in RUN_DIR/export/cnn_dnn.pt). Set log_model: false."
            )
        import mlflow  # noqa: F401  (fails early, with build_loggers' hint, when mlflow is not installed)

        self.experiment_name, self.tracking_uri = experiment_name, tracking_uri
        self.run_name, self.tags = run_name, dict(tags or {})
        self._client = None
        self._run_id: str | None = None
        self._pending: list = []

    def _start(self) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self._client.get_experiment_by_name(self.experiment_name)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self._client.create_experiment(self.experiment_name)
        )
        self._run_id = self._client.create_run(experiment_id, run_name=self.run_name, tags=self.tags).info.run_id

    @property
    def run_id(self) -> str:
        if self._run_id is None:
            self._start()
        return self._run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), now, int(step or 0)) for k, v in metrics.items()]

    def save(self) -> None:
        """Send the metrics logged since the last call (one request per 1000)."""
        if not self._pending:
            return
        run_id = self.run_id
        while self._pending:
            chunk, self._pending = self._pending[:1000], self._pending[1000:]
            self._client.log_batch(run_id, metrics=chunk)

    def finalize(self, status: str = "success") -> None:
        self.save()
        if self._run_id is not None:
            self._client.set_terminated(self._run_id, "FINISHED" if status == "success" else "FAILED")


def build_loggers(specs: Mapping[str, Any], folder: Path) -> list:
    """The loggers of the ``logger`` config group (``specs``: name -> ``_target_`` spec) besides the CSV log (which
    the loop always writes: the training-curve
    plots read it), each given this stage's folder (``save_dir``) and name (``run_name``) where it takes them."""
    out = []
    for name, spec in specs.items():
        if not spec or "_target_" not in spec:
            continue  # logger=csv: the CSV log alone
        try:
            factory = hydra.utils.instantiate(spec)
            keywords = getattr(factory, "keywords", {})
            params = inspect.signature(getattr(factory, "func", factory)).parameters
            kwargs = {}
            if "save_dir" in params and "save_dir" not in keywords:
                kwargs["save_dir"] = str(folder)
            if "run_name" in params and "run_name" not in keywords:
                kwargs["run_name"] = stage_name(folder)
            logger = factory(**kwargs)
        except Exception as err:
            raise ValueError(
                f"cannot create logger {name!r} ({spec.get('_target_')}): {err}. Install what it needs (pip install "
                f"tensorboard, or mlflow-skinny for logger=mlflow) or choose another: logger=csv|tensorboard|mlflow."
            ) from err
        if not callable(getattr(logger, "log_metrics", None)):
            raise ValueError(f"logger {name!r} ({spec.get('_target_')}) has no log_metrics(metrics, step) method.")
        out.append(logger)
    return out


class EpochReporter:
    """What a training shows and logs (rank 0; the loop keeps its time out of the training clock): a progress bar on a
    terminal (:func:`~ddcnn.data.progress.open_bar`) or one log line per epoch (SLURM's ``slurm-*.out``, CI logs,
    ``> log``), and every epoch's metrics (and, with ``trainer.log_every_n_steps``, the training loss every n steps)
    to the loggers of ``logger``.

    Args:
        logger: The run's ``logger`` group (name -> ``_target_`` spec).
        show_bar: ``trainer.enable_progress_bar``: bars (true), epoch lines (false), bars on a terminal (null).
        folder: The stage folder (where the loggers write).
        max_epochs: Epochs of the training.
        every: Log a line every this many epochs (and after the last one), for trainings of many short epochs.

    The loggers are created at the first report, in the process that trains (a spawned DDP rank 0); the bar starts at
    the first epoch reported (a resumed training's).
    """

    def __init__(
        self, logger: Mapping[str, Any], show_bar: bool | None, folder: Path, max_epochs: int, every: int = 1
    ) -> None:
        self.specs, self.folder = dict(logger), Path(folder)
        self.name, self.max_epochs, self.every = stage_name(folder), int(max_epochs), max(1, int(every))
        self.show_bar = show_bar
        self.loggers: list | None = None
        self.bar = None
        self.bar_opened = False  # open_bar was asked (it may have said no: lines instead)
        # Step losses are worth collecting only for a logger besides the CSV log (one row per epoch).
        self.wants_steps = any(spec and "_target_" in spec for spec in self.specs.values())

    def __getstate__(self) -> dict[str, Any]:  # sent to spawned DDP ranks before anything was reported
        return {**self.__dict__, "loggers": None, "bar": None, "bar_opened": False}

    def _loggers(self) -> list:
        if self.loggers is None:
            self.loggers = build_loggers(self.specs, self.folder)
        return self.loggers

    def on_log(self, epoch: int, row: Mapping[str, Any], points: list[tuple[int, float]]) -> None:
        """The loop's callback hook (rank 0, outside the clock): the step losses, then the epoch."""
        self.steps(points)
        self.epoch(epoch, row)

    def on_fit_end(self, status: str) -> None:
        self.close(status)

    def steps(self, points: list[tuple[int, float]]) -> None:
        for step, loss in points:
            for logger in self._loggers():
                logger.log_metrics({"train_loss_step": float(loss)}, step=int(step))

    def epoch(self, epoch: int, row: Mapping[str, Any]) -> None:
        metrics = {k: float(v) for k, v in row.items() if k not in ("epoch", "step") and v is not None}
        for logger in self._loggers():
            logger.log_metrics({**metrics, "epoch": float(epoch)}, step=int(epoch))
            if callable(getattr(logger, "save", None)):
                logger.save()
        shown = {k: v for k, v in sorted(metrics.items()) if k.startswith(("train_", "val_"))}
        if not self.bar_opened:
            self.bar = open_bar(self.max_epochs, self.name, "epoch", initial=epoch, enabled=self.show_bar)
            self.bar_opened = True
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4f}" for k, v in shown.items()}, refresh=False)
            self.bar.update(1)
        elif (epoch + 1) % self.every == 0 or epoch + 1 == self.max_epochs:
            text = " ".join(f"{k} {v:.4f}" for k, v in shown.items())
            log.info("%s: epoch %d/%d %s", self.name, epoch + 1, self.max_epochs, text)

    def close(self, status: str = "success") -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.bar_opened = False
        for logger in self.loggers or []:
            if callable(getattr(logger, "finalize", None)):
                logger.finalize(status)
