"""What a process imports before it does any work: every rank, CLI call and workflow job pays it, so the harness and
the method registry load only what the run uses (`autosp/__init__` and `baselines/__init__` import lazily)."""
from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import autosp
from autosp.harness.runner import rank_main
from autosp.harness.strategy import get_strategy
get_strategy("single")
heavy = ["torch._inductor", "torch._dynamo", "torch.distributed.fsdp", "deepspeed", "transformers", "pandas",
         "baselines.alst", "baselines.fsdp"]
print(",".join(m for m in heavy if m in sys.modules))
assert autosp.compile.__module__ == "autosp.api" and autosp.CompileOptions.__name__ == "CompileOptions"
"""


def test_a_rank_of_an_eager_method_loads_no_compiler_and_no_other_method() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported before any work: {out.stdout.strip()}"


def test_every_builtin_method_is_listed_and_unknown_names_list_them() -> None:
    import pytest

    from autosp.errors import ConfigError
    from autosp.harness.strategy import BUILTIN_MODULES, get_strategy, method_names

    assert set(BUILTIN_MODULES) <= set(method_names())
    with pytest.raises(ConfigError, match="unknown method 'nope'; valid methods: ") as error:
        get_strategy("nope")
    assert set(BUILTIN_MODULES) <= set(str(error.value).split(": ", 1)[1].split(", "))
