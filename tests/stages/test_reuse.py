"""One global CNN per settings across the runs of a sweep (ddcnn/stages/reuse.py): trained once, copied into every
run with the same data, model, recipe and seed whatever its decomposition; never reused across other settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddcnn.pipeline import train
from ddcnn.store import Store, store_main
from tests.conftest import TINY_OVERRIDES, compose_config

ROOT = Path(__file__).resolve().parents[2]
FILES = ("probs_train.pt", "probs_val.pt", "probs_test.pt", "net.pt", "logs/metrics.csv")


def _global(make_cfg, run_dir: Path, store: Path, *overrides: str) -> dict:
    cfg = make_cfg("stage=global", "store.reuse=true", f"store.root={store}", *overrides, run_dir=run_dir)
    return train(cfg)["global"]


# What the global CNN's result depends on, and what it does not: the key must change with the first, never the second.
MATTERS = [
    "seed=1",
    "model=vgg_small",
    "optimizer.lr=0.01",
    "global_lr_scale=0.5",
    "trainer.max_epochs=2",
    "trainer.precision=bf16-mixed",
    "engine.patience=6",
    "engine.min_epochs=1",
    "engine.min_steps=10",
    "data.batch_size=16",
    "data.train_subset=200",
    "+data.augment.flip_axes=[1]",
    "report.curves.points=3",
]
DOES_NOT_MATTER = [
    "decomposition=4x4",
    "decomposition.overlap=1",
    "coarse.max_epochs=5",
    "coarse.optimizer.lr=0.1",
    "methods.enabled.stacker=false",
    "parallel.workers=2",
    "report.plots=true",
    "report.curves.max_train_rows=10",
    "data.memory.mode=memory",
    "force=true",
    "store.stage_to=/tmp/elsewhere",
    "+global_model=${model}",  # the same network, named as the global one
    "global_lr_scale=1",  # its default, written out
]


def _key(*overrides: str) -> str:
    from types import SimpleNamespace

    from ddcnn.settings import RunSettings
    from ddcnn.stages.reuse import stage_depends

    cfg = compose_config(list(overrides), Path("/tmp/unused-run"))
    return Store.key(
        "global",
        stage_depends(
            SimpleNamespace(identity=RunSettings.from_config(cfg).identity(), settings=RunSettings.from_config(cfg)),
            "global",
            "cpu",
        ),
    )


def test_the_key_holds_what_changes_the_global_cnn_and_nothing_else():
    base = _key()
    changed = {o for o in MATTERS if _key(o) == base}
    assert not changed, f"these change the global CNN but not its key: {changed}"
    moved = {o for o in DOES_NOT_MATTER if _key(o) != base}
    assert not moved, f"these do not change the global CNN but change its key: {moved}"


def test_runs_that_differ_in_the_decomposition_train_the_global_cnn_once(make_cfg, tmp_path, capsys):
    store = tmp_path / "store"
    first = _global(make_cfg, tmp_path / "a", store, "decomposition.grid=[1,2]")
    assert "reused_from" not in first and first["published"]["key"]
    other_decomposition = ("decomposition.grid=[2,2]", "decomposition.overlap=1")
    again = _global(make_cfg, tmp_path / "b", store, *other_decomposition)
    (entry,) = Store(store).entries("global")
    assert again["reused_from"]["key"] == entry.key == first["published"]["key"]
    assert again["reused_from"]["run_dir"] == str((tmp_path / "a").resolve())
    assert again["time_s"] == first["time_s"] and again["accuracy"] == first["accuracy"]
    for name in FILES:  # the same network, predictions and curve: a copy, checked against the store's sha256
        assert (tmp_path / "b" / "global" / name).read_bytes() == (tmp_path / "a" / "global" / name).read_bytes()
    assert json.loads((tmp_path / "b" / "global" / "meta.json").read_text())["reused_from"]["entry"] == str(entry.path)
    assert store_main(["--root", str(store), "list"]) == 0
    listed = capsys.readouterr().out
    assert f"global/{entry.key}" in listed and "seed 0" in listed
    # force=true trains it again and replaces the entry with its own.
    forced = _global(make_cfg, tmp_path / "b", store, *other_decomposition, "force=true")
    (replaced,) = Store(store).entries("global")
    assert "reused_from" not in forced and replaced.key == entry.key
    assert replaced.info["run_dir"] == str((tmp_path / "b").resolve())


def _ddp_key(*overrides: str) -> str:
    from types import SimpleNamespace

    from ddcnn.settings import RunSettings
    from ddcnn.stages.reuse import stage_depends

    cfg = compose_config(["methods.enabled.global_ddp=true", *overrides], Path("/tmp/unused-run"))
    return Store.key(
        "global_ddp",
        stage_depends(
            SimpleNamespace(identity=RunSettings.from_config(cfg).identity(), settings=RunSettings.from_config(cfg)),
            "global_ddp",
            "cpu",
        ),
    )


def test_the_ddp_key_holds_its_devices_and_not_the_decomposition():
    base = _ddp_key()
    assert _ddp_key("methods.global_ddp.num_devices=4") != base  # another device count: another training
    assert _ddp_key("methods.global_ddp.num_devices=2") == base  # the default, spelled out
    assert _ddp_key("seed=1") != base and _ddp_key("trainer.max_epochs=2") != base
    assert _ddp_key("decomposition=4x4", "decomposition.overlap=1", "coarse.max_epochs=5") == base
    assert _ddp_key() != _key()  # never the one-device global CNN's entry


@pytest.mark.slow
def test_runs_that_differ_in_the_decomposition_train_global_ddp_once(make_cfg, tmp_path):
    store = tmp_path / "store"

    def ddp(run: str, *overrides: str) -> dict:
        cfg = make_cfg(
            "stage=global_ddp",
            "methods.enabled.global_ddp=true",
            "store.reuse=true",
            f"store.root={store}",
            *overrides,
            run_dir=tmp_path / run,
        )
        return train(cfg)["global_ddp"]

    first = ddp("a", "decomposition.grid=[1,2]")
    again = ddp("b", "decomposition.grid=[2,2]", "decomposition.overlap=1")
    assert "reused_from" not in first and first["num_devices"] == 2
    (entry,) = Store(store).entries("global_ddp")
    assert again["reused_from"]["key"] == entry.key == first["published"]["key"]
    assert again["time_s"] == first["time_s"] and again["num_devices"] == 2
    for name in FILES:  # the same DDP network, predictions and log: a copy
        assert (tmp_path / "b" / "global_ddp" / name).read_bytes() == (
            tmp_path / "a" / "global_ddp" / name
        ).read_bytes()
    assert not Store(store).entries("global")  # the one-device global CNN was not trained, nor stored
    other_seed = ddp("c", "seed=1")
    assert "reused_from" not in other_seed and len(Store(store).entries("global_ddp")) == 2


def test_a_setting_that_changes_the_global_cnn_trains_it_again(make_cfg, tmp_path):
    store = tmp_path / "store"
    base = _global(make_cfg, tmp_path / "a", store)
    other_seed = _global(make_cfg, tmp_path / "b", store, "seed=1")
    longer = _global(make_cfg, tmp_path / "c", store, "trainer.max_epochs=2")
    assert not any("reused_from" in m for m in (base, other_seed, longer))
    assert len({m["published"]["key"] for m in (base, other_seed, longer)}) == 3
    assert len(Store(store).entries("global")) == 3
    a, b = (torch.load(tmp_path / r / "global" / "probs_test.pt", weights_only=True) for r in "ab")
    assert not torch.equal(a["probs"], b["probs"])


def test_switched_off_it_trains_in_the_run_and_leaves_the_store_alone(make_cfg, tmp_path):
    store = tmp_path / "store"
    cfg = make_cfg("stage=global", "store.reuse=false", f"store.root={store}", run_dir=tmp_path / "a")
    meta = train(cfg)["global"]
    assert "published" not in meta and "reused_from" not in meta
    assert not (store / "global").exists()


def test_a_switch_that_is_not_true_or_false_is_refused_before_anything_trains(make_cfg, tmp_path):
    cfg = make_cfg("store.reuse=sometimes", run_dir=tmp_path / "a")
    with pytest.raises(ValueError, match=r"store.reuse must be true or false .* got 'sometimes'"):
        train(cfg)
    assert not (tmp_path / "a" / "local").exists()


def test_a_store_that_cannot_be_written_costs_the_reuse_not_the_run(make_cfg, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    meta = _global(make_cfg, tmp_path / "a", blocked)
    assert "published" not in meta and "reused_from" not in meta and meta["accuracy"]["test"] is not None
    assert "it trains here, without reuse" in caplog.text


_RACER = """
import json, logging, sys, time
from pathlib import Path
from ddcnn import registry
from ddcnn.config import compose
from ddcnn.context import build_context
logging.basicConfig(level=logging.INFO)
run_dir, barrier, *overrides = sys.argv[1:]
ctx = build_context(compose(overrides, Path(run_dir)))
registry.load("global")
(Path(barrier) / Path(run_dir).name).touch()
while len(list(Path(barrier).iterdir())) < 2:  # both start the stage at the same moment
    time.sleep(0.01)
meta = registry.run("global", ctx, "cpu")
print(json.dumps({"reused": "reused_from" in meta}))
"""


@pytest.mark.slow
def test_concurrent_runs_with_the_same_settings_train_one_global_cnn(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    overrides = [*TINY_OVERRIDES, "stage=global", "store.reuse=true", f"store.root={tmp_path / 'store'}"]
    # Two epochs on the whole (tiny) training split: the second process surely finds the first one at work.
    overrides += ["trainer.limit_train_batches=null", "trainer.max_epochs=2"]
    barrier = tmp_path / "ready"
    barrier.mkdir()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RACER,
                str(tmp_path / f"run{i}"),
                str(barrier),
                *overrides,
                f"decomposition.grid=[{i + 1},2]",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    reused = [json.loads(out.strip().splitlines()[-1])["reused"] for out, _ in outs]
    assert sorted(reused) == [False, True]  # exactly one trained, the other reused its entry
    waiter = outs[reused.index(True)][1]
    assert "waiting for" in waiter, waiter[-2000:]  # it waited for the builder rather than finding a finished entry
    assert len(Store(tmp_path / "store").entries("global")) == 1
    a, b = (torch.load(tmp_path / f"run{i}" / "global" / "probs_test.pt", weights_only=True) for i in range(2))
    assert torch.equal(a["probs"], b["probs"])


@pytest.mark.slow
def test_a_sweep_over_decompositions_trains_one_global_cnn(tmp_path):
    exe = Path(sys.executable).parent / "ddcnn-train"
    sweep, store = tmp_path / "sweep", tmp_path / "store"
    proc = subprocess.run(
        [
            str(exe) if exe.is_file() else "ddcnn-train",
            "-m",
            *[o for o in TINY_OVERRIDES if not o.startswith("report.curves")],
            "store.reuse=true",
            f"store.root={store}",
            "decomposition.grid=[1,2],[2,2]",
            "seed=0",
            f"hydra.sweep.dir={sweep}",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(Store(store).entries("global")) == 1
    first, second = (json.loads((sweep / str(i) / "results.json").read_text()) for i in range(2))
    assert not first["reused"] and second["reused"]["global"]["run_dir"] == str((sweep / "0").resolve())
    assert second["time_s"]["global"] == first["time_s"]["global"]
    assert second["accuracy"]["global"] == first["accuracy"]["global"]
    # The reused global CNN's curve travels with it: the speedup at equal accuracy is computed as for a trained one.
    assert second["curves"]["global"] == first["curves"]["global"] and second["speedup_at_equal_accuracy"]
    assert "| global CNN (reused) |" in (sweep / "1" / "results.md").read_text()
