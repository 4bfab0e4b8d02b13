"""The global CNN of the CNN-DNN's parameter count (ddcnn/stages/global_wide.py): width found by bisection, within a
few percent of the local nets' and the coarse DNN's parameters, in 2D (2x2) and 3D (2x2x2), trained like the global
CNN."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from ddcnn.context import build_context
from ddcnn.pipeline import train
from ddcnn.rundir import RunDir
from ddcnn.settings import RunSettings
from ddcnn.stages.global_wide import TOLERANCE, cnn_dnn_parameters, matched_width, wide_settings
from tests.conftest import compose_config


def _settings(*overrides: str) -> RunSettings:
    return RunSettings.from_config(compose_config(list(overrides), run_dir="unused", tiny=False))


@pytest.mark.parametrize(
    ("overrides", "dims", "classes", "n"),
    [
        ((), 2, 10, 4),  # the default demo's vgg_small at 2x2
        (("decomposition=2x2x2", "data=adrenal3d_28"), 3, 2, 8),  # vgg_small on volumes at 2x2x2
        (("model=resnet_tiny", "decomposition=4x4"), 2, 5, 16),
    ],
)
def test_the_wide_global_cnn_has_the_cnn_dnns_parameter_count(overrides, dims, classes, n):
    settings = _settings(*overrides)
    data = SimpleNamespace(spatial_dims=dims, in_channels=1, num_classes=classes)
    target = cnn_dnn_parameters(settings, data, n)
    assert target["total"] == n * target["local"] + target["coarse"]
    match = matched_width(settings, data, target["total"])
    assert abs(match["params"] - target["total"]) <= TOLERANCE * target["total"]
    assert match["width_mult"] > match["base_width_mult"] and match["params"] > match["base_params"]


def test_a_network_without_a_width_factor_or_with_pretrained_weights_is_refused():
    settings = _settings()
    spec = {k: v for k, v in settings.model.items() if k != "width_mult"}
    with pytest.raises(ValueError, match="has no width_mult setting.*methods.enabled.global_wide=false"):
        wide_settings(dataclasses.replace(settings, model=spec), 2.0)
    weighted = {**settings.model, "weights": "/some/file.pt"}
    with pytest.raises(ValueError, match=r"model.weights='/some/file.pt' do not fit"):
        wide_settings(dataclasses.replace(settings, model=weighted), 2.0)


def test_it_trains_and_writes_its_row(tmp_path):
    overrides = ["decomposition.grid=[1,2]", "methods.enabled.global_wide=true", "methods.enabled.coarse_alt=false"]
    overrides += ["methods.enabled.stacker=false", "methods.enabled.coarse_val=false"]
    cfg = compose_config(overrides, tmp_path)
    results = train(cfg)
    run = RunDir(tmp_path)
    meta = run.meta("global_wide")
    match = meta["param_match"]
    cnn_dnn = json.loads((tmp_path / "results.json").read_text())["params"]["cnn_dnn"]
    assert match["target"] == cnn_dnn == run.meta("coarse")["params"] + 2 * run.meta("local", 0)["params"]
    assert meta["params"] == match["params"] and abs(meta["params"] - cnn_dnn) <= TOLERANCE * cnn_dnn
    assert meta["seed"] != run.meta("global")["seed"]
    rows = {row["key"]: row for row in results["methods"]}
    assert rows["global_wide"]["params"] == meta["params"] and rows["global_wide"]["devices"] == 1
    assert rows["global_wide"]["sequential_time_s"] == pytest.approx(meta["time_s"])
    assert "| global CNN, the CNN-DNN's parameter count |" in (tmp_path / "results.md").read_text()
    # the network it trained is the one the search chose
    ctx = build_context(cfg, tmp_path, claim=False)
    assert wide_settings(ctx.settings, match["width_mult"]).global_model["width_mult"] == match["width_mult"]


def test_runs_of_one_width_share_one_training_through_the_store(tmp_path):
    """2x2 at overlap 0 and 2 widen the global CNN by the same factor (the nets end in global pooling): with
    store.reuse the second run copies the first one's training; a grid of another N needs another width and trains
    its own."""
    store = tmp_path / "store"
    common = ["stage=global_wide", "methods.enabled.global_wide=true", "store.reuse=true", f"store.root={store}"]

    def widened(name: str, *overrides: str) -> dict:
        train(compose_config([*common, *overrides], tmp_path / name))
        return RunDir(tmp_path / name).meta("global_wide")

    first = widened("o0", "decomposition.grid=[1,2]", "decomposition.overlap=0")
    second = widened("o2", "decomposition.grid=[1,2]", "decomposition.overlap=2")
    assert "reused_from" not in first and second["reused_from"]["run_dir"] == str((tmp_path / "o0").resolve())
    assert second["param_match"] == first["param_match"] and second["time_s"] == first["time_s"]
    for split in ("val", "test"):
        a, b = (RunDir(tmp_path / n).load_probs("global_wide", split) for n in ("o0", "o2"))
        assert a["logits"].equal(b["logits"])
    other = widened("four", "decomposition.grid=[2,2]", "decomposition.overlap=0")
    assert "reused_from" not in other and other["param_match"]["width_mult"] != first["param_match"]["width_mult"]
