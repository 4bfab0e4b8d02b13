"""``ddcnn.config.compose``: the configuration Hydra composes, errors included, with each choice of config groups
composed once per process while ``conf/`` is unchanged."""

from __future__ import annotations

import re
import shutil
import time

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

import ddcnn.config as config
from ddcnn.config import CONFIG_DIR, compose

# Group choices, value overrides of every form Hydra has (set, add, force-add, delete, lists, dicts, null,
# interpolations), an experiment that sets groups and values itself, and a value override of a group's key after it.
CASES = [
    [],
    ["seed=3", "trainer.max_epochs=2", "data.batch_size=16"],
    ["model=vgg_tiny", "decomposition=4x4", "decomposition.overlap=1", "optimizer=sgd", "optimizer.lr=0.05"],
    ["experiment=adrenal3d", "engine.precise_bn=50", "global_lr_scale=0.5", "decomposition=2x2x2"],
    ["experiment=mnist", "model.width_mult=0.5", "methods=all", "methods.enabled.global_ddp=false"],
    ["+data.augment.flip_axes=[1]", "++trainer.max_epochs=7", "~methods.stacker.max_iter", "decomposition.grid=[1,2]"],
    ["+global_model=${model}", "coarse.net.hidden=[8,4]", "scheduler=null"],
    ["scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:3}", "logger=many"],
    ["data=digits", "data.train_subset=300", "model=resnet_tiny", "engine.patience=null", "report.curves.points=all"],
]


def _hydra(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("overrides", CASES, ids=[" ".join(c)[:60] or "defaults" for c in CASES])
def test_compose_gives_hydras_configuration(overrides):
    ours, theirs = compose(overrides), _hydra(overrides)
    assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(theirs)
    assert OmegaConf.is_struct(ours) and OmegaConf.is_struct(theirs)
    # a copy each time: changing one configuration leaves the next one alone
    ours.seed = 99
    assert compose(overrides).seed == theirs.seed


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.max_epoch=3"],
        ["+seed=1"],
        ["~global_model"],
        ["model=no_such_net"],
        ["seed=1,2"],
        ["+global_model=${model}", "global_model.width_mult=2"],
    ],
)
def test_compose_refuses_what_hydra_refuses_with_its_message(overrides):
    with pytest.raises(Exception) as theirs:
        _hydra(overrides)
    with pytest.raises(type(theirs.value)) as ours:
        compose(overrides)
    assert str(ours.value) == str(theirs.value)


def test_a_yaml_edited_after_a_compose_is_read_again(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(CONFIG_DIR, conf)
    monkeypatch.setattr(config, "CONFIG_DIR", str(conf))
    assert compose(["seed=1"]).trainer.max_epochs == _hydra([]).trainer.max_epochs != 7
    trainer = conf / "trainer" / "default.yaml"
    time.sleep(0.01)  # a later modification time even on coarse clocks
    trainer.write_text(re.sub(r"^max_epochs: .*$", "max_epochs: 7", trainer.read_text(), count=1, flags=re.M))
    assert compose(["seed=1"]).trainer.max_epochs == 7


def test_each_choice_of_groups_is_composed_by_hydra_once(monkeypatch):
    calls = []
    original = config._hydra_compose

    def counting(overrides):
        calls.append(list(overrides))
        return original(overrides)

    monkeypatch.setattr(config, "_hydra_compose", counting)
    monkeypatch.setattr(config, "_COMPOSED", type(config._COMPOSED)())
    for seed in range(3):
        compose(["decomposition=8x8", f"seed={seed}", "model=vgg_tiny"])
    compose(["model=vgg_tiny", "decomposition=8x8"])  # another order of the same choice: composed as given
    compose(["hydra.run.dir=elsewhere", "seed=1"])  # Hydra's own node: composed in full
    assert calls == [
        ["decomposition=8x8", "model=vgg_tiny"],
        ["model=vgg_tiny", "decomposition=8x8"],
        ["hydra.run.dir=elsewhere", "seed=1"],
    ]
