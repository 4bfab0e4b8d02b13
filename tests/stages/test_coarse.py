"""The coarse DNN's fit (ddcnn/stages/coarse.py) across dataset sizes and class counts, and the convex stacker.

The grid uses synthetic local outputs with the traits of real ones (ddcnn/data/synthetic.py: uneven local
accuracies, shared hard samples, overconfidence, in-sample bias), 5000 test samples each so that a point of accuracy
is well above the noise; small cells average several seeds (their fits are noisy by nature).
"""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
import torch

from ddcnn.config import compose
from ddcnn.context import build_coarse_net
from ddcnn.data.synthetic import synthetic_local_outputs
from ddcnn.engine.convex import fit_logistic
from ddcnn.metrics import near_chance
from ddcnn.models.coarse import CoarseMLP
from ddcnn.settings import CoarseSettings, RunSettings
from ddcnn.stages.coarse import coarse_plan, fit_coarse

N = 4  # sub-domains


def _coarse(*overrides: str) -> CoarseSettings:
    """The ``coarse`` settings of the default configuration with ``overrides``, checked as a run checks them."""
    return RunSettings.from_config(compose(list(overrides))).coarse


def _inputs(x: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    return {s: v.softmax(-1) if kind == "probs" else v for s, v in x.items()}


def _accuracy(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((net.eval()(x).argmax(-1) == y).float().mean())


def _stacker(x, y, kind: str, k: int) -> float:
    net = CoarseMLP(N, k, hidden=(), inputs=kind, input_norm="standardize")
    net.fit_input_scaling(x["train"])
    fit = fit_logistic(net.scale_inputs(x["train"]), y["train"], net.scale_inputs(x["val"]), y["val"], k)
    with torch.no_grad():
        net.linear_layer().weight.copy_(fit.weight)
        net.linear_layer().bias.copy_(fit.bias)
    return _accuracy(net, x["test"], y["test"])


# small/large x few/many classes; the small cells average 4 seeds
GRID = [(100, 3, 4), (100, 40, 4), (10_000, 3, 1), (10_000, 40, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["probs", "logits"])
@pytest.mark.parametrize(("n", "k", "seeds"), GRID)
def test_the_coarse_dnn_clears_the_convex_stacker_and_never_sits_at_chance(tmp_path, n, k, seeds, kind):
    settings = _coarse()
    coarse, stacker, averaging = [], [], []
    for seed in range(seeds):
        x, y = synthetic_local_outputs(n, N, k, seed=1000 * seed + n + k)
        x = _inputs(x, kind)
        torch.manual_seed(seed)
        net = build_coarse_net(settings, N, k, kind=kind)
        fitted = fit_coarse(net, x, y, tmp_path / f"{seed}", settings, seed=seed)
        coarse.append(_accuracy(fitted.net, x["test"], y["test"]))
        stacker.append(_stacker(x, y, kind, k))
        probs = x["test"].softmax(-1) if kind == "logits" else x["test"]
        averaging.append(float((probs.mean(1).argmax(-1) == y["test"]).float().mean()))
        majority = float((y["test"] == torch.bincount(y["train"]).argmax()).float().mean())
        assert not near_chance(coarse[-1], majority, len(y["test"])), (seed, coarse[-1], majority)
    mean = statistics.fmean
    assert mean(coarse) >= mean(stacker) - 0.01, (coarse, stacker)
    # Averaging the local nets is inside the coarse DNN: it never ends far below it.
    assert mean(coarse) >= mean(averaging) - 0.03, (coarse, averaging)


@pytest.mark.parametrize(
    ("n", "settings", "expected"),
    [
        (1222, {}, (32, 11)),  # digits: ~40 steps per epoch, enough epochs for 400 steps
        (100, {}, (32, 100)),  # few rows: many short epochs
        (54_000, {}, (1024, 8)),  # full MNIST: the largest batch, few epochs
        (1_000_000, {}, (1024, 5)),  # at least 5 epochs
        (10, {}, (10, 200)),  # a batch is never larger than the data; at most 200 epochs
        (5000, {"batch_size": 64, "max_epochs": 3}, (64, 3)),  # numbers a user types win
    ],
)
def test_the_fit_plan_fits_the_data_size(n, settings, expected):
    defaults = _coarse()
    assert (defaults.batch_size, defaults.max_epochs, defaults.steps) == ("auto", "auto", 400)
    plan = coarse_plan(n, dataclasses.replace(defaults, **settings))
    assert (plan["batch_size"], plan["max_epochs"]) == expected
    assert plan["steps"] == plan["max_epochs"] * plan["steps_per_epoch"]


@pytest.mark.parametrize("bad", ["batch_size=0", "max_epochs=many", "steps=-1", "divergence_restarts=-1"])
def test_bad_plan_settings_name_the_key(bad):
    key = bad.split("=")[0]
    with pytest.raises(ValueError, match=f"coarse.{key} must be"):
        _coarse(f"coarse.{bad}")


def test_a_diverging_coarse_fit_restarts_with_a_lower_learning_rate(tmp_path):
    settings = _coarse(
        "coarse.net.skip=none", "coarse.net.input_norm=none", "coarse.linear.enabled=false", "coarse.optimizer.lr=1.0"
    )
    x, y = synthetic_local_outputs(300, N, 10, seed=3)
    x = {s: 50 * v for s, v in x.items()}  # unscaled, huge logits at a huge rate
    torch.manual_seed(0)
    fitted = fit_coarse(build_coarse_net(settings, N, 10, kind="logits"), x, y, tmp_path, settings, seed=0)
    restarts = fitted.report["restarts"]
    assert restarts and all("train_loss" in r["reason"] for r in restarts)
    assert restarts[-1]["lr_scale"] == pytest.approx(0.1 ** len(restarts))
    assert _accuracy(fitted.net, x["test"], y["test"]) > 0.5  # it recovered


class _Blind(torch.nn.Module):
    """A coarse network that ignores its input: whatever it learns, it predicts one class."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(len(x), -1)


def test_a_fit_at_chance_while_averaging_is_well_above_is_refit_and_recorded(tmp_path):
    x, y = synthetic_local_outputs(1000, N, 10, seed=4)
    fitted = fit_coarse(_Blind(10), x, y, tmp_path, _coarse("coarse.divergence_restarts=2"), seed=0)
    refits = fitted.report["refits"]
    assert [r["lr_scale"] for r in refits] == pytest.approx([0.1, 0.01])
    assert all(near_chance(r["val_acc"], r["majority_rate"], len(y["val"])) for r in refits)
    # The loop's own restarts, as a divergence's: in last.ckpt, so that a resumed fit counts them too.
    assert [r["reason"].split()[0] for r in fitted.report["restarts"]] == ["collapsed", "collapsed"]
    assert [r["lr_scale"] for r in fitted.report["restarts"]] == pytest.approx([0.1, 0.01])


def test_the_coarse_stage_records_its_fit_and_the_run_its_curves_and_the_stacker(make_cfg):
    from ddcnn.pipeline import train
    from ddcnn.rundir import CURVE_FILE, RunDir

    cfg = make_cfg("trainer.max_epochs=2", "report.curves.enabled=true", "report.plots=true")
    results = train(cfg)
    run = RunDir(cfg.paths.run_dir)
    meta = run.meta("coarse")
    fit = meta["fit"]
    assert fit["kept"] in ("trained", "linear", "averaging") and fit["plan"]["max_epochs"] == 2
    assert {"averaging", "linear"} <= set(fit["validation"]) and len(fit["linear"]["path"]) == 6
    assert meta["coarse_net"]["skip"] == "mean_prob" and meta["coarse_net"]["inputs"] == "probs"
    # The kept network is at least as good as averaging the local nets on the validation split: it was a candidate.
    scores = fit["validation"]
    assert scores[fit["kept"]]["acc"] >= scores["averaging"]["acc"]
    # Curves: every local net kept its outputs at both epochs, the coarse stage fit a coarse DNN on each.
    assert sorted(p.name for p in (run.stage_dir("local", 0) / "snapshots").iterdir()) == [
        "epoch_0001.pt",
        "epoch_0002.pt",
    ]
    curve = json.loads((run.stage_dir("coarse") / CURVE_FILE).read_text())
    assert [p["epoch"] for p in curve["cnn_dnn"]] == [1, 2]
    assert all(p["time_s"] > p["local_max_s"] > 0 for p in curve["cnn_dnn"])
    # What the time to a fixed target adds up (docs/protocol.md): each local net's clock and the fit's training clock.
    assert all(
        max(p["local_s"]) == p["local_max_s"] and 0 < p["coarse_fit_s"] <= p["coarse_s"] for p in curve["cnn_dnn"]
    )
    assert {"global", "cnn_dnn", "mean_prob"} <= set(results["curves"])
    assert results["curves"]["global"]["test_acc"][-1] is not None  # the test split at the snapshot epochs
    assert results["speedup_at_equal_accuracy"]["at_cnn_dnn_accuracy"]["target_val_acc"] == pytest.approx(
        results["val"]["accuracy"]["cnn_dnn"]
    )
    assert (run.root / "plots" / "accuracy_vs_time.png").is_file()
    assert "Time to the fixed target" in (run.root / "results.md").read_text()
    # The convex stacker is a method of the family with its own row.
    assert run.meta("stacker")["l2"] in cfg.methods.stacker.l2_grid
    assert "stacker" in [row["key"] for row in results["methods"]]


def test_an_old_run_directory_keeps_its_finished_coarse_stage(make_cfg):
    """A run directory recorded before the coarse DNN's new settings: accepted, its coarse DNN kept and exported."""
    from ddcnn.pipeline import train
    from ddcnn.rundir import ADDED_DEFAULTS, CHANGED_DEFAULTS, FingerprintMismatch, RunDir, fingerprint

    cfg = make_cfg("stage=local")
    train(cfg)
    run = RunDir(cfg.paths.run_dir)
    # What the older ddcnn trained: the plain MLP on unscaled probabilities (its net.pt has no scaling or skips).
    old_net = CoarseMLP(4, 10, hidden=(64,), dropout=0.1)
    folder = run.make_stage_dir("coarse")
    for split in ("train", "val", "test"):
        x, y = run.local_outputs(4, split, "probs")
        logits = old_net.eval()(x).detach()
        torch.save({"logits": logits, "probs": logits.softmax(-1), "labels": y}, folder / f"probs_{split}.pt")
    torch.save(old_net.state_dict(), folder / "net.pt")
    run.mark_done("coarse", None, {"time_s": 1.0, "fit_time_s": 1.0, "input": "probs", "params": 1, "accuracy": {}})
    stamp = (folder / "done").stat().st_mtime_ns
    recorded = json.loads((run.root / "fingerprint.json").read_text())
    old = recorded["settings"]
    for key in ADDED_DEFAULTS:
        head, *rest = key.split(".")
        node = old
        for part in [head, *rest][:-1]:
            node = node.get(part, {})
        node.pop(key.split(".")[-1], None)
    for key, (before, now) in CHANGED_DEFAULTS.items():
        node = old
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.get(part, {})
        if parts[-1] in node and node[parts[-1]] == now:  # at today's default: recorded with the old one
            node[parts[-1]] = before
    (run.root / "fingerprint.json").write_text(json.dumps({"fingerprint": fingerprint(old), "settings": old}))
    results = train(make_cfg("stage=evaluate", "report.export=true"))
    assert (folder / "done").stat().st_mtime_ns == stamp  # not retrained
    assert results["accuracy"]["cnn_dnn"] is not None
    assert (run.root / "export" / "cnn_dnn.pt").is_file()
    # A setting that really differs from the recorded one is still refused.
    with pytest.raises(FingerprintMismatch, match="coarse.optimizer.lr"):
        train(make_cfg("stage=evaluate", "coarse.optimizer.lr=0.5"))


def test_the_linear_fit_survives_a_solver_that_leaves_float_range_and_refuses_non_finite_features():
    """Finite but badly scaled features (a 3D net's logits in the thousands did this in the suite) make L-BFGS's line
    search leave float range: the fit keeps its last finite solution, marked not converged, instead of crashing the
    coarse stage. Features that are not finite are refused by name."""
    from ddcnn.engine.convex import fit_logistic

    torch.manual_seed(0)
    y = torch.arange(30) % 3
    x = torch.randn(30, 6)
    x[:, 0] += y * 1e10
    fit = fit_logistic(x, y, x, y, 3)
    assert all(torch.isfinite(t).all() for t in (fit.weight, fit.bias)) if hasattr(fit, "weight") else True
    assert not any(step["converged"] for step in fit.path)
    x[0, 0] = float("inf")
    with pytest.raises(ValueError, match="training features are not finite"):
        fit_logistic(x, y, x, y, 3)
