"""The layering DESIGN.md draws, as import-linter contracts (pyproject.toml `[tool.importlinter]`): they hold for the
tree, and planted imports break them: the compiler importing the harness, and between the compiler's stages an
upward import (fx importing sp), a sideways one (tiling importing memory), a reach into another stage's module
(zero importing fx.nodes instead of autosp.compiler.fx) and a module added at the compiler's top level."""
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


def _planted(tmp_path: Path, plants: dict[str, str]) -> subprocess.CompletedProcess:
    """`lint-imports` over a copy of the tree with `plants` (path under autosp/compiler -> import line) added."""
    for package in ("autosp", "baselines"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for path, line in plants.items():
        (tmp_path / "autosp" / "compiler" / path).write_text(f"{line}  # noqa: F401\n")
    return _lint(tmp_path)


def test_an_upward_import_breaks_them(tmp_path: Path) -> None:
    result = _planted(tmp_path, {"planted.py": "from autosp.harness import config"})
    assert result.returncode != 0
    assert "autosp.compiler is not allowed to import autosp.harness" in result.stdout
    assert "autosp.compiler.planted -> autosp.harness" in result.stdout


def test_imports_across_the_compilers_stages_break_them(tmp_path: Path) -> None:
    result = _planted(tmp_path, {
        "fx/planted.py": "from autosp.compiler.sp import sequence_parallel_pass",  # upward: fx is below every stage
        "tiling/planted.py": "from autosp.compiler.memory import parse_policy",  # sideways: the stages are independent
        "zero/planted.py": "from autosp.compiler.fx.nodes import emit",  # past fx's __init__ into its module
    })
    assert result.returncode != 0
    out = " ".join(result.stdout.split())  # import-linter wraps long lines
    assert "autosp.compiler.fx is not allowed to import autosp.compiler.sp" in out
    assert "autosp.compiler.fx.planted -> autosp.compiler.sp" in out
    assert "autosp.compiler.tiling is not allowed to import autosp.compiler.memory" in out
    assert "Illegal imports of protected package autosp.compiler.fx.nodes" in out
    assert "autosp.compiler.zero.planted -> autosp.compiler.fx.nodes" in out
    assert "kept, 3 broken." in out  # the layers contract, fx's protected modules and no cycles (fx <-> sp)


def test_the_compilers_top_level_holds_the_driver_only(tmp_path: Path) -> None:
    result = _planted(tmp_path, {"helpers.py": "import autosp.compiler.fx"})
    out = " ".join(result.stdout.split())
    assert result.returncode != 0
    assert "The following modules are not listed as layers: - autosp.compiler.helpers" in out


def test_no_compiler_module_is_over_400_lines() -> None:
    """Small modules with one job (issue 42): a compiler module past 400 lines is split by what it does."""
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
             for path in (ROOT / "autosp" / "compiler").rglob("*.py")}
    assert sizes and not {path: n for path, n in sizes.items() if n > 400}
