"""`ruff check .` passes with the rules pyproject.toml selects (`[tool.ruff.lint]`; .ci/run runs it before the suite),
and those rules catch what they were chosen for: a planted file with an unused import, an undefined name, a line
over 120 columns, imports out of order, a loop variable caught by a closure and a zip() without strict= fails."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")

pytestmark = pytest.mark.skipif(not RUFF.exists(), reason="ruff is not installed (pip install -e .[test])")

PLANTED = '''from __future__ import annotations

import sys
import os


def f(xs, ys):
    fns = [lambda: x for x in xs]
    return [a + b for a, b in zip(xs, ys)], fns, undefined_name
''' + f"LONG = {'x' * 130!r}\n"


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), "check", "--no-cache", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_tree_passes() -> None:
    result = _ruff(".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_chosen_rules_catch_a_planted_file(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(PLANTED)
    result = _ruff("--config", str(ROOT / "pyproject.toml"), "--output-format", "concise", str(planted))
    assert result.returncode != 0
    found = {line.split(" ")[1] for line in result.stdout.splitlines() if line.startswith(str(planted))}
    assert {"F401", "F821", "E501", "I001", "B023", "B905"} <= found, result.stdout
