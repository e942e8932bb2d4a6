"""No module of the package (autosp/, baselines/) uses another project module's private (`_name`) names: what is
shared is public, named for what it does, in the module that owns it. Checked on the syntax tree: a `from X import
_name` of a project module, and `m._name` where `m` was imported from the project (a module or a class). Private
names of other libraries (torch's `_resolve_process_group`, ...) are theirs to keep stable, not checked here; tests
may reach into the modules they test. The checker is tested to find a planted use of each form."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("autosp", "baselines")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _project(module: str) -> bool:
    return module.split(".")[0] in PROJECT


def private_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every use in `source` of a project module's private name, as `file:line: what`."""
    tree = ast.parse(source, filename)
    imported: set[str] = set()  # names bound to something imported from the project
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _project(node.module):
            for alias in node.names:
                if _private(alias.name):
                    uses.append(f"{filename}:{node.lineno}: from {node.module} import {alias.name}")
                imported.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names if _project(a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in imported:
                uses.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return uses


def test_no_module_uses_another_modules_private_names() -> None:
    uses = [use for package in PROJECT for path in sorted((ROOT / package).rglob("*.py"))
            for use in private_uses(path.read_text(), str(path.relative_to(ROOT)))]
    assert not uses, "private names used across modules (make them public where they are defined):\n" + "\n".join(uses)


def test_the_checker_finds_each_form() -> None:
    planted = ("from autosp.compiler.fx.node_kinds import _packet, is_view\n"
               "from autosp.compiler.sp import resize\n"
               "import autosp.experiments.simulate as sim\n"
               "from torch.utils._python_dispatch import _disable_current_modes\n"
               "resize._dim_groups(a, b); sim.extrapolate._PREDICTIONS.clear(); is_view(n); self._own = 1\n")
    assert private_uses(planted) == ["<source>:1: from autosp.compiler.fx.node_kinds import _packet",
                                     "<source>:5: resize._dim_groups",
                                     "<source>:5: sim.extrapolate._PREDICTIONS"]
