"""The optional method stages: second coarse DNN, end-to-end CNN-DNN, transfer learning (ddcnn/stages/).

One tiny run with every method enabled (two sub-domains, to stay fast) is shared by the module; ``_fit`` is wrapped to
record the weights each stage starts training from.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import ddcnn.stages.common as common
from ddcnn import registry
from ddcnn.context import build_context, build_local_net, subdomain_seed
from ddcnn.engine.train import seed_everything
from ddcnn.pipeline import OPTIONAL_STAGES, enabled_stages, train
from ddcnn.report.results import METHODS
from ddcnn.rundir import RunDir
from ddcnn.settings import RunSettings
from ddcnn.stages.global_transfer import init_global_transfer
from tests.conftest import compose_config

OPTIONAL = (
    "coarse_alt",
    "stacker",
    "local_oof",
    "coarse_oof",
    "coarse_val",
    "e2e",
    "transfer",
    "global_transfer",
    "global_ddp",
    "global_ensemble",
    "global_ensemble_coarse",
    "global_wide",
)
# Stages that train no network by epochs (a convex solve, or a folder of fold or member trainings): no last.ckpt of
# their own.
NO_CHECKPOINT = ("stacker", "local_oof", "global_ensemble")
# methods=all at the size of these tests: an ensemble of 2 global CNNs (k=auto has its own test,
# tests/stages/test_global_ensemble.py).
ALL = ("methods=all", "methods.local_oof.folds=2", "methods.global_ensemble.k=2")
N = 2  # sub-domains of the shared run


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A tiny run with every method, and the state each optional stage handed to ``fit``."""
    run_dir = tmp_path_factory.mktemp("all_methods")
    overrides = [*ALL, "decomposition.grid=[1,2]"]
    overrides += ["++report.plots=false", "++report.export=false"]
    cfg = compose_config(overrides, run_dir)
    started: dict[str, dict[str, torch.Tensor]] = {}
    fit = common.fit

    def recording_fit(settings, net, dm, folder, *args, **kwargs):
        started[folder.name] = copy.deepcopy(net.state_dict())
        return fit(settings, net, dm, folder, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "fit", recording_fit)
        results = train(cfg)
    return cfg, RunDir(run_dir), results, started


def _saved(run: RunDir, stage: str, subdomain: int | None = None) -> dict[str, torch.Tensor]:
    return torch.load(run.stage_dir(stage, subdomain) / "net.pt", weights_only=True)


def _prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_transfer_starts_from_the_finished_local_nets_and_coarse_dnn(finished):
    _, run, _, started = finished
    init = started["transfer"]
    for i in range(N):
        _assert_same(_prefixed(init, f"local_nets.{i}."), _saved(run, "local", i))
    _assert_same(_prefixed(init, "coarse."), _saved(run, "coarse"))
    # ... and training then moved them.
    trained = _saved(run, "transfer")
    assert any(not torch.equal(trained[k], init[k]) for k in init if trained[k].is_floating_point())
    # The recorded starting accuracy is that of the assembled CNN-DNN on the validation split.
    start = run.meta("transfer")["start_accuracy"]["val"]
    assert start == pytest.approx(run.meta("coarse")["accuracy"]["val"], abs=1e-6)


def test_global_transfer_starts_from_the_best_local_net(finished):
    _, run, _, started = finished
    meta = run.meta("global_transfer")
    val = [run.meta("local", i)["accuracy"]["val"] for i in range(N)]
    assert meta["init"] == "best" and meta["sources"] == [val.index(max(val))]
    assert meta["skipped_tensors"] == []  # same builder: every tensor fits
    _assert_same(started["global_transfer"], _saved(run, "local", meta["sources"][0]))


def test_global_transfer_mean_init_averages_the_local_nets(finished):
    cfg, run, _, _ = finished
    cfg = copy.deepcopy(cfg)
    cfg.methods.global_transfer.init = "mean"
    net, record = init_global_transfer(build_context(cfg, run.root, claim=False))
    assert record["sources"] == list(range(N))
    locals_ = [_saved(run, "local", i) for i in range(N)]
    for key, value in net.state_dict().items():
        if value.is_floating_point():
            assert torch.allclose(value, torch.stack([s[key] for s in locals_]).mean(0)), key
    cfg.methods.global_transfer.init = 7
    with pytest.raises(ValueError, match="'best', 'mean' or a local net index 0..1"):
        init_global_transfer(build_context(cfg, run.root, claim=False))


def test_e2e_starts_from_the_local_nets_random_initialisation(finished):
    cfg, run, _, started = finished
    ctx = build_context(cfg, run.root, claim=False)
    for i in range(N):
        seed_everything(subdomain_seed(cfg.seed, i))
        fresh = build_local_net(ctx.settings, ctx.data).state_dict()
        _assert_same(_prefixed(started["e2e"], f"local_nets.{i}."), fresh)


def test_every_optional_stage_writes_its_artifacts_and_results_rows(finished):
    cfg, run, results, _ = finished
    for stage in OPTIONAL:
        folder = run.stage_dir(stage)
        names = ("last.ckpt", "probs_train.pt", "probs_val.pt", "probs_test.pt", "net.pt", "done")
        if stage in NO_CHECKPOINT:
            names = ("done",) if stage == "local_oof" else names[1:]
        for name in names:
            assert (folder / name).is_file(), f"{folder / name} missing"
        assert run.meta(stage)["time_s"] > 0
    assert run.meta("coarse_alt")["input"] == "logits"
    saved = json.loads((run.root / "results.json").read_text())
    assert saved["accuracy"] == results["accuracy"]
    for key in ("global", "cnn_dnn", "mean_prob", "majority_vote", *METHODS):
        assert 0.0 <= saved["accuracy"][key] <= 1.0, key
    assert [row["key"] for row in saved["methods"]] == list(METHODS)
    assert saved["accuracy"]["cnn_dnn_probs"] == saved["accuracy"]["cnn_dnn"]  # coarse.input=probs: the main one
    rows = {row["key"]: row for row in saved["methods"]}
    t = saved["time_s"]
    assert rows["transfer"]["sequential_time_s"] == pytest.approx(t["local_total"] + t["coarse"] + t["transfer"])
    assert rows["transfer"]["projected_time_s"] == pytest.approx(t["local_max"] + t["coarse"] + t["transfer"])
    assert rows["e2e"]["devices"] == 1 and rows["cnn_dnn_logits"]["devices"] == N
    assert rows["global"]["speedup"] == pytest.approx(1.0)
    # The global CNN with DDP on 2 CPU processes: its wall time there, the same global batch split in two.
    ddp = run.meta("global_ddp")
    assert ddp["num_devices"] == 2 and ddp["batch_per_device"] * 2 == cfg.data.batch_size
    assert rows["global_ddp"]["devices"] == 2 and rows["global_ddp"]["sequential_time_s"] is None
    assert rows["global_ddp"]["projected_time_s"] == pytest.approx(t["global_ddp"])
    assert rows["global_ddp"]["speedup"] == pytest.approx(t["global"] / t["global_ddp"])
    assert "| global CNN, DDP on 2 devices |" in (run.root / "results.md").read_text()
    md = (run.root / "results.md").read_text()
    for name in (METHODS[k] for k in ("cnn_dnn_probs", "cnn_dnn_logits", "e2e", "transfer")):
        assert f"| {name} |" in md


def test_finished_optional_stage_is_skipped(finished):
    cfg, run, _, _ = finished
    stamp = (run.stage_dir("transfer") / "done").stat().st_mtime_ns
    cfg = copy.deepcopy(cfg)
    cfg.stage = "transfer"
    meta = train(cfg)["transfer"]
    assert (run.stage_dir("transfer") / "done").stat().st_mtime_ns == stamp
    assert meta == run.meta("transfer")


def test_a_run_of_the_old_coarse_input_default_resumes_with_its_coarse_dnn_on_logits(tmp_path):
    """A run directory written when logits were the default (2026-12-04 to 2026-12-07: its coarse DNN finished on
    them) resumed with the same command line under today's default, the paper's probabilities: nothing finished is
    retrained, the CNN-DNN stays the coarse DNN on logits, and coarse_alt trains the other input, probabilities (not
    logits a second time)."""
    from ddcnn.rundir import CHANGED_DEFAULTS
    from ddcnn.settings.read import yaml_default

    assert yaml_default("coarse.input") == "probs" == CHANGED_DEFAULTS["coarse.input"][1]
    grid = ["decomposition.grid=[1,2]", "methods.enabled.coarse_alt=false", "methods.enabled.stacker=false"]
    grid += ["methods.enabled.coarse_val=false", "++report.plots=false", "++report.export=false"]
    train(compose_config([*grid, "coarse.input=logits"], tmp_path))
    run = RunDir(tmp_path)
    stamp = (run.stage_dir("coarse") / "done").stat().st_mtime_ns
    results = train(compose_config(grid[:1], tmp_path))
    assert (run.stage_dir("coarse") / "done").stat().st_mtime_ns == stamp
    assert run.meta("coarse")["input"] == "logits" and run.meta("coarse_alt")["input"] == "probs"
    assert results["coarse_input"] == {"coarse": "logits", "coarse_alt": "probs"}
    assert results["accuracy"]["cnn_dnn"] == results["accuracy"]["cnn_dnn_logits"]
    # a new run directory takes today's default
    fresh = train(compose_config(grid[:1], tmp_path / "new"))
    assert fresh["coarse_input"] == {"coarse": "probs", "coarse_alt": "logits"}


def test_default_run_enables_only_the_cheap_combiners():
    def enabled(*overrides: str) -> list[str]:
        return enabled_stages(RunSettings.from_config(compose_config(list(overrides), run_dir="unused")))

    assert enabled() == ["coarse_alt", "stacker", "coarse_val"]
    # A method brings the optional stages it needs.
    assert enabled("methods.enabled.coarse_oof=true")[1:4] == ["stacker", "local_oof", "coarse_oof"]
    assert enabled("methods=all") == list(OPTIONAL)


def test_every_registered_stage_has_a_run_function():
    assert OPTIONAL_STAGES == registry.OPTIONAL_STAGES
    for stage in registry.STAGES:
        assert callable(registry.load(stage.name)), stage.name


def test_transfer_before_the_local_stage_names_what_is_missing(make_cfg):
    cfg = make_cfg("stage=transfer")
    with pytest.raises(FileNotFoundError, match=r"stages \[0, 1, 2, 3, 'coarse'\] have not finished"):
        train(cfg)
    assert not RunDir(cfg.paths.run_dir).stage_dir("transfer").exists()
    with pytest.raises(FileNotFoundError, match=r"local nets \[0, 1, 2, 3\] have not finished"):
        train(make_cfg("stage=global_transfer"))


def test_methods_switched_on_later_train_only_the_new_stages(make_cfg):
    base = ("decomposition.grid=[1,2]", "methods.enabled.coarse_alt=false", "methods.local_oof.folds=2")
    train(make_cfg(*base))
    run = RunDir(make_cfg().paths.run_dir)
    assert not run.is_done("coarse_alt") and not run.is_done("transfer")
    markers = [run.stage_dir("local", 0) / "done", run.stage_dir("coarse") / "done"]
    stamps = [m.stat().st_mtime_ns for m in markers]
    # methods.enabled does not change what any stage computes, so the same run directory accepts it.
    results = train(make_cfg("decomposition.grid=[1,2]", *ALL))
    assert [m.stat().st_mtime_ns for m in markers] == stamps  # nothing retrained
    assert all(run.is_done(stage) for stage in OPTIONAL)
    assert all(results["accuracy"][key] is not None for key in METHODS)


def test_cosine_schedule_anneals_over_each_stages_own_epochs():
    from ddcnn.engine.optim import scheduler_factory

    cfg = compose_config(["experiment=cifar10", "trainer.max_epochs=5"])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert scheduler_factory(cfg.scheduler, 5)(opt).T_max == 5  # a local net or the global CNN
    assert scheduler_factory(cfg.scheduler, 40)(opt).T_max == 40  # the coarse DNN: its own coarse.max_epochs
    # the default (scheduler: plateau) is ReduceLROnPlateau(factor=0.5, patience=2), read by the loop's settings
    default = RunSettings.from_config(compose_config()).loop.scheduler
    plateau = scheduler_factory(default, 5)(opt)
    assert isinstance(plateau, torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert (plateau.factor, plateau.patience) == (0.5, 2)
    assert scheduler_factory(RunSettings.from_config(compose_config(["scheduler=null"])).loop.scheduler, 5) is None


def test_every_registered_stage_gives_a_results_row_with_accuracy_time_and_speedup(finished):
    """Walks the registry: a finished stage with a row in the table must give that row, complete."""
    _, run, results, _ = finished
    rows = {row["stage"]: row for row in results["methods"] if row.get("stage")}
    for stage in registry.STAGES:
        if stage.row is None:
            continue
        assert run.is_done(stage.name), f"methods=all should have trained {stage.name}"
        row = rows.get(stage.name)
        assert row is not None, f"stage {stage.name} finished but has no results row"
        assert row["accuracy"] is not None and row["projected_time_s"] is not None, row
        assert row["speedup"] is not None and row["devices"] is not None, row
        assert (row["sequential_time_s"] is None) == (stage.row.sequential is None), row


def test_every_stage_module_is_registered():
    helpers = {"__init__", "common", "reuse"}  # what the stages share: no stage of their own
    modules = {p.stem for p in (Path(registry.__file__).parent / "stages").glob("*.py")} - helpers
    assert modules == {s.module.rsplit(".", 1)[1] for s in registry.STAGES}


def test_method_settings_for_an_unknown_stage_are_refused(make_cfg):
    with pytest.raises(ValueError, match=r"methods has settings for unknown stages \['transfr'\]"):
        train(make_cfg("+methods.transfr.lr_scale=0.1"))


def test_every_stage_records_whether_it_converged(finished):
    """The contract of docs/protocol.md, "Convergence", in every stage's meta.json: the tiny run trains 1 epoch (too
    short to judge: not converged); the convex stacker's L-BFGS converged when it stopped by its own criteria, not by
    its iteration cap."""
    _, run, _, _ = finished
    keys = {
        "converged",
        "reasons",
        "cause",
        "epochs",
        "min_epochs",
        "stopped_by",
        "lr_ratio",
        "train_loss_change_last3",
    }
    for stage in ("local", "coarse", "global", *OPTIONAL):
        for index in range(N) if stage in ("local", "local_oof") else [None]:
            meta = run.meta(stage, index)
            assert isinstance(meta["converged"], bool), (stage, index)
            if stage == "local_oof":
                records = [fold["convergence"] for fold in meta["folds"]]
                assert all(keys <= set(r) for r in records)
                assert meta["converged"] is all(r["converged"] for r in records)
                continue
            record = meta["convergence"]
            assert keys <= set(record) and meta["converged"] is record["converged"], (stage, index)
            assert ("advice" in record) is not record["converged"], (stage, index)  # a cause and its fix
            assert record["converged"] is (record["reasons"] == []), (stage, index)
    assert run.meta("local_oof")["converged"] is False  # its folds trained 1 epoch each
    for stage in ("global", "e2e", "global_ddp"):
        assert run.meta(stage)["convergence"]["reasons"] == ["too short to judge: 1 epoch(s), fewer than 3"]
    stacker = run.meta("stacker")["convergence"]
    assert stacker["stopped_by"] in ("tolerance", "no_change", "max_iter") and stacker["epochs"] > 0
    assert stacker["converged"] is (stacker["stopped_by"] != "max_iter")
    from ddcnn.stages.common import logistic_convergence

    path = [{"l2": 1.0, "converged": False, "iterations": 9}, {"l2": 0.1, "converged": False, "iterations": 250}]
    assert logistic_convergence(path, 1.0, 200)["stopped_by"] == "no_change"  # stopped early by its own rule
    capped = logistic_convergence(path, 0.1, 200)
    assert capped["converged"] is False and capped["reasons"] == ["L-BFGS hit its iteration cap (200) at L2 0.1"]
