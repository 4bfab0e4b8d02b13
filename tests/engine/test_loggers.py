"""The ``logger`` config group: CSV always, TensorBoard (torch's SummaryWriter) and MLflow (mlflow's own client, a local
store in the run directory) on request."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from ddcnn.pipeline import train
from ddcnn.rundir import RunDir


@pytest.mark.slow
def test_tensorboard_and_mlflow_log_the_metrics_beside_the_csv(make_cfg):
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(
        "logger=[csv,tensorboard,mlflow]",
        "decomposition.grid=[1,2]",
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=2",
    )
    train(cfg)
    run = RunDir(cfg.paths.run_dir)
    for stage, sub in (("local", 0), ("local", 1), ("global", None)):
        folder = run.stage_dir(stage, sub)
        with (folder / "logs" / "metrics.csv").open() as fh:
            rows = list(csv.DictReader(fh))
        assert [r["val_acc"] for r in rows if r.get("val_acc")], f"{folder}: no val_acc in metrics.csv"
        events = EventAccumulator(str(folder / "tb"))
        events.Reload()
        assert {"val_acc", "train_loss"} <= set(events.Tags()["scalars"]), events.Tags()
        assert len(events.Scalars("val_acc")) == 2  # one per epoch
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run.root}/mlflow.db")
    (experiment,) = [e for e in client.search_experiments() if e.name == "ddcnn-digits"]
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert {"local 0", "local 1", "global", "coarse"} <= set(runs), sorted(runs)
    history = client.get_metric_history(runs["global"].info.run_id, "val_acc")
    assert len(history) == 2 and all(0 <= m.value <= 1 for m in history)
    assert [m.step for m in history] == [0, 1]
    assert {r.info.status for r in runs.values()} == {"FINISHED"}
    steps = client.get_metric_history(runs["global"].info.run_id, "train_loss_step")  # trainer.log_every_n_steps
    assert [m.step for m in steps] == [2, 4, 6, 8]  # 4 batches per epoch (limit_train_batches), 2 epochs


def test_mlflow_refuses_to_log_models_and_names_where_the_weights_are(make_cfg):
    pytest.importorskip("mlflow")
    from ddcnn.engine.loggers import MLflowLogger

    with pytest.raises(ValueError, match=r"net.pt"):
        MLflowLogger("x", log_model=True)


def test_an_unknown_logger_is_refused_with_the_choices(make_cfg):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="logger"):
        make_cfg("logger=wandb")


_LOG_IN_A_TASK = """
import sys
from ddcnn.engine.loggers import TensorBoardLogger
logger = TensorBoardLogger(sys.argv[1])
logger.log_metrics({"val_acc": 0.5}, step=0)
logger.save()
logger.finalize("success")
"""


def test_tensorboard_logs_in_every_srun_task_not_only_rank_0(tmp_path):
    """An srun step's tasks each train their own local nets (SLURM_PROCID 1, 2, ... without DDP), and each writes
    its events. Lightning Fabric's TensorBoardLogger would write nothing there: its rank_zero_only takes the rank
    from SLURM_PROCID at import, and a single-device training never resets it (why ddcnn keeps its own)."""
    pytest.importorskip("tensorboard")
    env = {**os.environ, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1"}
    subprocess.run([sys.executable, "-c", _LOG_IN_A_TASK, str(tmp_path)], env=env, check=True, timeout=120)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "no TensorBoard events from srun task 1"
