"""The run directory's record of settings: defaults the code must hold equal to the YAML's."""

from __future__ import annotations

from ddcnn.rundir import L2_GRID, _differences
from ddcnn.settings import RunSettings
from tests.conftest import compose_config


def test_the_l2_grid_is_the_yamls_and_a_record_without_it_matches_todays_configuration(tmp_path):
    cfg = compose_config([], tmp_path, tiny=False)
    assert list(cfg.coarse.linear.l2_grid) == list(cfg.methods.stacker.l2_grid) == list(L2_GRID)
    settings = RunSettings.from_config(cfg).identity().settings
    recorded = RunSettings.from_config(cfg).identity().settings
    del recorded["coarse"]["linear"]["l2_grid"], recorded["methods"]["stacker"]["l2_grid"]  # recorded before the keys
    assert _differences(recorded, settings) == {}
    settings["methods"]["stacker"]["l2_grid"] = [1.0]  # another grid is another configuration
    assert list(_differences(recorded, settings)) == ["methods.stacker.l2_grid"]
