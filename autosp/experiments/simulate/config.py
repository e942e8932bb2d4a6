"""What a simulation executes: the configuration run on fake tensors (compiled methods through aot_eager), the
phases and components of a peak, and the error for what cannot be simulated."""
from __future__ import annotations

from autosp.harness.config import ConfigError, RunConfig

#: models up to this depth are simulated whole; deeper ones at 2 and 3 layers, extrapolated
EXACT_LAYERS = 4
#: methods whose engines cannot run on fake tensors, with the reason (checked before anything is built)
UNSUPPORTED: dict[str, str] = {}
#: compiled methods run their real graphs through this backend on fake tensors
SIMULATED_BACKEND = "aot_eager"
#: what a method's own `torch._inductor.compile` call (DeepSpeed's AutoSP) runs on fake tensors
DIRECT_INDUCTOR_BACKEND = "aot_eager_decomp_partition"
#: the phase of the ops between the backward pass and the optimizer step (outside autograd's engine)
AFTER_BACKWARD = "after backward"
COMPONENTS = ("model_state_bytes", "gradient_bytes", "saved_activation_bytes", "transient_bytes")


class SimulationError(ConfigError):
    """A configuration the simulator cannot run (one line: what and why)."""


def simulate_config(cfg: RunConfig) -> RunConfig:
    """The configuration actually executed: compiled methods through aot_eager (see the module docstring)."""
    if cfg.method in UNSUPPORTED:
        raise SimulationError(f"--method {cfg.method} cannot be simulated: {UNSUPPORTED[cfg.method]}")
    return cfg.replace(device="cpu", compile_backend=SIMULATED_BACKEND, memory_budget=None)
