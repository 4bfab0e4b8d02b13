"""README's recipes ("Extending ddcnn"), followed: a data source added as README says is trained on end to end; the
steps of adding a method are checked where they can go wrong (the registry, the YAML, the settings, the fingerprint)."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ddcnn import registry
from ddcnn.rundir import NEUTRAL_SETTINGS, flatten
from ddcnn.settings import RunSettings
from tests.conftest import CONFIG_DIR, REPO, compose_config

CONF = Path(CONFIG_DIR)
README = (REPO / "README.md").read_text()


def test_readme_holds_the_three_recipes():
    for heading in ("### Add a method", "### Add a loop option", "### Add a data source"):
        assert heading in README, heading


# --- Add a data source ---------------------------------------------------------------------------------------------
_SOURCE = '''
import numpy as np

from ddcnn.data.sources import Splits


def stripes(n: int = 120, size: int = 16, seed: int = 0) -> Splits:
    """Three classes: a bright vertical stripe on the left, in the middle or on the right of a noisy image."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    x = rng.integers(0, 64, size=(n, 1, size, size), dtype=np.uint8)
    for k in range(3):
        x[y == k, :, :, k * 5 : k * 5 + 4] = 255
    cut = n * 3 // 4
    return Splits(x[:cut], y[:cut], x[cut:], y[cut:], class_names=["left", "middle", "right"], name="stripes")
'''

# README step 2: defaults, name, num_classes, source with _target_ and its arguments, a key of the dataset's own.
_CONFIG = """
defaults:
  - _base
  - _self_
name: stripes
samples: 120
source:
  _target_: stripes_source.stripes
  n: ${..samples}
num_classes: 3
batch_size: 16
"""


def test_a_data_source_added_as_readme_says_is_trained_on(tmp_path, monkeypatch):
    from ddcnn.pipeline import train

    (tmp_path / "stripes_source.py").write_text(_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))  # README step 3: its module on PYTHONPATH
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "stripes.yaml").write_text(_CONFIG)
    cfg = compose_config(
        [
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]",  # README step 3: the folder on Hydra's search path
            "data=stripes",
            "data.samples=80",  # the dataset's own key, from the command line
            "data.train_subset=null",
            "data.test_subset=null",
            "decomposition.grid=[1,2]",
            "methods.enabled.coarse_alt=false",
            "methods.enabled.coarse_val=false",
            "methods.enabled.stacker=false",
        ],
        run_dir=tmp_path / "run",
    )
    settings = RunSettings.from_config(cfg)
    assert settings.data.extra == {"samples": 80} and settings.data.source["n"] == 80
    results = train(cfg)
    assert results["data"]["n_test"] == 20 and results["data"]["num_classes"] == 3
    assert set(json.loads((tmp_path / "run" / "results.json").read_text())["accuracy"]) >= {"global", "cnn_dnn"}


# --- Add a method: the steps that can go wrong ---------------------------------------------------------------------
def _methods_yaml(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / "methods" / f"{name}.yaml"))


def test_every_optional_stage_has_its_switch_and_its_place_in_methods_all():
    """Step 3 (steps 1 and 2 are tests/stages/test_methods.py's): `enabled.<name>` in default.yaml (or a stage that
    requires it: local_oof comes with coarse_oof), and methods=all enabling it."""
    switches = set(_methods_yaml("default")["enabled"])
    serving = {r for name in switches for r in registry.get(name).requires if r in registry.OPTIONAL_STAGES}
    assert switches <= set(registry.OPTIONAL_STAGES) and switches | serving == set(registry.OPTIONAL_STAGES)
    everything = {name for name, on in _methods_yaml("all")["enabled"].items() if on}
    brought = {r for name in everything for r in registry.get(name).requires if r in registry.OPTIONAL_STAGES}
    assert everything | brought == set(registry.OPTIONAL_STAGES)


def test_every_methods_settings_block_is_read_by_its_settings_class():
    """Step 4: each `methods.<name>` block has a settings class with one field per key (without it, its keys are
    refused; with a field the YAML lacks, its default would be in code)."""
    methods = RunSettings.from_config(compose_config(["methods=all"])).methods
    for name, block in _methods_yaml("default").items():
        if name == "enabled":
            continue
        assert name in registry.OPTIONAL_STAGES, f"methods.{name}: no such stage in ddcnn/registry.py"
        read = methods.settings_of(name)
        assert read is not None, f"methods.{name} has keys but no settings class (ddcnn/settings/run.py)"
        assert {f.name for f in dataclasses.fields(read)} == set(block), name


def test_a_key_of_a_method_without_settings_is_refused_by_name():
    with pytest.raises(ValueError, match=r"methods\.coarse_alt\.alpha=1 is not a setting of ddcnn; it has none"):
        RunSettings.from_config(compose_config(["+methods.coarse_alt.alpha=1"]))


def test_every_methods_setting_keeps_earlier_run_directories():
    """Step 5: a method's key that run directories written at 8de1352 did not record is neutral at its default (left
    out of the fingerprint), so those directories keep their fingerprint."""
    fixture = json.loads((REPO / "tests" / "fixtures" / "fingerprints_8de1352.json").read_text())
    recorded = set(flatten(fixture["default"]["settings"]))
    defaults = flatten({"methods": {k: v for k, v in _methods_yaml("default").items() if k != "enabled"}})
    new = {key: value for key, value in defaults.items() if key not in recorded}
    assert all(NEUTRAL_SETTINGS.get(key, object()) == value for key, value in new.items()), textwrap.shorten(
        f"add to NEUTRAL_SETTINGS (ddcnn/rundir.py) at their defaults: {new}", 500
    )


def test_a_loop_option_added_as_readme_says_is_read_checked_and_recorded(tmp_path):
    """README's "Add a loop option", steps 1-2: a field declared once with its YAML key, check and resume rule is read
    from the configuration by its key, refused by its key, and recorded for a resume; the loop without the field
    refuses the key (so the field is the step that makes it a setting)."""
    import dataclasses

    from omegaconf import OmegaConf

    from ddcnn.config import compose
    from ddcnn.settings import LoopSettings
    from ddcnn.settings.loop import _bool, _setting

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class WithAnomaly(LoopSettings):
        detect_anomaly: bool = _setting("trainer.detect_anomaly", _bool, default=False, resume="where_set")

    def plain(*overrides: str) -> dict:
        return OmegaConf.to_container(compose(list(overrides), tmp_path / "run"), resolve=False)

    given = plain("+trainer.detect_anomaly=true")
    settings = WithAnomaly.read(given)
    assert settings.detect_anomaly is True and settings.max_epochs == LoopSettings.read(plain()).max_epochs
    assert settings.resume_record()["detect_anomaly"] is True
    assert "detect_anomaly" not in WithAnomaly.read(plain("+trainer.detect_anomaly=false")).resume_record()
    assert "detect_anomaly" in WithAnomaly.resume_keys() and "detect_anomaly" not in LoopSettings.resume_keys()
    with pytest.raises(ValueError, match=r"^trainer\.detect_anomaly must be true or false, got 'yes'"):
        WithAnomaly.read(plain("+trainer.detect_anomaly=yes"))
    with pytest.raises(ValueError, match=r"detect_anomaly must be true or false, got 3"):
        WithAnomaly(
            optimizer={"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}, max_epochs=1, detect_anomaly=3
        )
    with pytest.raises(ValueError, match=r"trainer\.detect_anomaly=True is not a setting of ddcnn's training loop"):
        LoopSettings.read(given)
