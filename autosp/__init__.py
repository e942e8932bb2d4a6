"""AutoSP: automatic sequence parallelism for long-context training, done by the PyTorch 2 compiler."""
from autosp.api import SequenceParallelModule, backend, compile
from autosp.compiler.options import COMPILE_BACKENDS, CompileOptions
from autosp.errors import AutoSPError, ConfigError, SequenceParallelError

__all__ = ["COMPILE_BACKENDS", "AutoSPError", "CompileOptions", "ConfigError", "SequenceParallelError",
           "SequenceParallelModule", "backend", "compile"]
__version__ = "0.1.0"
