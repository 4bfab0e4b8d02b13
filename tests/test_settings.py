"""RunSettings: built from every configuration a user can compose, plain data only, unknown keys and bad values
refused by name, YAML defaults for keys a configuration lacks, and handed to the run's context."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

from ddcnn.config import CONFIG_DIR, compose
from ddcnn.settings import RunSettings, yaml_default

CONF = Path(CONFIG_DIR)
# Every option of every group (its default and the others) and every experiment.
GROUPS = sorted(
    f"{folder.name}={path.stem}"
    for folder in CONF.iterdir()
    if folder.is_dir() and folder.name not in ("hydra", "experiment")
    for path in folder.glob("*.yaml")
    if not path.stem.startswith("_")
)
EXPERIMENTS = sorted(f"experiment={path.stem}" for path in (CONF / "experiment").glob("*.yaml"))


def _settings(*overrides: str) -> RunSettings:
    return RunSettings.from_config(compose(list(overrides), run_dir="/tmp/ddcnn-settings-unused"))


def _walk(value, path: str = "settings"):
    """Every value held by ``value``, recursively through dataclasses, mappings and sequences, with its path."""
    yield path, value
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _walk(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}[{k!r}]")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")


def test_the_default_configuration_builds():
    settings = _settings()
    assert settings.stage == "all" and settings.data.name == "digits" and settings.loop.max_epochs >= 1
    assert settings.methods.global_ddp.num_devices == yaml_default("methods.global_ddp.num_devices") == 2
    assert settings.coarse.monitor == yaml_default("coarse.monitor")


@pytest.mark.parametrize("override", [*GROUPS, *EXPERIMENTS, "methods=all"])
def test_every_group_option_and_experiment_builds_plain_frozen_settings(override):
    settings = _settings(override)
    omegaconf_objects = [path for path, v in _walk(settings) if isinstance(v, DictConfig | ListConfig)]
    assert not omegaconf_objects
    assert len(list(_walk(settings))) > 100  # the walk reaches into every section and spec
    # Frozen: a setting cannot be changed below the entry.
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.seed = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.store.reuse = False  # type: ignore[misc]
    # Plain data: it pickles to worker processes and back unchanged.
    assert pickle.loads(pickle.dumps(settings)) == settings


def test_the_settings_say_what_the_configuration_says():
    settings = _settings(
        "parallel.workers=3",
        "store.reuse=false",
        "report.curves.points=4",
        "methods.e2e.lr_scale=0.5",
        "methods.enabled.stacker=false",
        "subdomain=[1,2]",
        "data.batch_size=16",
    )
    assert settings.parallel.workers == 3 and settings.store.reuse is False
    assert settings.report.curves.points == 4 and settings.methods.e2e.lr_scale == 0.5
    assert settings.methods.enabled["stacker"] is False and settings.subdomain == (1, 2)
    assert settings.data.batch_size == 16 and settings.model["_target_"] == "ddcnn.models.vgg.vgg_small"


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("+store.reuse_all=true", r"store\.reuse_all=True is not a setting of ddcnn; the store settings are .*reuse"),
        ("+parallel.worker=2", r"parallel\.worker=2 is not a setting .* parallel settings are .*workers, accelerator"),
        ("+report.curves.every=2", r"report\.curves\.every=2 is not a setting .* enabled, points, max_train_rows"),
        ("+methods.e2e.epochs=3", r"methods\.e2e\.epochs=3 is not a setting .* max_epochs, lr_scale"),
        ("+coarse.lr=0.1", r"coarse\.lr=0\.1 is not a setting .* the coarse settings are .*input"),
        ("+seeds=3", r"seeds=3 is not a setting of ddcnn; the top-level settings are .*seed"),
        ("+trainer.foo=1", r"trainer\.foo=1 is not a setting of ddcnn's training loop"),
        ("store.reuse=maybe", r"store\.reuse must be true or false .* got 'maybe'"),
        ("parallel.workers=0", r"parallel\.workers must be a positive whole number, got 0"),
        ("parallel.mode=slurm", r"parallel\.mode must be auto .*, got 'slurm'"),
        ("report.plots=yes", r"report\.plots must be true or false .* got 'yes'"),
        ("report.curves.points=-1", r"report\.curves\.points must be a whole number >= 0 .* or 'all'"),
        ("report.curves.points=some", r"report\.curves\.points must be a whole number >= 0 .* got 'some'"),
        (
            "methods.transfer.lr_scale=0",
            r"methods\.transfer\.lr_scale must be a positive number \(a factor on optimizer\.lr\), got 0",
        ),
        ("methods.e2e.max_epochs=0", r"methods\.e2e\.max_epochs must be a positive whole number, got 0"),
        ("coarse.monitor=val_auc", r"coarse\.monitor must be val_loss or val_acc"),
        ("coarse.divergence_restarts=-1", r"coarse\.divergence_restarts must be >= 0, got -1"),
        ("coarse.steps=0", r"coarse\.steps must be a positive whole number, got 0"),
        ("coarse.batch_size=0", r"coarse\.batch_size must be a positive whole number, got 0"),
        ("data.num_classes=0", r"data\.num_classes must be a positive whole number or auto"),
    ],
)
def test_unknown_keys_and_bad_values_are_refused_by_name(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        _settings(override)


def test_a_configuration_without_newer_sections_takes_the_yaml_defaults():
    """A ``config.yaml`` that an older ddcnn wrote into a run directory may lack sections added since: the settings
    take their YAML defaults (no default is written in code)."""
    cfg = compose([], run_dir="/tmp/ddcnn-settings-unused")
    plain = OmegaConf.to_container(cfg, resolve=True)
    for key in ("store", "report"):
        del plain[key]
    del plain["parallel"]["startup_timeout_s"]
    settings = RunSettings.from_config(OmegaConf.create(plain))
    assert settings.store == _settings().store and settings.report == _settings().report
    assert settings.parallel.startup_timeout_s == yaml_default("parallel.startup_timeout_s") == 600


def test_a_coarse_setting_set_to_null_takes_its_yaml_default_unless_null_means_something():
    settings = _settings(
        "coarse.steps=null",
        "coarse.batch_size=null",
        "coarse.monitor=null",
        "coarse.linear.l2_grid=null",
        "coarse.patience=null",
        "coarse.checkpoint_every=null",
    )
    coarse = settings.coarse
    assert coarse.steps == yaml_default("coarse.steps") == 400 and coarse.batch_size == "auto"
    assert coarse.monitor == "val_acc" and coarse.linear.l2_grid == tuple(yaml_default("coarse.linear.l2_grid"))
    # patience: null trains max_epochs; checkpoint_every: null writes last.ckpt after the last epoch only.
    assert coarse.patience is None and coarse.checkpoint_every is None


def test_data_counts_set_to_auto_are_resolved_from_the_data():
    settings = _settings("data.num_classes=auto", "data.in_channels=auto")
    assert settings.data.num_classes == "auto"
    resolved = settings.with_data_counts(num_classes=10, in_channels=1)
    assert (resolved.data.num_classes, resolved.data.in_channels) == (10, 1)
    assert settings.data.num_classes == "auto"  # the original is unchanged


def test_the_context_holds_the_settings_with_the_data_counts(make_cfg):
    from ddcnn.context import build_context

    ctx = build_context(make_cfg("data.num_classes=auto"), claim=False)
    assert isinstance(ctx.settings, RunSettings)
    assert ctx.settings.data.num_classes == ctx.data.num_classes == 10
    assert not hasattr(ctx, "cfg")  # below the entry, nothing holds the configuration
    # The run's identity, which the run directory records and its fingerprint is computed from, holds the data's
    # count, not auto.
    assert ctx.identity.settings["data"]["num_classes"] == 10
    assert "num_classes: 10" in ctx.identity.config_yaml


def test_the_prepared_data_follow_the_data_settings(make_cfg):
    from ddcnn.context import load_data

    settings = RunSettings.from_config(make_cfg("data.train_subset=200", "data.test_subset=50"))
    data = load_data(settings)
    assert (len(data.y["train"]), len(data.y["test"])) == (200, 50)


def test_the_data_settings_are_the_preparations_with_no_field_or_default_copied(make_cfg):
    """PrepareSettings declares the preparation's fields once, with no default (the YAML holds them); DataSettings is
    one and adds only its own; the store key of a preparation is what it was when the fields were copied."""
    import dataclasses

    from ddcnn.data.prepare import PrepareSettings
    from ddcnn.settings import DataSettings
    from ddcnn.store import Store

    prepare = {f.name for f in dataclasses.fields(PrepareSettings)}
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(PrepareSettings))
    assert issubclass(DataSettings, PrepareSettings) and not prepare & set(vars(DataSettings)["__annotations__"])
    overrides = ("data.window=[-1000,400]", "data.float_storage=float32", "data.image_size=12", "data.train_subset=200")
    settings = RunSettings.from_config(make_cfg(*overrides))
    depends = settings.data.depends()
    assert depends == {
        "num_classes": 10,
        "in_channels": 1,
        "spatial_dims": 2,
        "image_size": (12, 12),
        "val_fraction": 0.15,
        "split_seed": 0,
        "train_subset": 200,
        "test_subset": 100,
        "float_storage": None,  # float32 is the exact default, spelled null
        "window": (-1000.0, 400.0),
    }
    # the key the copied PrepareSettings of c7e6436 gave these settings (prepared copies in stores stay found)
    assert Store.key("prepared", {"format": 1, "settings": depends}) == "166454f8d5a2ce4bb07f60a5"
    with pytest.raises(ValueError, match=r"data\.window must be \[low, high\] with low < high"):
        RunSettings.from_config(make_cfg("data.window=[400,-1000]"))  # checked where the settings are read


def test_global_ddp_devices_are_checked_whenever_the_method_is_enabled():
    """Also in a run of another stage (its local nets first): the DDP baseline would fail only later otherwise."""
    bad = ("methods.enabled.global_ddp=true", "methods.global_ddp.num_devices=3", "data.batch_size=32")
    for stage in ("all", "local"):
        with pytest.raises(ValueError, match=r"num_devices=3 does not divide data\.batch_size=32"):
            _settings(*bad, f"stage={stage}")
    assert _settings(*bad[1:], "stage=local").methods.global_ddp.num_devices == 3  # not enabled: not checked


# Where the composed configuration itself may still be taken: the builder of the settings, the notebooks' builder of
# the context and Hydra's callback API. The run directory records the plain configuration the settings keep.
RAW_CONFIG_ALLOWED = {
    "ddcnn/context.py": {"build_context"},
    "ddcnn/settings/run.py": {"from_config"},
    "ddcnn/parallel/hydra_callbacks.py": {"on_multirun_start"},
}


def test_below_the_entry_no_function_takes_the_configuration():
    """Counted as the settings issue counts them: a parameter named ``cfg``/``config`` or typed ``DictConfig``, in
    ``ddcnn/`` outside ``cli.py`` and ``pipeline.py``; and no object reads a ``ctx.cfg``."""
    import ast
    import re

    root = Path(__file__).resolve().parents[1]
    found, reads = [], []
    for path in sorted((root / "ddcnn").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        source = path.read_text()
        reads += [rel] * len(re.findall(r"\b(?:ctx|context|self)\.cfg\b", source))
        if rel in ("ddcnn/cli.py", "ddcnn/pipeline.py"):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in node.args.args + node.args.kwonlyargs:
                    typed = "DictConfig" in (ast.unparse(arg.annotation) if arg.annotation else "")
                    if (arg.arg in ("cfg", "config") or typed) and node.name not in RAW_CONFIG_ALLOWED.get(rel, ()):
                        found.append(f"{rel}:{node.lineno} {node.name}({arg.arg})")
    assert not found, f"functions below the entry that take the configuration: {found}; take the settings instead"
    assert not reads, f"modules that read a context's configuration: {reads}; read ctx.settings"


def test_the_only_defaults_in_code_are_those_the_yaml_cannot_hold():
    """``+trainer.accumulate_grad_batches`` / ``+trainer.gradient_clip_algorithm`` are added with ``+`` (Hydra refuses
    ``+`` for a key the YAML has), so their defaults live in code: the YAML must not hold them, and says how to add
    them."""
    from ddcnn.settings.loop import ADDED_TRAINER_DEFAULTS

    text = (CONF / "trainer" / "default.yaml").read_text()
    for key, value in ADDED_TRAINER_DEFAULTS.items():
        with pytest.raises(KeyError):
            yaml_default(f"trainer.{key}")
        assert f"+trainer.{key}=" in text
        assert getattr(_settings().loop, key) == value


@pytest.mark.parametrize("name", ["default", "mnist_4x4", "methods"])
def test_a_run_directory_written_before_the_settings_existed_stays_valid(name, tmp_path):
    """``fingerprint.json`` as ddcnn wrote it at 8de1352 (before RunSettings; tests/fixtures/fingerprints_8de1352.json):
    today's entry computes the same fingerprint from the same command line with that time's ``coarse.input`` default
    (probs, which is today's again: logits from 2026-12-04 to 2026-12-07), and claims the directory to resume it."""
    import json

    from ddcnn.rundir import CHANGED_DEFAULTS, RunDir, flatten
    from ddcnn.settings.read import yaml_default
    from ddcnn.settings.run import OLD_RECIPE, RECORD_ABSENT_MEANS

    recorded = json.loads((Path(__file__).parent / "fixtures" / "fingerprints_8de1352.json").read_text())[name]
    (tmp_path / "fingerprint.json").write_text(json.dumps({k: recorded[k] for k in ("fingerprint", "settings")}))
    then = compose([*recorded["overrides"], "coarse.input=probs"], run_dir=str(tmp_path))
    # data.split_seed's default then (0) is what the directory resumes with, whatever the seed (mnist_4x4: 3)
    identity = RunSettings.from_config(then).in_run_dir(tmp_path).identity()
    assert identity.settings == recorded["settings"] and identity.fingerprint == recorded["fingerprint"]
    then.data.split_seed = CHANGED_DEFAULTS["data.split_seed"][0]  # config.yaml records the split seed resolved
    then_settings = flatten(recorded["settings"])
    for key, old in OLD_RECIPE.items():  # and the recipe it resumes with: that time's defaults (issue #45)
        at_old = then_settings.get(key, RECORD_ABSENT_MEANS.get(key)) == old
        if at_old and OmegaConf.select(then, key) == yaml_default(key):
            OmegaConf.update(then, key, old, force_add=True)
    assert identity.config_yaml == OmegaConf.to_yaml(then, resolve=True)  # config.yaml as it was written then
    assert RunDir(tmp_path).claim(identity) == recorded["fingerprint"]
    cfg = compose(recorded["overrides"], run_dir=str(tmp_path))
    today = RunSettings.from_config(cfg).in_run_dir(tmp_path).identity()
    assert today.settings["coarse"]["input"] == CHANGED_DEFAULTS["coarse.input"][1] == "probs"
    assert today.settings == recorded["settings"]
    assert RunDir(tmp_path).claim(today) == today.fingerprint == recorded["fingerprint"]
    assert json.loads((tmp_path / "fingerprint.json").read_text())["fingerprint"] == recorded["fingerprint"]


# --- data.split_seed: a data draw per seed -------------------------------------------------------
def _draw(*overrides: str):
    from ddcnn.context import load_data

    return load_data(_settings("data.train_subset=300", "data.test_subset=100", *overrides))


def test_each_seed_draws_its_own_training_subset_and_every_seed_the_same_test_images():
    """``data.split_seed: null`` is the run's seed: seeds 0 and 1 train (and validate) on other images, the same
    seed draws the same ones, and the test images are the same for every seed."""
    import torch

    zero, one, again = _draw("seed=0"), _draw("seed=1"), _draw("seed=0")
    assert _settings("seed=1").data.split_seed == 1 and _settings().data.split_seed == 0
    for split in ("train", "val"):
        assert torch.equal(zero.stored[split], again.stored[split]) and torch.equal(zero.y[split], again.y[split])
        assert not torch.equal(zero.stored[split], one.stored[split]), split
    assert torch.equal(zero.stored["test"], one.stored["test"]) and torch.equal(zero.y["test"], one.y["test"])
    # A split seed given draws as it says, whatever the seed: seed 1 with split_seed=0 is seed 0's draw.
    fixed = _draw("seed=1", "data.split_seed=0")
    assert torch.equal(fixed.stored["train"], zero.stored["train"])
    with pytest.raises(ValueError, match="data.split_seed must be a whole number or null"):
        _settings("data.split_seed=abc")


def test_the_resolved_split_seed_is_recorded_in_config_yaml(tmp_path):
    from ddcnn.rundir import RunDir

    settings = RunSettings.from_config(compose(["seed=4"], run_dir=str(tmp_path)))
    RunDir(tmp_path).claim(settings.identity())
    recorded = RunDir(tmp_path).recorded_config()
    assert recorded["data"]["split_seed"] == 4 and recorded["seed"] == 4
    assert RunDir(tmp_path).recorded_setting("data.split_seed") == 4
    # Resumed from the same command line: the same draw, the same fingerprint.
    again = RunSettings.from_config(compose(["seed=4"], run_dir=str(tmp_path))).in_run_dir(tmp_path)
    assert again.data.split_seed == 4 and RunDir(tmp_path).claim(again.identity()) == settings.identity().fingerprint


def test_a_run_directory_of_the_old_split_seed_default_resumes_with_it(tmp_path, make_cfg):
    """A run directory recorded when ``data.split_seed`` defaulted to 0 (here: seed 3, written as the old default wrote
    it) resumes from the same command line under today's default with split seed 0: the data its finished stages
    trained on, nothing retrained; a new directory of seed 3 draws seed 3's data."""
    from ddcnn.pipeline import train
    from ddcnn.rundir import RunDir

    base = ("seed=3", "decomposition.grid=[1,2]", "methods.enabled.coarse_alt=false", "methods.enabled.stacker=false")
    base += ("methods.enabled.coarse_val=false",)
    old = tmp_path / "old"
    train(make_cfg(*base, "data.split_seed=0", run_dir=old))
    run = RunDir(old)
    assert run.recorded_setting("data.split_seed") == 0
    stamp = (run.stage_dir("local", 0) / "done").stat().st_mtime_ns
    results = train(make_cfg(*base, run_dir=old))  # today's default: null
    assert (run.stage_dir("local", 0) / "done").stat().st_mtime_ns == stamp  # resumed, nothing retrained
    assert results["accuracy"]["cnn_dnn"] is not None
    settings = RunSettings.from_config(make_cfg(*base, run_dir=old))
    assert settings.data.split_seed == 3 and settings.in_run_dir(old).data.split_seed == 0
    assert settings.in_run_dir(tmp_path / "new").data.split_seed == 3


def test_a_run_directory_of_todays_recipe_without_early_stopping_resumes_with_todays_minimums(tmp_path):
    """engine.patience=null leaves min_epochs and min_steps out of the record (inert); resuming such a directory is no
    sign of the recipe before issue #45: the settings stay as given (the requeued SLURM job's last.ckpt agreed)."""
    import json

    from ddcnn.config import compose

    given = RunSettings.from_config(compose(["engine.patience=null"], run_dir=str(tmp_path)))
    identity = given.identity()
    (tmp_path / "fingerprint.json").write_text(
        json.dumps({"fingerprint": identity.fingerprint, "settings": identity.settings})
    )
    assert "min_steps" not in identity.settings["engine"]
    resumed = given.in_run_dir(tmp_path)
    assert resumed.loop == given.loop and resumed.loop.resume_record() == given.loop.resume_record()
    # and one recorded with the old recipe (no early stopping, val_acc, 15 epochs) resumes with it, minimums included
    old = {**identity.settings, "engine": {**identity.settings["engine"], "monitor": "val_acc", "monitor_mode": "max"}}
    old["trainer"] = {**old["trainer"], "max_epochs": 15}
    old["scheduler"] = None
    (tmp_path / "fingerprint.json").write_text(json.dumps({"fingerprint": "old", "settings": old}))
    then = RunSettings.from_config(compose([], run_dir=str(tmp_path))).in_run_dir(tmp_path).loop
    assert (then.patience, then.monitor, then.max_epochs, then.scheduler, then.min_steps) == (
        None,
        "val_acc",
        15,
        None,
        0,
    )


def test_precise_bn_auto_recomputes_batch_norm_statistics_on_volumes_and_an_older_3d_directory_resumes_without(
    tmp_path,
):
    """engine.precise_bn=auto (the default): 10 training batches on volumes, 0 on images, recorded resolved; an image
    run's fingerprint does not hold it (0 is neutral). A 3D run directory recorded before the setting existed resumes
    as it trained (0), a new one gets 50; a value typed is kept."""
    import json

    from ddcnn.config import compose

    assert yaml_default("engine.precise_bn") == "auto"
    image = _settings()
    assert image.loop.precise_bn == 0 and "precise_bn" not in image.identity().settings["engine"]
    volume = _settings("data=adrenal3d_28", "decomposition=2x2x2")
    assert volume.loop.precise_bn == 10 and volume.identity().settings["engine"]["precise_bn"] == 10
    assert "precise_bn: 10" in volume.identity().config_yaml
    assert _settings("data=adrenal3d_28", "decomposition=2x2x2", "engine.precise_bn=8").loop.precise_bn == 8
    with pytest.raises(ValueError, match=r"engine\.precise_bn must be a whole number of training batches"):
        _settings("engine.precise_bn=some")
    # a 3D directory recorded before engine.precise_bn: its record holds no key (it trained with 0)
    overrides = ["data=adrenal3d_28", "decomposition=2x2x2"]
    before = RunSettings.from_config(compose([*overrides, "engine.precise_bn=0"], run_dir=str(tmp_path))).identity()
    (tmp_path / "fingerprint.json").write_text(
        json.dumps({"fingerprint": before.fingerprint, "settings": before.settings})
    )
    resumed = RunSettings.from_config(compose(overrides, run_dir=str(tmp_path))).in_run_dir(tmp_path)
    assert resumed.loop.precise_bn == 0 and resumed.identity().fingerprint == before.fingerprint
    assert RunSettings.from_config(compose(overrides, run_dir=str(tmp_path / "new"))).loop.precise_bn == 10


def test_a_run_directory_that_recorded_the_monitor_under_its_old_name_resumes_with_it(tmp_path):
    """The oldest records kept the monitor under trainer.monitor / trainer.monitor_mode (rundir.RENAMED_KEYS): such a
    directory resumes with the monitor it trained with, not today's val_loss (which its fingerprint would refuse)."""
    import json

    from ddcnn.config import compose

    identity = RunSettings.from_config(compose([], run_dir=str(tmp_path))).identity()
    old = json.loads(json.dumps(identity.settings))
    for key in ("monitor", "monitor_mode", "min_steps", "min_epochs"):
        old["engine"].pop(key, None)
    old["engine"]["patience"] = None
    old["trainer"] |= {"monitor": "val_acc", "monitor_mode": "max", "max_epochs": 15}
    old["scheduler"] = None
    (tmp_path / "fingerprint.json").write_text(json.dumps({"fingerprint": "old", "settings": old}))
    then = RunSettings.from_config(compose([], run_dir=str(tmp_path))).in_run_dir(tmp_path).loop
    assert (then.monitor, then.monitor_mode, then.patience, then.max_epochs, then.scheduler) == (
        "val_acc",
        "max",
        None,
        15,
        None,
    )


def test_a_field_typed_over_the_plateau_default_changes_that_field_of_the_plateau_scheduler(tmp_path):
    """scheduler: plateau is a string; Hydra sets no field of a string, so ++scheduler.min_lr=... (what the
    rate-collapsed advice prints) replaces it with {min_lr: ...}: read as the plateau scheduler with that field."""
    from ddcnn.config import compose
    from ddcnn.settings.loop import PLATEAU_DEFAULT

    loop = RunSettings.from_config(compose(["++scheduler.min_lr=1e-5"], run_dir=str(tmp_path))).loop
    assert loop.scheduler == {**PLATEAU_DEFAULT, "min_lr": 1e-5}
    loop = RunSettings.from_config(compose(["++scheduler.patience=1"], run_dir=str(tmp_path))).loop
    assert loop.scheduler == {**PLATEAU_DEFAULT, "patience": 1}
    assert RunSettings.from_config(compose(["scheduler=null"], run_dir=str(tmp_path))).loop.scheduler is None
