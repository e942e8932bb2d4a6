"""constraints.txt pins every package the project declares (what CI and the quick start install), and
`bin/autosp-pins` tells an environment that drifted from it."""
from __future__ import annotations

import re
import runpy
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
pins = runpy.run_path(str(ROOT / "bin" / "autosp-pins"))


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {pins["_canonical"](re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in requirements}


def test_every_declared_dependency_is_pinned_and_torch_is_the_cpu_release():
    pinned = pins["pinned"]()
    assert _declared() - set(pinned) == set(), "add the missing pins with `bin/autosp-env bin/autosp-pins freeze`"
    assert pinned["torch"] == "2.13.0"


def test_differences_name_each_package_that_moved_and_ignore_local_build_labels():
    want = {"torch": "2.13.0", "transformers": "5.24.0", "gone": "1.0"}
    have = {"torch": "2.13.0+cpu", "transformers": "5.25.0", "new": "2.0"}
    assert pins["differences"](have, want) == [
        ("gone", "1.0", "-"), ("new", "-", "2.0"), ("transformers", "5.24.0", "5.25.0")]

