"""What ``pip install ddcnn`` must bring: every third-party module that ddcnn imports when its own modules are imported
is a declared dependency (``[project].dependencies``), and a broken install (tqdm missing) still runs the demo."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY_OVERRIDES

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

# Exceptions whose handler makes an import optional (``try: import x`` / ``except ImportError: ...``).
_GUARDS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _is_guard(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in _GUARDS for t in types)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def unguarded_imports(tree: ast.Module) -> set[str]:
    """Top-level names of the modules a module imports when it is imported: not inside a function (a lazy import), a
    ``try`` that catches ImportError (an optional one) or ``if TYPE_CHECKING`` (for annotations only); relative
    imports left out."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0 and node.module:
                    found.add(node.module.partition(".")[0])
            elif isinstance(node, ast.Try) and any(_is_guard(h) for h in node.handlers):
                visit(node.orelse + node.finalbody)  # what the try body imports is optional
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse)
            else:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    children = getattr(node, field, None) or []
                    for child in children:
                        visit(child.body if isinstance(child, ast.ExceptHandler | ast.match_case) else [child])

    visit(tree.body)
    return found


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_dependencies() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {_normalise(re.match(r"[A-Za-z0-9._-]+", spec).group()) for spec in project["dependencies"]}


def test_the_walker_tells_unguarded_imports_from_lazy_and_optional_ones():
    source = textwrap.dedent(
        """
        import os, numpy.linalg
        from torch import nn
        from . import sibling
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import pandas
        try:
            import tensorboard
        except ImportError:
            tensorboard = None
        try:
            import yaml
        finally:
            pass
        class A:
            import PIL
            def f(self):
                import mlflow
        def g():
            import timm
        """
    )
    assert unguarded_imports(ast.parse(source)) == {"os", "numpy", "torch", "typing", "yaml", "PIL"}


def test_every_unguarded_third_party_import_is_a_declared_dependency():
    provided = importlib.metadata.packages_distributions()  # import name -> distributions installed that provide it
    declared = declared_dependencies()
    undeclared = {}
    for path in sorted((REPO / "ddcnn").rglob("*.py")):
        for name in unguarded_imports(ast.parse(path.read_text(), str(path))):
            if name == "ddcnn" or name in sys.stdlib_module_names:
                continue
            distributions = {_normalise(d) for d in provided.get(name, [])}
            if not distributions & declared:
                where = path.relative_to(REPO).as_posix()
                undeclared.setdefault(name, (sorted(distributions) or ["not installed"], []))[1].append(where)
    assert not undeclared, "imported when ddcnn is imported but not in [project].dependencies: " + "; ".join(
        f"{name} ({', '.join(dists)}) in {', '.join(files)}" for name, (dists, files) in sorted(undeclared.items())
    )


def test_the_demo_runs_with_tqdm_blocked_and_bars_forced_on(tmp_path):
    """tqdm is declared, so a missing tqdm is a broken install; it costs the bars (lines instead, and one warning
    that names it), not the run. Blocked in every process of the run (a sitecustomize on PYTHONPATH)."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules.update({'tqdm': None, 'tqdm.auto': None})\n")
    overrides = [o for o in TINY_OVERRIDES if "enable_progress_bar" not in o] + ["trainer.enable_progress_bar=true"]
    exe = Path(sys.executable).parent / "ddcnn-train"
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    proc = subprocess.run(
        [str(exe), *overrides, f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "| CNN-DNN (coarse DNN on probs) |" in proc.stdout
    assert "tqdm, a dependency of ddcnn, cannot be imported" in out
    assert "global: epoch 1/1" in out  # the epochs as lines, where the bar would have been
