"""AutoSP: automatic sequence parallelism for long-context training, done by the PyTorch 2 compiler.

The public names load on first use (PEP 562): importing a submodule (the harness, the CLI, a rank of an eager
baseline) does not pay for Dynamo and inductor, which `autosp.api` imports."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from autosp.errors import AutoSPError, ConfigError, SequenceParallelError

if TYPE_CHECKING:
    from autosp.api import SequenceParallelModule, backend, compile
    from autosp.compiler.options import COMPILE_BACKENDS, CompileOptions

__all__ = ["COMPILE_BACKENDS", "AutoSPError", "CompileOptions", "ConfigError", "SequenceParallelError",
           "SequenceParallelModule", "backend", "compile"]
__version__ = "0.1.0"

_LAZY = {"SequenceParallelModule": "autosp.api", "backend": "autosp.api", "compile": "autosp.api",
         "COMPILE_BACKENDS": "autosp.compiler.options", "CompileOptions": "autosp.compiler.options"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autosp' has no attribute {name!r}")
