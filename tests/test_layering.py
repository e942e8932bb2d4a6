"""The layering DESIGN.md draws, as import-linter contracts (pyproject.toml `[tool.importlinter]`): they hold for the
tree, and a planted upward import (the compiler importing the harness) breaks them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e .[test])")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_contracts_hold() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_them(tmp_path: Path) -> None:
    for package in ("autosp", "baselines"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "autosp" / "compiler" / "planted.py").write_text("from autosp.harness import config  # noqa: F401\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "autosp.compiler is not allowed to import autosp.harness" in result.stdout
    assert "autosp.compiler.planted -> autosp.harness" in result.stdout
