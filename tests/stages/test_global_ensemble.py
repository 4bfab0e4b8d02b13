"""The ensemble of k global CNNs (ddcnn/stages/global_ensemble.py) and its coarse DNN (global_ensemble_coarse.py):
new initialisations per member, mean probability and the coarse fit, k at equal one-device time, members shared across
grids through the store."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from ddcnn.context import build_context, subdomain_seed
from ddcnn.pipeline import enabled_stages, train
from ddcnn.rundir import RunDir
from ddcnn.settings import RunSettings
from ddcnn.stages.global_ensemble import ensemble_size, member_seed
from tests.conftest import compose_config

# Two sub-domains and none of the default combiners: the arms and what they are compared with.
BASE = [
    "decomposition.grid=[1,2]",
    "methods.enabled.coarse_alt=false",
    "methods.enabled.stacker=false",
    "methods.enabled.coarse_val=false",
]
K = 2


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ensemble")
    cfg = compose_config(
        [*BASE, "methods.enabled.global_ensemble_coarse=true", f"methods.global_ensemble.k={K}"], run_dir
    )
    return cfg, RunDir(run_dir), train(cfg)


def test_the_coarse_arm_brings_the_ensemble_and_both_are_off_by_default():
    def enabled(*overrides: str) -> list[str]:
        return enabled_stages(RunSettings.from_config(compose_config([*BASE, *overrides], run_dir="unused")))

    assert enabled() == []
    assert enabled("methods.enabled.global_ensemble_coarse=true") == ["global_ensemble", "global_ensemble_coarse"]


def test_members_are_new_initialisations_seeded_by_the_run_seed_and_their_index(finished):
    cfg, run, _ = finished
    meta = run.meta("global_ensemble")
    assert meta["k"] == K and meta["k_rule"] == {"setting": "methods.global_ensemble.k", "k": K}
    ctx = build_context(cfg, run.root, claim=False)
    seeds = [member_seed(ctx, i) for i in range(K)]
    assert meta["member_seeds"] == seeds == [run.meta("global_ensemble", i)["seed"] for i in range(K)]
    assert len(set(seeds)) == K and run.meta("global")["seed"] not in seeds
    # never another seed's global CNN (nor this seed's): its seeds for the run seeds 0..999
    assert not set(seeds) & {subdomain_seed(s, -2) for s in range(1000)}
    # each member trained on its own from its own initial weights
    nets = [torch.load(run.stage_dir("global_ensemble", i) / "net.pt", weights_only=True) for i in range(K)]
    first = next(k for k, v in nets[0].items() if v.is_floating_point())
    assert not torch.equal(nets[0][first], nets[1][first])
    other_seed = copy.deepcopy(cfg)
    other_seed.seed = 1
    other = build_context(other_seed, run.root, claim=False)
    assert not set(seeds) & {member_seed(other, i) for i in range(K)}


def test_the_mean_probability_is_that_of_the_members(finished):
    _, run, results = finished
    for split in ("train", "val", "test"):
        members = torch.stack([run.load_probs("global_ensemble", split, i)["probs"] for i in range(K)], dim=1)
        saved = run.load_probs("global_ensemble", split)
        assert torch.allclose(saved["probs"], members.mean(1), atol=1e-6), split
    test = run.load_probs("global_ensemble", "test")
    expected = float((test["probs"].argmax(-1) == test["labels"]).float().mean())
    assert results["accuracy"]["global_ensemble"] == pytest.approx(expected)


def test_the_coarse_arm_is_the_coarse_fit_on_the_members(finished):
    _, run, _ = finished
    meta = run.meta("global_ensemble_coarse")
    coarse = run.meta("coarse")
    assert meta["k"] == K and meta["seed"] == coarse["seed"]  # the coarse DNN's seed and procedure
    assert meta["input"] == coarse["input"] and meta["coarse_net"] == coarse["coarse_net"]
    assert meta["fit"]["plan"] == coarse["fit"]["plan"]
    ensemble = run.meta("global_ensemble")
    assert meta["params"] == ensemble["params"] + meta["coarse_params"]


def test_both_arms_give_rows_with_their_times_and_parameters(finished):
    _, run, results = finished
    saved = json.loads((run.root / "results.json").read_text())
    rows = {row["key"]: row for row in saved["methods"]}
    t = saved["time_s"]
    members = [run.meta("global_ensemble", i) for i in range(K)]
    assert t["global_ensemble"] >= sum(m["time_s"] for m in members)
    assert rows["global_ensemble"]["sequential_time_s"] == pytest.approx(t["global_ensemble"])
    assert rows["global_ensemble_coarse"]["sequential_time_s"] == pytest.approx(
        t["global_ensemble"] + t["global_ensemble_coarse"]
    )
    assert rows["global_ensemble"]["devices"] == 1
    assert rows["global_ensemble"]["params"] == sum(m["params"] for m in members) == K * saved["params"]["global"]
    md = (run.root / "results.md").read_text()
    assert "| ensemble of k global CNNs (mean probability) |" in md
    assert "| ensemble of k global CNNs (coarse DNN) |" in md
    assert "CNN-DNN − ensemble of global CNNs (mean probability)" in md


def test_k_auto_is_the_cnn_dnns_one_device_time_over_the_global_cnns(finished, tmp_path):
    """k = round((local nets' time_s + coarse time_s) / global time_s), at least 2, from the finished meta.json."""
    cfg, run, _ = finished
    cfg = copy.deepcopy(cfg)
    cfg.methods.global_ensemble.k = "auto"
    ctx = build_context(cfg, run.root, claim=False)
    n = ctx.decomposition.num_subdomains
    local = sum(run.meta("local", i)["time_s"] for i in range(n))
    expected = max(2, round((local + run.meta("coarse")["time_s"]) / run.meta("global")["time_s"]))
    k, rule = ensemble_size(ctx)
    assert k == expected and rule["k"] == k and rule["setting"] == "methods.global_ensemble.k=auto"
    assert rule["cnn_dnn_sequential_s"] == pytest.approx(local + run.meta("coarse")["time_s"])
    # the recorded times decide: a global CNN a fifth of the CNN-DNN's one-device time gives 5, one as slow gives 2
    for global_s, want in (((local + run.meta("coarse")["time_s"]) / 5, 5), (1e9, 2)):
        path = run.stage_dir("global") / "meta.json"
        meta = json.loads(path.read_text())
        original = meta["time_s"]
        try:
            path.write_text(json.dumps({**meta, "time_s": global_s}))
            assert ensemble_size(ctx)[0] == want
        finally:
            path.write_text(json.dumps({**meta, "time_s": original}))
    # before the CNN-DNN and the global CNN finished, auto names what is missing
    with pytest.raises(FileNotFoundError, match=r"k=auto takes k from .*\['local 0', 'local 1', 'coarse', 'global'\]"):
        train(compose_config([*BASE, "stage=global_ensemble"], tmp_path / "empty"))


def test_k_is_checked():
    with pytest.raises(ValueError, match=r"methods.global_ensemble.k must be a whole number >= 2 .* got 1"):
        RunSettings.from_config(compose_config([*BASE, "methods.global_ensemble.k=1"], run_dir="unused"))


def test_members_are_shared_across_grids_as_the_global_cnn_is(tmp_path):
    """With store.reuse the members train once per settings and seed: a run of another grid copies them (and its
    larger k trains only the members it adds)."""
    arms = [*BASE[1:], "methods.enabled.global_ensemble=true", "store.reuse=true"]
    train(compose_config(["decomposition.grid=[1,2]", *arms, "methods.global_ensemble.k=2"], tmp_path / "a"))
    train(compose_config(["decomposition.grid=[2,1]", *arms, "methods.global_ensemble.k=3"], tmp_path / "b"))
    a, b = RunDir(tmp_path / "a"), RunDir(tmp_path / "b")
    for i in range(2):
        assert b.meta("global_ensemble", i).get("reused_from"), i
        assert b.meta("global_ensemble", i)["seed"] == a.meta("global_ensemble", i)["seed"]
        for split in ("val", "test"):
            assert torch.equal(
                a.load_probs("global_ensemble", split, i)["probs"], b.load_probs("global_ensemble", split, i)["probs"]
            )
    assert not b.meta("global_ensemble", 2).get("reused_from")
    assert b.meta("global_ensemble")["reused_members"] == 2
