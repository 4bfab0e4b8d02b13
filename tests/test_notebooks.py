"""Every notebook in notebooks/ runs top to bottom on tiny settings, and none is committed with outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import assert_real_png

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
KERNEL = "ddcnn-test"


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    """Shared by the notebooks of one session: 03 explores the run 02 trained."""
    return tmp_path_factory.mktemp("notebook_runs")


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A kernel spec for this interpreter, found first on JUPYTER_PATH.

    The kernel then runs in the same environment as the tests (a fresh ``pip install -e ".[dev]"`` venv or CI),
    whatever kernels the user has installed elsewhere.
    """
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(root))
        yield mp


def test_there_are_notebooks():
    assert [p.name for p in PATHS] == [
        "01_decomposition_explorer.ipynb",
        "02_quickstart.ipynb",
        "03_results_explorer.ipynb",
    ]


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_is_committed_without_outputs(path):
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    for i, cell in enumerate(book.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {i} holds outputs"
    assert any("parameters" in c.metadata.get("tags", []) for c in book.cells), f"{path.name}: no parameter cell"


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs_top_to_bottom(path, runs_dir, kernel_env):
    kernel_env.setenv("DDCNN_NOTEBOOK_TINY", "1")
    kernel_env.setenv("DDCNN_NOTEBOOK_RUNS", str(runs_dir))
    kernel_env.setenv("MPLBACKEND", "Agg")
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(
        book, timeout=240, kernel_name=KERNEL, resources={"metadata": {"path": str(NOTEBOOKS)}}, allow_errors=False
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    shown = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert shown, f"{path.name} displayed no figure"
    for png in (runs_dir / "figures").glob("*.png"):
        assert_real_png(png)
