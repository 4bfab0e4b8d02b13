"""What a stage's training does with the run's settings (ddcnn/engine/train.py ``fit`` on the one loop).

Every key of ``conf/trainer`` and ``conf/engine`` changes what the loop does (a test below each) or is refused; the
precisions really compute in their dtype; clipping bounds what it promises; a killed stage resumes bit-exact; a
training's recorded time follows one rule whether it ran on one device or as a one-rank DDP.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from ddcnn.data.datamodule import PreparedBatches, TensorDataModule
from ddcnn.engine.callbacks import OnEpochEnd
from ddcnn.engine.loop import fit_batches
from ddcnn.engine.train import fit
from ddcnn.pipeline import train
from ddcnn.rundir import CURVE_FILE, RunDir
from ddcnn.settings import RunSettings
from ddcnn.settings.loop import LoopSettings
from tests.conftest import CONFIG_DIR, hooks_as_callbacks, sigkill_after_first_checkpoint

K = 5  # an odd class count, so that a hard-coded 10 cannot pass
COSINE_NODE = "scheduler={_target_:torch.optim.lr_scheduler.CosineAnnealingLR,_partial_:true,T_max:null}"
PLATEAU_NODE = "scheduler={_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true,patience:1}"
SGD = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.2, "momentum": 0.9}
# The convergence record of every training stage's meta.json (docs/protocol.md, "Convergence"): other tools read these
# (a record may hold more: the loop's adds the trends, the kept epoch and the validation split's noise).
CONVERGENCE_KEYS = (
    "converged",
    "reasons",
    "cause",
    "epochs",
    "min_epochs",
    "stopped_by",
    "lr_ratio",
    "train_loss_change_last3",
)


def _data(n: int = 96, batch_size: int = 16, seed: int = 0) -> TensorDataModule:
    """Images ``(n, 1, 8, 8)`` whose class is the brightest of five horizontal bands, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    x, y = {}, {}
    for split, size in (("train", n), ("val", 40), ("test", 40)):
        labels = torch.randint(K, (size,), generator=gen)
        images = torch.randn(size, 1, 8, 8, generator=gen) * 0.5
        for j, label in enumerate(labels.tolist()):
            images[j, 0, label : label + 2] += 2.0
        x[split], y[split] = images, labels
    return TensorDataModule(x, y, batch_size=batch_size, eval_batch_size=32, seed=seed)


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, K)
    )


def _fit(make_cfg, folder: Path, *overrides: str, net: nn.Module | None = None, data=None, **loop):
    cfg = make_cfg("trainer.max_epochs=2", "trainer.limit_train_batches=null", *overrides)
    optimizer, callbacks = loop.pop("optimizer", SGD), hooks_as_callbacks(loop)
    run = RunSettings.from_config(cfg)
    start = time.perf_counter()
    net, data = net or _net(), data or _data()
    return fit(run, net, data, folder, start, callbacks, seed=0, device="cpu", optimizer=optimizer, **loop)


def _grad_norm(opt: torch.optim.Optimizer) -> float:
    grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _recording_sgd(seen: list, what=_grad_norm):
    """An SGD factory whose optimizer records ``what(optimizer)`` just before each of its steps (after clipping)."""

    def factory(params):
        opt = torch.optim.SGD(params, lr=0.2, momentum=0.9)
        opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(what(o)))
        return opt

    return factory


# --- every key of conf/trainer and conf/engine ---------------------------------------------------------------------
def test_every_key_of_the_trainer_and_engine_configs_is_one_the_loop_implements():
    declared = {f.metadata["key"] for f in dataclasses.fields(LoopSettings)}
    for group in ("trainer", "engine"):
        keys = {f"{group}.{key}" for key in OmegaConf.load(Path(CONFIG_DIR) / group / "default.yaml")}
        assert keys - {"engine.loop"} <= declared, (group, keys - declared)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("engine.loop=plain", r"engine.loop is gone: every training .* runs in ddcnn's one loop on Lightning Fabric"),
        ("engine.loop=lightning", "engine.loop is gone"),
        ("+trainer.monitor=val_loss", r"trainer.monitor='val_loss' is not a setting .* use engine.monitor"),
        ("+trainer.num_devices=2", "use engine.num_devices"),
        ("+trainer.devices=2", r"use engine.num_devices=P"),
        ("+trainer.strategy=ddp", "engine.num_devices=P"),
        ("+trainer.check_val_every_n_epoch=2", "trainer.limit_val_batches"),
        ("+trainer.foo=1", r"trainer.foo=1 is not a setting .* the trainer settings are max_epochs, precision"),
        ("+engine.ddp_launcher=slurm", "engine.num_devices"),
        ("trainer.precision=16-true", r"use 32-true, bf16-mixed .* 16-mixed .* or 64-true"),
        ("trainer.gradient_clip_val=0", "gradient_clip_val must be > 0"),
        ("+trainer.gradient_clip_algorithm=max", "'norm' .* or 'value'"),
        ("trainer.limit_train_batches=0", "trains nothing"),
        ("trainer.limit_val_batches=1.5", "as a fraction must be in"),
        ("trainer.limit_val_batches=0", r"skips validation, so engine.monitor=val_loss .* engine.monitor=train_loss"),
        ("+trainer.accumulate_grad_batches=0", "accumulate_grad_batches must be a positive whole number"),
        ("engine.monitor=acc", "engine.monitor must be one of"),
        ("engine.monitor_mode=up", "engine.monitor_mode must be 'max' or 'min'"),
        ("engine.checkpoint_every_s=-1", "checkpoint_every_s must be >= 0"),
        ("engine.patience=0", r"engine.patience must be a whole number of epochs >= 1 .* or null"),
        ("engine.patience=true", "engine.patience must be a whole number"),
        ("engine.min_delta=-0.01", r"engine.min_delta must be >= 0 .* in engine.monitor.s units"),
        ("engine.min_epochs=-1", r"engine.min_epochs must be a whole number of epochs >= 0 .* or null \(half"),
        (
            "engine.patience=2 engine.min_epochs=3 scheduler=null",
            r"engine.min_epochs=3 is more than trainer.max_epochs=1",
        ),
        # a fixed-length schedule is never cut short
        (f"engine.patience=2 {COSINE_NODE}", r"cut a fixed-length .* Drop engine.patience .* scheduler=\{_target_:"),
        # the plateau scheduler waits at least 2 epochs less than early stopping, and counts improvements alike
        (f"engine.patience=2 {PLATEAU_NODE}", r"engine.patience=2 with scheduler.patience=1: .* engine.patience>=3"),
        (f"{PLATEAU_NODE[:-1]},mode:max}}", r"scheduler.mode='max': .* engine.monitor_mode"),
        (f"engine.min_delta=0.01 {PLATEAU_NODE[:-1]},threshold:0.001}}", r"scheduler.threshold=0.001: .* Remove"),
    ],
)
def test_a_setting_the_loop_cannot_honour_is_refused_before_anything_trains(make_cfg, override, message):
    cfg = make_cfg(*override.split(" "), "stage=local", "subdomain=0")
    with pytest.raises(ValueError, match=message):
        RunSettings.from_config(cfg)
    with pytest.raises(ValueError, match=message):
        train(cfg)
    assert not RunDir(cfg.paths.run_dir).stage_dir("local", 0).exists()  # refused before the stage started


def test_max_epochs_limit_train_batches_and_accumulation_set_the_optimizer_steps(make_cfg, tmp_path):
    # 96 samples in batches of 16: 6 batches per epoch.
    assert [r["step"] for r in _fit(make_cfg, tmp_path / "a").history] == [6, 12]
    assert [r["step"] for r in _fit(make_cfg, tmp_path / "b", "trainer.max_epochs=3").history] == [6, 12, 18]
    assert [r["step"] for r in _fit(make_cfg, tmp_path / "c", "trainer.limit_train_batches=2").history] == [2, 4]
    assert [r["step"] for r in _fit(make_cfg, tmp_path / "d", "trainer.limit_train_batches=0.5").history] == [3, 6]
    # 6 batches, 4 per step: one step of 4 batches and one of the 2 left at the end of the epoch.
    result = _fit(make_cfg, tmp_path / "e", "+trainer.accumulate_grad_batches=4")
    assert [r["step"] for r in result.history] == [2, 4]


def test_accumulating_two_half_batches_takes_the_step_of_one_whole_batch(make_cfg, tmp_path):
    """SGD on the mean loss: two batches of 16 accumulated (each loss / 2) = one batch of the same 32 samples."""
    whole = _fit(make_cfg, tmp_path / "whole", "trainer.max_epochs=1", data=_data(batch_size=32))
    halves = _fit(make_cfg, tmp_path / "halves", "trainer.max_epochs=1", "+trainer.accumulate_grad_batches=2")
    assert whole.history[0]["step"] == halves.history[0]["step"] == 3
    for (name, a), b in zip(whole.net.state_dict().items(), halves.net.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    single = _fit(make_cfg, tmp_path / "single", "trainer.max_epochs=1")  # batches of 16, one step each: different
    assert any(not torch.allclose(a, b) for a, b in zip(whole.net.parameters(), single.net.parameters(), strict=True))


def test_limit_val_batches_counts_and_zero_skips_validation_when_selecting_on_training(make_cfg, tmp_path, monkeypatch):
    seen = []
    original = TensorDataModule.eval_batch

    def counting(self, split, idx, device):
        seen.append((split, len(idx)))
        return original(self, split, idx, device)

    monkeypatch.setattr(TensorDataModule, "eval_batch", counting)
    _fit(make_cfg, tmp_path / "one", "trainer.max_epochs=1", "trainer.limit_val_batches=1")
    assert seen[1:] == [("val", 32)]  # after the warm-up's batch: one of the two validation batches of 40 samples
    seen.clear()
    _fit(make_cfg, tmp_path / "all", "trainer.max_epochs=1")
    assert seen[2:] == [("val", 32), ("val", 8)]  # after the warm-up's two: one batch of each shape
    seen.clear()
    result = _fit(
        make_cfg,
        tmp_path / "none",
        "trainer.limit_val_batches=0",
        "engine.monitor=train_loss",
        "engine.monitor_mode=min",
    )
    assert seen == [] and all(r["val_acc"] is None for r in result.history)
    assert result.best_epoch == min(range(2), key=lambda e: result.history[e]["train_loss"])
    with (tmp_path / "none" / "logs" / "metrics.csv").open() as fh:
        assert [r["val_acc"] for r in csv.DictReader(fh)] == ["", ""]


def test_monitor_selects_the_best_epoch_of_that_metric(make_cfg, tmp_path):
    result = _fit(
        make_cfg, tmp_path / "a", "trainer.max_epochs=4", "engine.monitor=train_loss", "engine.monitor_mode=min"
    )
    losses = [r["train_loss"] for r in result.history]
    assert result.best_epoch == losses.index(min(losses))
    result = _fit(
        make_cfg, tmp_path / "b", "trainer.max_epochs=4", "engine.monitor=train_loss", "engine.monitor_mode=max"
    )
    assert result.best_epoch == losses.index(max(losses))  # same seed, same run: the worst epoch now


def test_patience_stops_every_training_of_a_run_and_the_cnn_dnn_curve_ends_where_its_local_nets_stopped(
    make_cfg, caplog
):
    """engine.patience is one early-stopping rule for the local nets, the global CNN and the optional methods; the
    CNN-DNN's curve has the snapshot epochs some local net reached (a net stopped before one stands there with its
    final outputs), then the final CNN-DNN. Every stage's meta.json
    says whether it converged: a training early stopping ended after fewer than 3 epochs did not (too short to judge),
    and the log says so with what to try."""
    # Monitoring the training loss for its *largest* value: the best epoch is an early one and the stop comes soon.
    caplog.set_level(logging.WARNING, logger="ddcnn.stages.common")
    cfg = make_cfg(
        "trainer.max_epochs=6",
        "engine.patience=1",
        "engine.min_epochs=1",
        "scheduler=null",  # a constant rate: a patience of 1 is below the default plateau schedule's 2 + 2
        "engine.min_steps=0",  # 4 steps an epoch here: the default floor of 200 steps would hold every stop back
        "engine.monitor=train_loss",
        "engine.monitor_mode=max",
        "report.curves.enabled=true",
        "report.curves.points=6",
        "methods.enabled.e2e=true",
    )
    results = train(cfg)
    run = RunDir(cfg.paths.run_dir)
    stops = {}
    for stage, index in [("local", i) for i in range(4)] + [("global", None), ("e2e", None)]:
        folder = run.stage_dir(stage, index)
        meta = json.loads((folder / "meta.json").read_text())
        with (folder / "logs" / "metrics.csv").open() as fh:
            epochs = [int(r["epoch"]) for r in csv.DictReader(fh)]
        stop = meta.get("stopped_epoch")
        assert stop is not None and stop < 5, (stage, index, meta)  # the loss did not rise for 6 epochs in a row
        assert stop - meta["best_epoch"] == 1 and epochs == list(range(stop + 1)), (stage, index)
        stops[(stage, index)] = stop
        record = meta["convergence"]
        assert {*CONVERGENCE_KEYS} <= set(record) and record["stopped_by"] == "early_stopping"
        assert record["epochs"] == stop + 1 and record["min_epochs"] == 1
        assert meta["converged"] is record["converged"] is (stop + 1 >= 3), (stage, index, record)
        if not meta["converged"]:
            name = stage if index is None else f"{stage} {index}"
            assert record["reasons"] == [f"too short to judge: {stop + 1} epoch(s), fewer than 3"]
            assert any(
                r.getMessage().startswith(f"{name}: not converged (too short to judge")
                and "engine.min_epochs=" in r.getMessage()
                for r in caplog.records
            ), name
    coarse = json.loads((run.stage_dir("coarse") / "meta.json").read_text())
    assert isinstance(coarse["converged"], bool) and {*CONVERGENCE_KEYS} <= set(coarse["convergence"])
    curve = json.loads((run.stage_dir("coarse") / CURVE_FILE).read_text())["cnn_dnn"]
    reached_by_one = max(stop for (stage, _), stop in stops.items() if stage == "local") + 1
    assert [p["epoch"] for p in curve] == list(range(1, reached_by_one + 1))
    assert results["speedup_at_equal_accuracy"] is not None
    # Without it, the same run trains every epoch.
    plain = make_cfg("trainer.max_epochs=2", "stage=local", "subdomain=0", run_dir=Path(cfg.paths.run_dir) / "plain")
    train(plain)
    meta = json.loads((RunDir(plain.paths.run_dir).stage_dir("local", 0) / "meta.json").read_text())
    assert "stopped_epoch" not in meta and meta["convergence"]["stopped_by"] == "budget"
    assert meta["converged"] is False and meta["convergence"]["epochs"] == 2  # too short to judge


def test_curve_points_all_read_the_target_split_every_epoch_and_the_test_split_at_a_few(make_cfg):
    """report.curves.points=all: every training and the CNN-DNN (a coarse fit on each epoch's local outputs) have a
    val_target accuracy at every epoch, the test split only at the default count's epochs; a local net stopped before
    an epoch stands there with its final outputs and its whole training clock."""
    from ddcnn.stages.common import snapshot_epochs

    cfg = make_cfg(
        "trainer.max_epochs=8",
        "engine.patience=null",
        "report.curves.enabled=true",
        "report.curves.points=all",
        "data.val_target_fraction=0.5",
    )
    train(cfg)
    run = RunDir(cfg.paths.run_dir)
    tested = snapshot_epochs(8, 6)
    assert tested == [1, 2, 3, 5, 8]
    with (run.stage_dir("global") / "logs" / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 8 and all(r["val_target_acc"] for r in rows)
    assert [int(r["epoch"]) + 1 for r in rows if r.get("test_acc")] == tested
    snaps = sorted((run.stage_dir("local", 0) / "snapshots").glob("epoch_*.pt"))
    assert len(snaps) == 8
    with_test = [int(f.stem.split("_")[1]) for f in snaps if "test" in torch.load(f, weights_only=True)["logits"]]
    assert with_test == tested
    curve = json.loads((run.stage_dir("coarse") / CURVE_FILE).read_text())["cnn_dnn"]
    assert [p["epoch"] for p in curve] == list(range(1, 9))
    assert all(p["val_target_acc"] is not None for p in curve)
    assert [p["epoch"] for p in curve if p["test_acc"] is not None] == tested


def test_the_cnn_dnn_curve_stands_a_stopped_local_net_in_with_its_final_outputs(make_cfg):
    """A local net that stopped before an epoch another still trained: its final outputs and its whole training clock
    stand in for it at that epoch."""
    from ddcnn.context import build_context
    from ddcnn.stages.coarse import _FINISHED, _snapshot_files

    cfg = make_cfg("trainer.max_epochs=3", "report.curves.enabled=true", "report.curves.points=all", "stage=local")
    train(cfg)
    run = RunDir(cfg.paths.run_dir)
    (run.stage_dir("local", 1) / "snapshots" / "epoch_0003.pt").unlink()  # as if net 1 had stopped after epoch 2
    ctx = build_context(cfg, claim=False)
    files = _snapshot_files(ctx)
    assert sorted(files) == [1, 2, 3] and files[3][1] is _FINISHED and files[2][1] is not _FINISHED
    (run.stage_dir("local", 2) / "snapshots" / "epoch_0002.pt").unlink()  # a gap: net 2 trained on after it
    assert sorted(_snapshot_files(ctx)) == [1, 3]


def test_checkpoint_every_s_sets_when_last_ckpt_is_written(make_cfg, tmp_path):
    def epochs_on_disk(folder: Path) -> list:
        written = []

        def record(epoch, row):
            last = folder / "last.ckpt"
            written.append(torch.load(last, weights_only=False)["epoch"] if last.is_file() else None)

        return written, record

    for every, expected in (("0", [0, 1, 2]), ("3600", [None, None, 2])):
        folder = tmp_path / every
        written, record = epochs_on_disk(folder)
        _fit(make_cfg, folder, "trainer.max_epochs=3", f"engine.checkpoint_every_s={every}", on_epoch_end=record)
        assert written == expected, every


def test_deterministic_turns_on_torchs_deterministic_algorithms_for_the_training_only(make_cfg, tmp_path):
    during = []
    _fit(
        make_cfg,
        tmp_path / "on",
        "trainer.deterministic=true",
        on_epoch_end=lambda e, r: during.append(torch.are_deterministic_algorithms_enabled()),
    )
    assert during == [True, True] and not torch.are_deterministic_algorithms_enabled()
    during.clear()
    _fit(
        make_cfg,
        tmp_path / "off",
        on_epoch_end=lambda e, r: during.append(torch.are_deterministic_algorithms_enabled()),
    )
    assert during == [False, False]


def test_enable_progress_bar_chooses_a_bar_or_one_log_line_per_epoch(make_cfg, tmp_path, caplog, monkeypatch):
    bars = []
    import tqdm.auto

    class Bar(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            bars.append(kwargs.get("desc"))
            super().__init__(*args, **kwargs, disable=True)

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    with caplog.at_level(logging.INFO, logger="ddcnn.engine.loggers"):
        _fit(make_cfg, tmp_path / "stage", "trainer.enable_progress_bar=true")
        assert bars == ["stage"] and "epoch 1/2" not in caplog.text
        _fit(make_cfg, tmp_path / "lines", "trainer.enable_progress_bar=false")
    assert bars == ["stage"] and "lines: epoch 1/2 train_acc" in caplog.text and "lines: epoch 2/2" in caplog.text


class RecordingLogger:
    """A logger of the ``logger`` group (``_target_`` + ``_partial_``) that keeps what it is given."""

    logged: list = []

    def __init__(self, save_dir: str, run_name: str | None = None) -> None:
        self.save_dir, self.run_name = save_dir, run_name

    def log_metrics(self, metrics, step=None) -> None:
        RecordingLogger.logged.append((dict(metrics), step))

    def finalize(self, status: str) -> None:
        RecordingLogger.logged.append(("finalize", status))


def test_log_every_n_steps_sends_the_training_loss_every_n_steps_to_the_loggers(make_cfg, tmp_path):
    target = f"+logger.recorder={{_target_: {__name__}.RecordingLogger, _partial_: true}}"
    for every, steps in (("2", [2, 4, 6, 8, 10, 12]), ("5", [5, 10]), ("null", [])):
        RecordingLogger.logged = []
        _fit(make_cfg, tmp_path / every, target, f"trainer.log_every_n_steps={every}")
        logged = [m for m in RecordingLogger.logged if m[0] != "finalize"]
        assert [s for m, s in logged if "train_loss_step" in m] == steps, every
        assert [s for m, s in logged if "val_acc" in m] == [0, 1]  # the epoch metrics, one per epoch
        assert RecordingLogger.logged[-1] == ("finalize", "success")


# --- precision, clipping ---------------------------------------------------------------------------------------------
def _conv_dtypes(net: nn.Module) -> list:
    seen = []
    net[0].register_forward_hook(lambda module, args, out: seen.append((module.training, out.dtype)))
    return seen


@pytest.mark.parametrize(
    ("precision", "dtype"), [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16), ("64-true", torch.float64)]
)
def test_the_precision_is_the_dtype_the_layers_compute_in(make_cfg, tmp_path, precision, dtype):
    net = _net()
    seen = _conv_dtypes(net)
    result = _fit(make_cfg, tmp_path, f"trainer.precision={precision}", net=net)
    assert {d for training, d in seen if training} == {dtype}  # every training step
    assert {d for training, d in seen if not training} == {dtype}  # validation (under the same autocast)
    assert result.precision == precision and all(p.dtype == torch.float32 for p in result.net.parameters())


def test_16_mixed_computes_in_float16_with_a_loss_scaler_even_on_cpu(make_cfg, tmp_path):
    """Fabric asked for '16-mixed' by name on CPU runs bf16 instead; ddcnn passes the plugin itself."""
    net = _net()
    seen = _conv_dtypes(net)
    _fit(make_cfg, tmp_path, "trainer.precision=16-mixed", net=net)
    assert {d for training, d in seen if training} == {torch.float16}
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["precision_state"]
    assert set(state) >= {"scale", "growth_factor", "_growth_tracker"}


def test_gradient_clipping_bounds_the_norm_it_promises_and_changes_the_update(make_cfg, tmp_path):
    free, clipped = [], []
    a = _fit(make_cfg, tmp_path / "free", optimizer=_recording_sgd(free))
    b = _fit(make_cfg, tmp_path / "clip", "trainer.gradient_clip_val=0.05", optimizer=_recording_sgd(clipped))
    assert max(free) > 0.2, "the test needs gradients larger than the clipping norm"
    assert len(clipped) == len(free) == 12 and max(clipped) <= 0.05 * (1 + 1e-5)
    assert max(clipped) >= 0.05 * (1 - 1e-5)  # clipped to the norm, not to zero
    assert any(not torch.allclose(p, q) for p, q in zip(a.net.parameters(), b.net.parameters(), strict=True))


def test_gradient_clipping_by_value_bounds_every_entry(make_cfg, tmp_path):
    largest = []

    def max_entry(opt):
        return max(float(p.grad.abs().max()) for g in opt.param_groups for p in g["params"] if p.grad is not None)

    _fit(make_cfg, tmp_path / "free", optimizer=_recording_sgd(largest, max_entry))
    assert max(largest) > 0.01
    largest.clear()
    _fit(
        make_cfg,
        tmp_path / "value",
        "trainer.gradient_clip_val=0.01",
        "+trainer.gradient_clip_algorithm=value",
        optimizer=_recording_sgd(largest, max_entry),
    )
    assert max(largest) <= 0.01


class Interrupt(Exception):
    """Stands for a kill of the training process."""


def test_the_16_mixed_loss_scale_survives_a_resume(tmp_path):
    """The scaler skipped steps and lowered its scale before the interruption: the resumed training restores it (in
    last.ckpt) and ends with exactly the weights and scaler state of an uninterrupted one."""
    settings = LoopSettings(optimizer=SGD, max_epochs=5, precision="16-mixed", checkpoint_every=1, device="cpu")
    reference = fit_batches(_net(), _data(), tmp_path / "reference", settings)

    def stop_at_2(epoch, row):
        if epoch == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        fit_batches(_net(), _data(), tmp_path / "resumed", settings, [OnEpochEnd(stop_at_2)])
    saved = torch.load(tmp_path / "resumed" / "last.ckpt", weights_only=False)
    assert saved["epoch"] == 2 and saved["precision_state"]["scale"] < 65536.0, "the scale never moved"
    resumed = fit_batches(_net(seed=9), _data(), tmp_path / "resumed", settings)
    assert resumed.resumed_from_epoch == 2
    for a, b in zip(resumed.net.state_dict().values(), reference.net.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    final = [torch.load(tmp_path / d / "last.ckpt", weights_only=False) for d in ("resumed", "reference")]
    assert final[0]["precision_state"] == final[1]["precision_state"]


# --- the coarse DNN trains in the same loop ---------------------------------------------------------------------------
def test_the_coarse_dnn_gets_the_precision_clipping_and_limits_of_the_run(make_cfg):
    overrides = (
        "coarse.batch_size=16",
        "trainer.limit_train_batches=3",
        "trainer.precision=bf16-mixed",
        "trainer.gradient_clip_val=0.5",
    )
    train(make_cfg("stage=local", *overrides))
    cfg = make_cfg("stage=coarse", *overrides)
    train(cfg)
    run = RunDir(cfg.paths.run_dir)
    meta = run.meta("coarse")
    assert meta["precision"] == "bf16-mixed" and meta["loop"] == "fabric"
    with (run.stage_dir("coarse") / "logs" / "metrics.csv").open() as fh:
        assert [int(r["step"]) for r in csv.DictReader(fh)] == [3, 6]  # 3 batches of 16 per epoch, 2 epochs


# --- one timing rule --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_local_net_and_a_one_rank_ddp_training_of_it_record_the_same_time(make_cfg, tmp_path):
    """Imports, process start-up and DDP's launch are start-up (startup_s), the device warm-up is warmup_s: neither
    is in either clock, so the same training measures alike on one device and as a one-rank DDP (spawned: its process
    imports torch, Fabric and ddcnn, several seconds here, all outside its clock).

    The two clocks are compared only where the machine let them be: under a burst of other work (CI beside a long
    measurement), two trainings of a few seconds can differ by any factor, so the comparison is skipped when even the
    best of two of each disagree and the load says the machine was busy; the load-free checks (start-up recorded and
    disjoint from the clock) always hold."""
    overrides = ("stage=local", "subdomain=0", "trainer.max_epochs=3", "data.train_subset=600", "model=vgg_small")
    cfg = make_cfg(*overrides, "trainer.limit_train_batches=null")
    train(cfg)
    local = RunDir(cfg.paths.run_dir).meta("local", 0)

    from ddcnn.context import build_context, build_local_net, subdomain_seed
    from ddcnn.engine.train import seed_everything

    ctx = build_context(cfg, claim=False)
    seed = subdomain_seed(cfg.seed, 0)
    data = PreparedBatches(ctx.data, 64, seed=seed, box=ctx.decomposition.box(0))  # as the local stage reads them

    def timed(folder: Path, **how) -> tuple:
        start = time.perf_counter()
        seed_everything(seed)
        net = build_local_net(ctx.settings, ctx.data)
        result = fit(ctx.settings, net, data, folder, start, seed=seed, device="cpu", **how)
        return result, time.perf_counter() - start

    ddp, wall = timed(tmp_path / "ddp", num_devices=1, launcher="spawn")
    assert ddp.world_size == 1 and ddp.startup_s > 1.0, "spawning the rank is start-up, recorded apart"
    # Start-up and training clock are disjoint parts of the call's wall time, whatever the machine's load.
    assert ddp.startup_s + ddp.fit_time_s <= wall + 0.05, (ddp.startup_s, ddp.fit_time_s, wall)
    a, b = local["fit_time_s"], ddp.fit_time_s
    if abs(a - b) > 0.5 * max(a, b) + 0.5:  # one of the two met a burst of other work: the best of two of each
        a = min(a, timed(tmp_path / "again", num_devices=1)[0].fit_time_s)
        b = min(b, timed(tmp_path / "ddp_again", num_devices=1, launcher="spawn")[0].fit_time_s)
    assert ddp.warmup_s > 0 and local["warmup_s"] > 0
    if abs(a - b) > 0.5 * max(a, b) + 0.5 and os.getloadavg()[0] > os.cpu_count():
        pytest.skip(f"clocks {a:.1f} s and {b:.1f} s under load {os.getloadavg()[0]:.1f}: not comparable here")
    assert abs(a - b) <= 0.5 * max(a, b) + 0.5, (a, b, ddp.startup_s, os.getloadavg())


# --- a killed stage resumes exactly ----------------------------------------------------------------------------------
OVERRIDES = [
    "model=vgg_small",
    "trainer.max_epochs=4",
    "trainer.enable_progress_bar=false",
    "engine.checkpoint_every_s=0",
    "data.train_subset=600",
    "data.test_subset=100",
    "stage=local",
    "subdomain=0",
]


def _command(run_dir) -> list[str]:
    code = "import sys; from ddcnn.cli import train_main; sys.argv[0] = 'ddcnn-train'; train_main()"
    return [sys.executable, "-c", code, *OVERRIDES, f"hydra.run.dir={run_dir}"]


def _epoch_of(path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=False)["epoch"])


@pytest.mark.slow
def test_sigkill_mid_training_resumes_and_matches_uninterrupted_run(make_cfg, tmp_path):
    killed_dir = tmp_path / "killed"
    last = killed_dir / "local" / "00" / "last.ckpt"
    sigkill_after_first_checkpoint(_command(killed_dir), last, settle_s=0.2)  # into the next epoch
    run = RunDir(killed_dir)
    assert not run.is_done("local", 0)
    epoch_at_kill = _epoch_of(last)
    assert epoch_at_kill < 3, "the kill came too late to test resuming"

    rerun = subprocess.run(_command(killed_dir), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    meta = run.meta("local", 0)
    assert meta["resumed_from_epoch"] == epoch_at_kill  # resumed, not restarted
    # Its recorded time covers both processes: the killed one (up to its checkpoint) and the resumed one.
    assert meta["time_s_earlier_processes"] > 0
    assert meta["time_s"] > meta["time_s_earlier_processes"] and meta["fit_time_s"] > meta["time_s_earlier_processes"]
    # The training curve keeps every epoch, those before the resume included, each once.
    with (run.stage_dir("local", 0) / "logs" / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    val_epochs = [int(float(r["epoch"])) for r in rows if r.get("val_acc")]
    train_epochs = [int(float(r["epoch"])) for r in rows if r.get("train_acc")]
    assert val_epochs == [0, 1, 2, 3] and train_epochs == [0, 1, 2, 3], rows

    # The same seed without interruption gives the same predictions.
    reference = make_cfg(*OVERRIDES, run_dir=tmp_path / "reference", tiny=False)
    train(reference)
    ref = RunDir(tmp_path / "reference")
    assert ref.meta("local", 0)["resumed_from_epoch"] is None
    for split in ("val", "test"):
        a = run.load_probs("local", split, 0)["probs"]
        b = ref.load_probs("local", split, 0)["probs"]
        assert torch.equal(a, b), f"{split} predictions differ after resuming"
    assert meta["accuracy"] == ref.meta("local", 0)["accuracy"]

    # Finished work is skipped, not recomputed (the same command again, in this process).
    stamp = (run.stage_dir("local", 0) / "done").stat().st_mtime_ns
    train(make_cfg(*OVERRIDES, run_dir=killed_dir, tiny=False))
    assert (run.stage_dir("local", 0) / "done").stat().st_mtime_ns == stamp


def test_a_stage_interrupted_under_lightnings_trainer_is_refused_with_what_to_do(make_cfg):
    cfg = make_cfg("stage=local", "subdomain=0")
    folder = RunDir(cfg.paths.run_dir).stage_dir("local", 0)
    folder.mkdir(parents=True)
    # What ddcnn's Lightning path wrote: a Trainer checkpoint with the callbacks' states.
    torch.save(
        {"epoch": 0, "state_dict": {}, "callbacks": {}, "pytorch-lightning_version": "2.5.1"}, folder / "last.ckpt"
    )
    with pytest.raises(ValueError, match=r"written by Lightning's Trainer .* Delete .* run the same command again"):
        train(cfg)


def test_same_seed_gives_identical_predictions(make_cfg, tmp_path):
    first = make_cfg(run_dir=tmp_path / "a")
    second = make_cfg(run_dir=tmp_path / "b")
    ra, rb = train(first), train(second)
    assert ra["accuracy"] == rb["accuracy"]
    a, b = RunDir(tmp_path / "a"), RunDir(tmp_path / "b")
    for stage, sub in [*(("local", i) for i in range(4)), ("coarse", None), ("global", None)]:
        for split in ("train", "val", "test"):
            pa, pb = a.load_probs(stage, split, sub), b.load_probs(stage, split, sub)
            assert torch.equal(pa["logits"], pb["logits"]), f"{stage} {sub} {split} differs"


def test_force_recomputes(make_cfg):
    cfg = make_cfg("stage=local", "subdomain=1")
    train(cfg)
    run = RunDir(cfg.paths.run_dir)
    stamp = (run.stage_dir("local", 1) / "done").stat().st_mtime_ns
    time.sleep(0.01)
    train(make_cfg("stage=local", "subdomain=1", "force=true"))
    assert (run.stage_dir("local", 1) / "done").stat().st_mtime_ns > stamp


def test_local_seed_depends_only_on_run_seed_and_index():
    from ddcnn.context import subdomain_seed

    seeds = [subdomain_seed(0, i) for i in range(16)]
    assert len(set(seeds)) == 16
    assert seeds == [subdomain_seed(0, i) for i in range(16)]
    assert subdomain_seed(1, 0) != subdomain_seed(0, 0)


def test_a_process_that_trains_imports_neither_lightnings_trainer_nor_torchmetrics(tmp_path):
    code = f"""
import sys
from tests.conftest import compose_config
from ddcnn.pipeline import train
train(compose_config(["stage=all", "decomposition.grid=[1,2]"], {str(tmp_path / "run")!r}))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning", "torchmetrics"))
assert not loaded, loaded
assert "lightning_fabric" in sys.modules
"""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunDir(tmp_path / "run")
    assert run.is_done("local", 0) and run.is_done("global") and run.is_done("coarse")
    assert all(run.meta(s)["loop"] == "fabric" for s in ("global", "coarse"))


def test_min_epochs_stays_out_of_the_fingerprint_while_early_stopping_is_off(make_cfg):
    """engine.min_epochs came after run directories and stored global CNNs were recorded without it; it changes
    nothing without engine.patience, so there it is not part of the fingerprint (whatever its value) and they stay
    valid. With early stopping it is."""
    from ddcnn.rundir import fingerprint

    plain = RunSettings.from_config(make_cfg("engine.patience=null")).identity().settings
    assert "min_epochs" not in plain["engine"] and "min_steps" not in plain["engine"] and "patience" in plain["engine"]
    inert = make_cfg("engine.patience=null", "engine.min_epochs=4", "engine.min_steps=50")
    assert fingerprint(RunSettings.from_config(inert).identity().settings) == fingerprint(plain)
    stopping = [
        RunSettings.from_config(
            make_cfg("engine.patience=3", "scheduler=null", "trainer.max_epochs=8", f"engine.min_epochs={m}")
        )
        .identity()
        .settings
        for m in ("null", 2, 4)
    ]
    assert stopping[1]["engine"]["min_epochs"] == 2
    assert len({fingerprint(s) for s in stopping}) == 3


def test_a_64_true_training_with_curve_points_runs_end_to_end(make_cfg):
    """A curve point evaluates the net in the middle of its training, when 64-true holds it in float64: the images
    are given in its dtype (they were float32, and the first curve point failed)."""
    cfg = make_cfg("stage=local", "subdomain=0", "trainer.precision=64-true", "report.curves.enabled=true")
    train(cfg)
    rows = list(csv.DictReader((Path(cfg.paths.run_dir) / "local" / "00" / "logs" / "metrics.csv").open()))
    assert rows and all(row["test_acc"] not in ("", None) for row in rows if row.get("test_acc") is not None)
    assert "test_acc" in rows[-1]
