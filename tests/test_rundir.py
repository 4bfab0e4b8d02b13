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


def test_the_docs_name_the_local_folders_as_the_run_directory_makes_them(tmp_path):
    """Issue #45: README said ``local/<i>/`` where the folders are ``local/00``; a reader looked for ``local/3``."""
    from pathlib import Path

    from ddcnn.rundir import RunDir

    assert RunDir(tmp_path).stage_dir("local", 3).name == "03"
    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "README.md").read_text()
    assert "RUN_DIR/local/00/" in readme
    for doc in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        text = doc.read_text()
        for wrong in ("local/<i>/", "local/i/", "global_ensemble/<i>/"):
            assert wrong not in text, f"{doc.name} names the folder {wrong}; the run directory makes local/00/, ..."
