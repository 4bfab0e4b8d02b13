"""The one training loop (ddcnn/engine/loop.py) on the coarse DNN's tensors (``fit_tensors``), and the coarse stage.

Interruptions of the trainer are injected from the ``on_epoch_end`` hook: an exception raised there stops the training
the way a kill at that moment would (the last checkpoint stays, nothing after it is saved). The coarse stage itself is
killed for real (SIGKILL of a ``ddcnn-train`` process) and resumed.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ddcnn.engine.state import CHECKPOINT_FORMAT, CHECKPOINT_KEYS, FitResult
from ddcnn.engine.train import fit_tensors
from ddcnn.models.coarse import CoarseMLP
from ddcnn.pipeline import train
from ddcnn.report.plots import read_metrics_csv
from ddcnn.rundir import RunDir
from ddcnn.settings import LoopSettings
from tests.conftest import hooks_as_callbacks

N, K = 3, 5  # sub-domains and an odd class count, so that a hard-coded 10 cannot pass
ADAMW = {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 3e-2, "weight_decay": 1e-4}
COSINE = {"_target_": "torch.optim.lr_scheduler.CosineAnnealingLR", "_partial_": True, "T_max": None}


class Interrupt(Exception):
    """Stands for a kill of the training process."""


def _data(seed: int = 0, flip_val: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Local 'probabilities' ``(n, N, K)`` whose mean points to the label; ``flip_val`` gives val other labels."""
    gen = torch.Generator().manual_seed(seed)
    x, y = {}, {}
    for split, n in (("train", 200), ("val", 60), ("test", 60)):
        labels = torch.randint(K, (n,), generator=gen)
        logits = torch.randn(n, N, K, generator=gen) + 2.0 * nn.functional.one_hot(labels, K)[:, None]
        x[split] = logits.softmax(-1)
        y[split] = (labels + 1) % K if flip_val and split == "val" else labels
    return x, y


def _net(seed: int = 0) -> CoarseMLP:
    torch.manual_seed(seed)
    return CoarseMLP(N, K, hidden=(16,), dropout=0.2)


def _fit(folder: Path, **kwargs) -> FitResult:
    x, y = kwargs.pop("data", None) or _data()
    net, callbacks = kwargs.pop("net", None) or _net(), hooks_as_callbacks(kwargs)
    batch, start = kwargs.pop("batch_size", 32), kwargs.pop("start", None)
    settings = LoopSettings(**{"optimizer": ADAMW, "max_epochs": 8, "seed": 7, "scheduler": COSINE} | kwargs)
    return fit_tensors(net, x, y, folder, settings, batch_size=batch, callbacks=callbacks, start=start)


def _untimed(history: list[dict]) -> list[dict]:
    """The rows without the training clock, which differs between two runs of the same training."""
    return [{k: v for k, v in row.items() if k != "time_s"} for row in history]


def _assert_same_weights_dict(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    _assert_same_weights_dict(a.state_dict(), b.state_dict())


@pytest.mark.parametrize(("monitor", "mode"), [("val_acc", "max"), ("val_loss", "min")])
def test_returns_the_weights_of_the_best_validation_epoch(tmp_path, monitor, mode):
    seen: dict[int, dict[str, torch.Tensor]] = {}
    net = _net()

    def record(epoch, row):
        seen[epoch] = {k: v.clone() for k, v in net.state_dict().items()}

    # Validation labels disagree with training labels: the better the net learns, the worse it validates.
    result = _fit(tmp_path, net=net, data=_data(flip_val=True), monitor=monitor, monitor_mode=mode, on_epoch_end=record)
    values = [row[monitor] for row in result.history]
    best = values.index(max(values) if mode == "max" else min(values))  # the first of equal values
    assert result.best_epoch == best < len(values) - 1, "the test needs a best epoch before the last"
    assert result.best_metric == values[best]
    for key, value in result.net.state_dict().items():
        assert torch.equal(value, seen[best][key]), key
    saved = torch.load(tmp_path / "best.ckpt", weights_only=False)
    assert saved["epoch"] == best and saved["monitor"] == monitor


def test_full_batch_and_large_batch_steps(tmp_path):
    full = _fit(tmp_path / "full", batch_size=None, max_epochs=3)
    assert [row["step"] for row in full.history] == [1, 2, 3]  # one step per epoch
    large = _fit(tmp_path / "large", batch_size=64, max_epochs=2)
    assert [row["step"] for row in large.history] == [4, 8]  # ceil(200 / 64) steps per epoch


@pytest.mark.parametrize("checkpoint_every", [1, 3])
def test_interrupted_training_resumes_to_exactly_the_uninterrupted_weights(tmp_path, checkpoint_every):
    reference = _fit(tmp_path / "reference", checkpoint_every=checkpoint_every)

    def stop_at_4(epoch, row):
        if epoch == 4:
            raise Interrupt

    folder = tmp_path / "interrupted"
    with pytest.raises(Interrupt):
        _fit(folder, checkpoint_every=checkpoint_every, on_epoch_end=stop_at_4)
    saved = torch.load(folder / "last.ckpt", weights_only=False)
    expected_last = 4 if checkpoint_every == 1 else 2  # the hook runs after the epoch's checkpoint (if any)
    assert saved["format"] == CHECKPOINT_FORMAT and saved["epoch"] == expected_last
    assert len(read_metrics_csv(folder / "logs" / "metrics.csv")["epoch"]) == expected_last + 1

    # A new process: a fresh network (the same initial weights are not needed, the checkpoint holds the weights).
    resumed = _fit(folder, net=_net(seed=123), checkpoint_every=checkpoint_every)
    assert resumed.resumed_from_epoch == expected_last
    _assert_same_weights(resumed.net, reference.net)
    assert resumed.best_epoch == reference.best_epoch
    assert _untimed(resumed.history) == _untimed(reference.history)
    times = [row["time_s"] for row in resumed.history]
    assert times == sorted(times) and times[-1] <= resumed.fit_time_s  # the clock runs on across the resume
    final = torch.load(folder / "last.ckpt", weights_only=False)
    _assert_same_weights_dict(final["net"], torch.load(tmp_path / "reference" / "last.ckpt", weights_only=False)["net"])

    # logs/metrics.csv: every epoch once, with the uninterrupted run's values.
    got = read_metrics_csv(folder / "logs" / "metrics.csv")
    want = read_metrics_csv(tmp_path / "reference" / "logs" / "metrics.csv")
    assert got["epoch"].tolist() == list(range(8))
    for column in ("train_loss", "train_acc", "val_loss", "val_acc", "lr"):
        assert got[column].tolist() == want[column].tolist(), column


# last.ckpt's layout, frozen: checkpoints already on disk must keep resuming.
LAST_CKPT_KEYS = (
    "format",
    "epoch",
    "settings",
    "net",
    "optimizer",
    "scheduler",
    "precision_state",
    "best",
    "history",
    "fit_time_s",
    "resumed_from",
    "restarts",
    "lr_scale",
    "initial_loss",
    "num_classes",
    "initial_state",
    "stopped_epoch",
)


def test_last_ckpt_holds_the_keys_of_its_format_and_a_checkpoint_without_the_later_ones_resumes(tmp_path):
    """The one list of keys is what is written; a checkpoint of an older ddcnn, written before the keys from
    ``resumed_from`` on (and the schedule's and loss scaler's states) existed, resumes to the uninterrupted weights."""
    assert CHECKPOINT_KEYS == LAST_CKPT_KEYS
    # each key has one owner: the training state or one of the loop's rules that keep a state (#43 item 2)
    from ddcnn.engine.callbacks import DivergenceRestart, EarlyStopping
    from ddcnn.engine.state import OWN_KEYS

    owned = [*OWN_KEYS, *EarlyStopping.checkpoint_keys, *DivergenceRestart.checkpoint_keys]
    assert sorted(owned) == sorted(LAST_CKPT_KEYS) and len(set(owned)) == len(owned)
    plain = {"scheduler": None}  # no schedule state, no divergence check: the later keys change nothing here
    reference = _fit(tmp_path / "reference", **plain)
    saved = torch.load(tmp_path / "reference" / "last.ckpt", weights_only=False)
    assert tuple(saved) == LAST_CKPT_KEYS and saved["epoch"] == 7 and saved["best"]["monitor"] == "val_acc"

    def stop_at_3(epoch, row):
        if epoch == 3:
            raise Interrupt

    folder = tmp_path / "older"
    with pytest.raises(Interrupt):
        _fit(folder, on_epoch_end=stop_at_3, **plain)
    later = LAST_CKPT_KEYS[LAST_CKPT_KEYS.index("resumed_from") :] + ("scheduler", "precision_state")
    state = torch.load(folder / "last.ckpt", weights_only=False)
    torch.save({k: v for k, v in state.items() if k not in later}, folder / "last.ckpt")
    resumed = _fit(folder, net=_net(seed=3), **plain)
    assert resumed.resumed_from_epoch == 3 and resumed.restarts == []
    _assert_same_weights(resumed.net, reference.net)
    assert _untimed(resumed.history) == _untimed(reference.history)
    # One that lacks what no version could do without is refused with what to do.
    torch.save({k: v for k, v in state.items() if k != "optimizer"}, folder / "last.ckpt")
    with pytest.raises(ValueError, match=r"lacks \['optimizer'\]: it is damaged. Delete it"):
        _fit(folder, **plain)


def test_resuming_a_finished_training_trains_nothing(tmp_path):
    first = _fit(tmp_path)
    again = _fit(tmp_path, net=_net(seed=5))
    assert again.resumed_from_epoch == 7
    _assert_same_weights(again.net, first.net)


def test_fit_time_adds_up_the_work_of_every_process(tmp_path):
    def slow_then_stop(epoch, row):
        time.sleep(0.1)
        if epoch == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        _fit(tmp_path, on_epoch_end=slow_then_stop)
    # The checkpoint after epoch 3 was written before that epoch's sleep: it holds at least three sleeps.
    first_part = torch.load(tmp_path / "last.ckpt", weights_only=False)["fit_time_s"]
    assert first_part >= 0.3

    start = time.perf_counter()
    resumed = _fit(tmp_path, on_epoch_end=lambda epoch, row: time.sleep(0.05))  # epochs 4..7
    second_wall = time.perf_counter() - start
    assert resumed.previous_time_s == pytest.approx(first_part)
    assert 0.2 <= resumed.fit_time_s - resumed.previous_time_s <= second_wall
    assert resumed.fit_time_s == pytest.approx(first_part + (resumed.fit_time_s - resumed.previous_time_s))


LBFGS = {
    "_target_": "torch.optim.LBFGS",
    "_partial_": True,
    "lr": 1.0,
    "max_iter": 20,
    "line_search_fn": "strong_wolfe",
}


def test_closure_optimizer_takes_full_batch_steps_to_a_lower_loss_than_adamw(tmp_path):
    # A linear model (multinomial logistic regression) on full batches: L-BFGS steps with a closure.
    linear = {"net": CoarseMLP(N, K, hidden=()), "batch_size": None, "scheduler": None, "max_epochs": 4}
    lbfgs = _fit(tmp_path / "lbfgs", optimizer=LBFGS, **linear)
    torch.manual_seed(0)
    adamw = _fit(tmp_path / "adamw", **{**linear, "net": CoarseMLP(N, K, hidden=())})
    assert [row["step"] for row in lbfgs.history] == [1, 2, 3, 4]
    losses = [row["train_loss"] for row in lbfgs.history]
    assert losses == sorted(losses, reverse=True)  # each step's line search decreases the loss
    assert losses[-1] < 0.7 * adamw.history[-1]["train_loss"]


def test_after_epoch_hook_metrics_join_the_rows_and_its_time_is_not_training_time(tmp_path):
    calls = []

    def hook(epoch, row, net):
        assert not net.training  # evaluated as at prediction time
        calls.append(epoch)
        time.sleep(0.15)
        return {"test_acc": 0.5 + epoch / 100, "val_acc": -1.0}  # an existing column is not overwritten

    start = time.perf_counter()
    result = _fit(tmp_path, max_epochs=4, after_epoch=hook)
    wall = time.perf_counter() - start
    assert calls == [0, 1, 2, 3]
    assert [row["test_acc"] for row in result.history] == [0.5, 0.51, 0.52, 0.53]
    assert all(row["val_acc"] >= 0 for row in result.history)
    assert result.hook_time_s >= 0.6
    assert result.fit_time_s <= wall - 0.6 + 0.05
    times = [row["time_s"] for row in result.history]
    assert times == sorted(times) and times[-1] <= result.fit_time_s
    assert read_metrics_csv(tmp_path / "logs" / "metrics.csv")["test_acc"].tolist() == [0.5, 0.51, 0.52, 0.53]


SGD_TOO_FAST = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 500.0}


def test_a_diverging_training_raises_or_restarts_with_a_lower_learning_rate(tmp_path):
    from ddcnn.engine.state import Diverged

    data = _data()
    data[0]["train"] = data[0]["train"] * 50  # badly scaled inputs: SGD at this rate blows up
    with pytest.raises(Diverged, match="diverged in epoch 0") as err:
        _fit(tmp_path / "raise", data=data, optimizer=SGD_TOO_FAST, scheduler=None, divergence_restarts=0)
    assert "Lower the learning rate" in str(err.value)

    result = _fit(tmp_path / "restart", data=data, optimizer=SGD_TOO_FAST, scheduler=None, divergence_restarts=6)
    assert 1 <= len(result.restarts) <= 6
    assert [r["lr_scale"] for r in result.restarts] == pytest.approx(
        [0.1**k for k in range(1, len(result.restarts) + 1)]
    )
    assert result.history[0]["lr"] == pytest.approx(500.0 * result.restarts[-1]["lr_scale"])
    assert [row["epoch"] for row in result.history] == list(range(8))  # the last attempt trained every epoch
    assert all(math.isfinite(row["train_loss"]) for row in result.history)
    assert result.history[-1]["train_loss"] < result.initial_loss


class GlitchOnceSGD(torch.optim.SGD):
    """SGD whose first instance leaves one weight NaN after its ``GLITCH_AT``-th step, as torch 2.14's oneDNN 3D
    convolution on the CPU now and then returns a non-finite weight gradient (in CI: a 7^3 kernel on 6^3 inputs)."""

    GLITCH_AT = 7  # the last step of epoch 0: 200 training rows in batches of 32
    instances = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        type(self).instances += 1
        self.first, self.steps = type(self).instances == 1, 0

    def step(self, closure=None):
        out = super().step(closure)
        self.steps += 1
        if self.first and self.steps == self.GLITCH_AT:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return out


def test_weights_left_not_finite_by_an_epochs_last_step_restart_the_training(tmp_path):
    """The epoch's training loss (taken before each step) is finite, its validation is not: a divergence, restarted
    from the initial weights, never a finished training with weights that are not finite."""
    from ddcnn.engine.state import Diverged

    glitchy = {"_target_": "tests.engine.test_loop.GlitchOnceSGD", "_partial_": True, "lr": 0.1}
    GlitchOnceSGD.instances = 0
    with pytest.raises(Diverged, match="val_loss nan: the weights after the epoch are not finite"):
        _fit(tmp_path / "raise", optimizer=glitchy, scheduler=None, divergence_restarts=0)
    GlitchOnceSGD.instances = 0
    result = _fit(tmp_path / "restart", optimizer=glitchy, scheduler=None, divergence_restarts=2)
    assert [r["epoch"] for r in result.restarts] == [0] and "val_loss nan" in result.restarts[0]["reason"]
    assert all(torch.isfinite(p).all() for p in result.net.parameters())
    assert all(math.isfinite(row["val_loss"]) for row in result.history) and len(result.history) == 8
    # Where divergence is not checked (the local nets and the global CNN by default), weights that are not finite
    # start the same attempt again, at the same rate: the same weights as a training the fault never hit.
    GlitchOnceSGD.instances = 0
    retried = _fit(tmp_path / "unchecked", optimizer=glitchy, scheduler=None, divergence_restarts=None)
    assert [r["lr_scale"] for r in retried.restarts] == [1.0]
    GlitchOnceSGD.instances = 1  # no glitch: a plain SGD run of the same training
    clean = _fit(tmp_path / "clean", optimizer=glitchy, scheduler=None, divergence_restarts=None)
    assert not clean.restarts
    _assert_same_weights(retried.net, clean.net)


def test_a_restarted_training_resumes_in_its_last_attempt(tmp_path):
    data = _data()
    data[0]["train"] = data[0]["train"] * 50
    kwargs = {"data": data, "optimizer": SGD_TOO_FAST, "scheduler": None, "divergence_restarts": 6}
    reference = _fit(tmp_path / "reference", **kwargs)
    assert reference.restarts, "the test needs a restart"

    def stop_at_5(epoch, row):
        if epoch == 5:
            raise Interrupt

    with pytest.raises(Interrupt):
        _fit(tmp_path / "interrupted", on_epoch_end=stop_at_5, **kwargs)
    resumed = _fit(tmp_path / "interrupted", net=_net(seed=99), **kwargs)
    assert resumed.resumed_from_epoch == 5 and resumed.restarts == reference.restarts
    _assert_same_weights(resumed.net, reference.net)


def test_early_stopping_ends_after_patience_epochs_without_improvement_and_stays_stopped(tmp_path):
    # Validation labels disagree with training labels: validation gets worse as training improves.
    data = _data(flip_val=True)
    result = _fit(tmp_path, data=data, monitor="val_loss", monitor_mode="min", patience=2, max_epochs=30)
    values = [row["val_loss"] for row in result.history]
    assert result.stopped_epoch == result.best_epoch + 2 == len(values) - 1 < 29
    assert min(values) == values[result.best_epoch]
    again = _fit(tmp_path, data=data, monitor="val_loss", monitor_mode="min", patience=2, max_epochs=30)
    assert again.resumed_from_epoch == result.stopped_epoch and len(again.history) == len(result.history)
    _assert_same_weights(again.net, result.net)


def test_one_improvement_rule_beats_the_kept_epoch_by_more_than_min_delta():
    from ddcnn.engine.convergence import early_stop_due, improves

    assert improves(0.743, 0.74, "max", 0.002) and not improves(0.7412, 0.74, "max", 0.002)
    assert not improves(0.742, 0.74, "max", 0.002)  # by exactly min_delta: not more than it
    assert improves(0.49, 0.5, "min", 0.005) and not improves(0.499, 0.5, "min", 0.005)
    assert not improves(0.5, 0.5, "min", 0.0) and improves(0.4999, 0.5, "min", 0.0)  # 0: strictly better
    assert not improves(math.nan, 0.5, "min") and improves(0.5, None, "min") and improves(0.5, math.nan, "max")
    # early stopping counts from the kept epoch, waits for min_epochs, and never stops at the budget's last epoch
    assert early_stop_due(4, 2, 2, 0, 10) and not early_stop_due(3, 2, 2, 0, 10)
    assert not early_stop_due(4, 2, 2, 6, 10) and early_stop_due(5, 2, 2, 6, 10)
    assert not early_stop_due(9, 2, 2, 0, 10) and not early_stop_due(5, -1, 2, 0, 10)
    assert not early_stop_due(8, 0, None, 0, 10)


def test_the_plateau_scheduler_counts_an_improvement_as_selection_does():
    """The loop builds ReduceLROnPlateau with its own rule: the scheduler's best and bad-epoch count follow
    ``improves`` exactly, where torch's default (a relative threshold of 1e-4) does not."""
    from ddcnn.engine.convergence import improves
    from ddcnn.engine.optim import build_scheduler

    values = [1.0, 0.9, 0.8995, 0.8992, 0.85, 0.8499, math.nan, 0.84, 0.7, 0.7]
    for mode, sign in (("min", 1.0), ("max", -1.0)):
        for min_delta in (0.0, 0.001, 0.02):
            opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
            plateau = {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "_partial_": True, "patience": 100}
            rule = {"mode": mode, "threshold_mode": "abs", "threshold": min_delta}
            sched = build_scheduler(plateau, opt, 10, plateau=rule)
            best, bad = None, 0
            for value in values:
                value = sign * value
                if improves(value, best, mode, min_delta):
                    best, bad = value, 0
                else:
                    bad += 1
                sched.step(value)
                assert sched.num_bad_epochs == bad, (mode, min_delta, value)
                assert sched.best == best
    # torch's default rule disagrees within 1e-4 relative of the best: why the loop does not leave it to torch
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    default = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=100)
    default.step(0.9)
    default.step(0.89995)
    assert improves(0.89995, 0.9, "min", 0.0) and default.num_bad_epochs == 1


def _replay(
    history: list[dict],
    monitor: str,
    mode: str,
    min_delta: float,
    patience: int,
    factor: float,
    waits: int,
    floor=0.0,
    least=0,
):
    """The improvement rule replayed over a fit's history: the kept epoch, the stop and the learning rates it gives."""
    from ddcnn.engine.convergence import improves

    best, kept, bad, lr, rates, stop, dropped = None, -1, 0, history[0]["lr"], [], None, -1
    for epoch, row in enumerate(history):
        rates.append(lr)
        if improves(row[monitor], best, mode, min_delta):
            best, kept, bad = row[monitor], epoch, 0
        else:
            bad += 1
        # early stopping counts `patience` epochs from the kept epoch and from the last epoch after which the rate
        # dropped (one the epochs so far trained at a lower rate after: not this epoch's own drop)
        since = max(kept, dropped)
        if bad > waits:  # ReduceLROnPlateau: the rate drops after `waits` epochs without improvement, to its floor
            lowered, bad = max(lr * factor, floor), 0
            if lr - lowered > 1e-8:  # torch's eps: a rate at its floor does not drop
                lr, dropped = lowered, epoch
        # a stop the patience reaches by itself ends the training; one that min_epochs held back waits while the
        # training still improves
        due = epoch - since >= patience and epoch + 1 >= least
        if due and (
            (epoch - since == patience and epoch + 1 > least)
            or not _still_improving(history[: epoch + 1], monitor, mode)
        ):
            stop = epoch
            break
    return kept, stop, rates


def _still_improving(rows: list[dict], monitor: str, mode: str) -> bool:
    """Early stopping waits while the last 3 epochs' mean of the monitor beats the 3 before by more than 1%, or that of
    the training loss falls by more than 1% while the validation loss's does not rise by more than 1%."""
    if len(rows) < 3:
        return False
    w = min(3, len(rows) // 2)

    def change(key):
        before = sum(r[key] for r in rows[-2 * w : -w]) / w
        return (sum(r[key] for r in rows[-w:]) / w - before) / abs(before)

    metric = change(monitor)
    if (metric > 0.01) if mode == "max" else (metric < -0.01):
        return True
    return change("train_loss") < -0.01 and change("val_loss") <= 0.01


def test_selection_early_stopping_and_the_plateau_scheduler_share_one_improvement_rule(tmp_path):
    """An epoch within min_delta of the kept one neither replaces the selection, nor resets early stopping's count,
    nor counts as an improvement for ReduceLROnPlateau; the same fit with min_delta = 0 takes it as one."""
    plateau = {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "_partial_": True, "factor": 0.5}
    plateau |= {"cooldown": 0, "min_lr": 3e-4}  # set: the loop's defaults (cooldown 1, 1% of 0.03) are kept out
    settings = {"monitor": "val_loss", "monitor_mode": "min", "scheduler": plateau | {"patience": 1}, "patience": 3}
    settings["max_epochs"] = 80
    for min_delta in (0.0, 0.01):
        result = _fit(tmp_path / str(min_delta), min_delta=min_delta, **settings)
        history = result.history
        kept, stop, rates = _replay(history, "val_loss", "min", min_delta, 3, 0.5, 1, floor=3e-4)
        assert result.best_epoch == kept and result.stopped_epoch == stop == len(history) - 1
        assert [row["lr"] for row in history] == pytest.approx(rates)
        values = [row["val_loss"] for row in history]
        small = [  # epochs that beat the kept epoch before them, but by no more than min_delta
            e for e in range(1, len(values)) if 0 < min(values[:e]) - values[e] <= 0.01
        ]
        if min_delta:
            assert small, "the test needs an epoch within min_delta of the best"
            assert min(values) < values[result.best_epoch]  # a later, slightly better epoch was not selected
            assert len(set(rates)) > 1  # and the rate dropped though that epoch was better
        else:
            assert result.best_epoch == values.index(min(values))
    # with min_delta = 1 no epoch ever improves on the first: it is kept, and the fit stops `patience` epochs later
    result = _fit(tmp_path / "one", patience=2, min_delta=1.0, max_epochs=30)
    assert result.best_epoch == 0 and result.stopped_epoch == 2 and len(result.history) == 3
    # held back by min_epochs, the stop waits while the training still improves (its training loss falling by more
    # than 1% between 3-epoch means), and comes once it does not
    result = _fit(tmp_path / "held", patience=2, min_delta=1.0, max_epochs=30, min_epochs=5)
    history = result.history
    waited = [e for e in range(4, len(history)) if not _still_improving(history[: e + 1], "val_acc", "max")]
    assert result.best_epoch == 0 and result.stopped_epoch == waited[0] == len(history) - 1
    assert waited[0] > 4  # this toy fit still improves when min_epochs lets the stop come
    with pytest.raises(ValueError, match="min_delta must be >= 0"):
        _fit(tmp_path / "bad", min_delta=-0.1)


def test_no_early_stop_before_min_epochs(tmp_path):
    data = _data(flip_val=True)  # validation gets worse as training improves: the first epoch stays the best
    settings = {"data": data, "monitor": "val_loss", "monitor_mode": "min", "patience": 1, "max_epochs": 12}
    plain = _fit(tmp_path / "plain", **settings)
    assert plain.best_epoch == 0 and plain.stopped_epoch == 1 and plain.min_epochs == 0
    waited = _fit(tmp_path / "waited", min_epochs=6, **settings)
    assert waited.best_epoch == 0 and waited.stopped_epoch == 5 and len(waited.history) == 6
    assert waited.convergence["min_epochs"] == 6 and waited.convergence["stopped_by"] == "early_stopping"
    # min_epochs is part of what a resume must agree on (only with early stopping)
    with pytest.raises(ValueError, match=r"other settings \(min_epochs: 6 -> 4\)"):
        _fit(tmp_path / "waited", min_epochs=4, **settings)


def test_the_plateau_scheduler_must_wait_less_than_early_stopping_and_follow_its_rule(tmp_path):
    plateau = {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "_partial_": True, "patience": 1}
    with pytest.raises(ValueError, match=r"patience=2 with scheduler.patience=1: .* Set patience>=3"):
        _fit(tmp_path / "a", scheduler=plateau, patience=2)
    with pytest.raises(ValueError, match=r"scheduler.threshold_mode='rel': .* Remove scheduler.threshold_mode"):
        _fit(tmp_path / "b", scheduler=plateau | {"threshold_mode": "rel"}, patience=3)
    with pytest.raises(ValueError, match=r"scheduler.mode='min': .* Remove scheduler.mode"):
        _fit(tmp_path / "c", scheduler=plateau | {"mode": "min"}, patience=3)  # monitor val_acc: max

    def plateau_factory(opt):  # one built in Python: checked once built
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", patience=1)

    with pytest.raises(ValueError, match=r"the ReduceLROnPlateau scheduler counts an improvement by"):
        _fit(tmp_path / "d", scheduler=plateau_factory)
    assert _fit(tmp_path / "e", scheduler=plateau, patience=3, max_epochs=2).history  # as the rule says: trains


def test_convergence_flags_a_training_stopped_on_a_noisy_split_and_not_one_run_to_a_flat_loss(tmp_path):
    x, y = _data()
    tiny = ({**x, "val": x["val"][:4]}, {**y, "val": y["val"][:4]})  # 4 validation rows: accuracy moves in quarters
    noisy = _fit(tmp_path / "noisy", data=tiny, patience=1, min_epochs=1, max_epochs=10, scheduler=None)
    record = noisy.convergence
    assert noisy.stopped_by == record["stopped_by"] == "early_stopping" and record["epochs"] < 3
    assert record["converged"] is False and record["reasons"] == [
        f"too short to judge: {record['epochs']} epoch(s), fewer than 3"
    ]
    # Full-batch L-BFGS on a logistic regression whose optimum is finite (labels the inputs cannot separate): the
    # loss is flat when the budget ends.
    gen = torch.Generator().manual_seed(1)
    x = {s: torch.rand(600, N, K, generator=gen) for s in ("train", "val")}
    y = {s: torch.randint(K, (600,), generator=gen) for s in x}
    linear = {"net": CoarseMLP(N, K, hidden=()), "batch_size": None, "scheduler": None, "optimizer": LBFGS}
    flat = _fit(tmp_path / "flat", data=(x, y), max_epochs=8, **linear)
    record = flat.convergence
    assert record["converged"] is True and record["reasons"] == [] and record["stopped_by"] == "budget", record
    assert record["epochs"] == 8 and record["lr_ratio"] == 1.0 and abs(record["train_loss_change_last3"]) < 1e-3
    # Three epochs of AdamW from scratch: the budget ends while the loss still falls.
    short = _fit(tmp_path / "short", max_epochs=3, scheduler=None)
    record = short.convergence
    assert record["converged"] is False and record["train_loss_change_last3"] < -0.01
    assert record["reasons"][0].startswith("budget ended while the training loss still fell")
    # A cosine schedule over more epochs than the budget (T_max 30 for 4 epochs): the rate is still high.
    cosine = _fit(tmp_path / "cosine", max_epochs=4, scheduler={**COSINE, "T_max": 30})
    assert cosine.convergence["reasons"] == ["budget ended with the learning rate still at 98% of its start"]
    assert cosine.convergence["lr_ratio"] > 0.9
    # The loss trend reads 3-epoch means (one epoch's loss is noisy at a constant rate) and stops mattering once the
    # training data are fit almost exactly (mean loss below 1% of ln K).
    from ddcnn.engine.convergence import convergence

    def rows(losses):
        return [{"train_loss": v, "lr": 0.01} for v in losses]

    noisy = convergence(rows([1.0, 0.4, 0.25, 0.20, 0.30, 0.30, 0.20, 0.25]), "budget")  # 0.30 -> 0.25: flat
    assert noisy["converged"] is True and noisy["train_loss_change_last3"] == pytest.approx(0.0, abs=1e-12)
    falling = convergence(rows([1.0, 0.4, 0.30, 0.20, 0.15, 0.12, 0.10]), "budget")
    assert falling["converged"] is False and falling["train_loss_change_last3"] == pytest.approx(0.37 / 0.9 - 1)
    interpolating = rows([0.5, 0.1, 0.01, 0.002, 0.001, 0.0005])
    assert convergence(interpolating, "budget", num_classes=10)["converged"] is True
    assert convergence(interpolating, "budget")["converged"] is False
    # One annealed over its budget ends converged, though its loss falls to the end as its rate comes down.
    annealed = _fit(tmp_path / "annealed", max_epochs=6, scheduler=COSINE).convergence
    assert annealed["converged"] is True and annealed["lr_ratio"] == pytest.approx((1 + math.cos(5 * math.pi / 6)) / 2)


def test_a_checkpoint_of_other_settings_or_of_lightnings_trainer_is_refused_with_what_to_do(tmp_path):
    _fit(tmp_path, max_epochs=3)
    with pytest.raises(ValueError, match=r"other settings \(batch_size: 32 -> 16\)"):
        _fit(tmp_path, max_epochs=3, batch_size=16)
    # The layout of Lightning's Trainer (ddcnn's DDP and engine.loop=lightning before the one loop).
    torch.save({"epoch": 2, "state_dict": {}, "pytorch-lightning_version": "2.5.0"}, tmp_path / "last.ckpt")
    with pytest.raises(ValueError, match=r"Lightning's Trainer .* Delete .*last.ckpt and run the same command again"):
        _fit(tmp_path, max_epochs=3)
    # A checkpoint of the plain loop before the Fabric loop (the same layout) resumes.
    _fit(tmp_path / "plain", max_epochs=2)
    old = torch.load(tmp_path / "plain" / "last.ckpt", weights_only=False)
    torch.save({**old, "format": "ddcnn.tensor_fit/1"}, tmp_path / "plain" / "last.ckpt")
    assert _fit(tmp_path / "plain", max_epochs=2).resumed_from_epoch == 1


def test_bad_settings_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="monitor_mode must be 'max' or 'min', got 'up'"):
        _fit(tmp_path, monitor_mode="up")
    with pytest.raises(ValueError, match="monitor must be one of"):
        _fit(tmp_path, monitor="acc")
    with pytest.raises(ValueError, match="checkpoint_every must be a positive whole number, got 0"):
        _fit(tmp_path, checkpoint_every=0)


@pytest.mark.parametrize(
    ("key", "bad", "section"),
    [
        ("precision", "16-true", "trainer"),
        ("gradient_clip_val", 0, "trainer"),
        ("limit_train_batches", 0, "trainer"),
        ("log_every_n_steps", 0, "trainer"),
        ("max_epochs", 0, "trainer"),
        ("patience", 0, "engine"),
        ("min_delta", -0.01, "engine"),
        ("checkpoint_every_s", -1, "engine"),
    ],
)
def test_a_loop_setting_is_checked_in_one_place(tmp_path, key, bad, section):
    """fit_batches' keyword and the run's trainer/engine setting of the same name are refused by one check, with one
    wording: the configuration's message names ``section.key``, the keyword's ``key``."""
    from ddcnn.config import compose
    from ddcnn.settings import RunSettings

    with pytest.raises(ValueError) as from_config:
        RunSettings.from_config(compose([f"{section}.{key}={bad}"], tmp_path / "run"))
    with pytest.raises(ValueError) as from_keyword:
        _fit(tmp_path, **{"max_epochs": 1, key: bad})
    assert str(from_keyword.value) == str(from_config.value).replace(f"{section}.{key}", key).replace(
        "engine.monitor", "monitor"
    ).replace("trainer.max_epochs", "max_epochs")


def test_the_callers_random_state_is_left_alone(tmp_path):
    net = _net()
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    _fit(tmp_path, net=net, max_epochs=2)  # dropout draws from the global generator, seeded per epoch
    assert torch.equal(torch.rand(3), expected)


# --- the coarse stage -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_done(tmp_path_factory):
    """A tiny run directory whose local nets finished (copied by each test that trains the coarse DNN in it)."""
    from tests.conftest import compose_config

    run_dir = tmp_path_factory.mktemp("local_done") / "run"
    train(compose_config(["stage=local", *COARSE_6], run_dir))
    return run_dir


def _coarse_cfg(run_dir: Path, *overrides: str):
    from tests.conftest import compose_config

    return compose_config(["stage=coarse", *COARSE_6, *overrides], run_dir)


# Long enough to be caught mid-training by a SIGKILL (100 epochs of 64 small steps, a checkpoint every 10 epochs).
# Six epochs, every one of them (no early stopping: these tests count the epochs).
COARSE_6 = ["coarse.max_epochs=6", "coarse.checkpoint_every=2", "coarse.patience=null"]
KILL_COARSE = [
    "coarse.max_epochs=100",
    "coarse.checkpoint_every=10",
    "coarse.batch_size=4",
    "coarse.patience=null",
    "trainer.limit_train_batches=null",
]


@pytest.mark.slow
def test_sigkilled_coarse_stage_resumes_and_matches_an_uninterrupted_one(tmp_path):
    from tests.conftest import TINY_OVERRIDES, compose_config, sigkill_after_first_checkpoint

    base, reference, killed = tmp_path / "base", tmp_path / "reference", tmp_path / "killed"
    train(compose_config(["stage=local", *KILL_COARSE], base))
    shutil.copytree(base, reference)
    shutil.copytree(base, killed)
    train(compose_config(["stage=coarse", *KILL_COARSE], reference))

    code = "import sys; from ddcnn.cli import train_main; sys.argv[0] = 'ddcnn-train'; train_main()"
    cmd = [sys.executable, "-c", code, *TINY_OVERRIDES, "stage=coarse", *KILL_COARSE, f"hydra.run.dir={killed}"]
    last = killed / "coarse" / "last.ckpt"
    sigkill_after_first_checkpoint(cmd, last)  # into the next epochs
    run = RunDir(killed)
    assert not run.is_done("coarse")
    epoch_at_kill = int(torch.load(last, map_location="cpu", weights_only=False)["epoch"])
    assert epoch_at_kill < 99, "the kill came too late to test resuming"

    train(compose_config(["stage=coarse", *KILL_COARSE], killed))
    meta, ref_meta = run.meta("coarse"), RunDir(reference).meta("coarse")
    assert meta["resumed_from_epoch"] == epoch_at_kill and ref_meta["resumed_from_epoch"] is None
    # The killed process's time up to its checkpoint is carried into the record, beside the resumed one's.
    assert meta["time_s_earlier_processes"] > 0 and meta["fit_time_s"] > meta["time_s_earlier_processes"]
    assert meta["time_s"] >= meta["fit_time_s"]
    # An exact resume: the same selected epoch, predictions and weights as the uninterrupted run.
    assert meta["accuracy"] == ref_meta["accuracy"] and meta["best_epoch"] == ref_meta["best_epoch"]
    for split in ("train", "val", "test"):
        a, b = run.load_probs("coarse", split), RunDir(reference).load_probs("coarse", split)
        assert torch.equal(a["logits"], b["logits"]), split
    _assert_same_weights_dict(
        torch.load(run.stage_dir("coarse") / "net.pt"), torch.load(RunDir(reference).stage_dir("coarse") / "net.pt")
    )
    curves = read_metrics_csv(run.stage_dir("coarse") / "logs" / "metrics.csv")
    assert curves["epoch"].tolist() == list(range(100))


def test_finished_coarse_stage_is_skipped_and_force_retrains_from_scratch(local_done, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(local_done, run_dir)
    train(_coarse_cfg(run_dir))
    run = RunDir(run_dir)
    folder = run.stage_dir("coarse")
    stamp = (folder / "done").stat().st_mtime_ns
    train(_coarse_cfg(run_dir))
    assert (folder / "done").stat().st_mtime_ns == stamp  # not retrained

    time.sleep(0.01)
    train(_coarse_cfg(run_dir, "force=true"))
    assert (folder / "done").stat().st_mtime_ns > stamp
    assert run.meta("coarse")["resumed_from_epoch"] is None  # force: the old last.ckpt was not resumed from
    assert read_metrics_csv(folder / "logs" / "metrics.csv")["epoch"].tolist() == list(range(6))
    for name in ("last.ckpt", "probs_train.pt", "probs_val.pt", "probs_test.pt", "net.pt", "meta.json"):
        assert (folder / name).is_file(), name


def test_the_advice_for_an_unconverged_training_names_one_fix_with_its_value():
    """A training too short to judge that ran its whole budget (1 epoch of 1) is told one budget to type; one that
    early stopping ended too soon, one minimum of epochs (or, where it has none, a longer patience)."""
    from ddcnn.engine.convergence import convergence_advice

    advice = convergence_advice({"stopped_by": "budget", "epochs": 1, "converged": False, "cause": "too_short"})
    assert advice == "still improving at the cap: trainer.max_epochs=11"
    record = {"stopped_by": "early_stopping", "epochs": 2, "min_epochs": 0, "converged": False, "cause": "too_short"}
    assert convergence_advice(record) == "early stopping ended it too soon: engine.min_epochs=4"
    names = {"epochs": "coarse.max_epochs", "patience": "coarse.patience", "min_epochs": ""}
    assert convergence_advice(dict(record, patience=3), names) == "early stopping ended it too soon: coarse.patience=5"
