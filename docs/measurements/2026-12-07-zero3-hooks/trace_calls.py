"""Whether DeepSpeed ZeRO-3's coordinator records or invalidates its trace in the simulated steps of time-check cells
at 2K: calls of `record_module`, `reset_step` and `_invalidate_trace` (over the simulator's warm-up and measured
steps). A one-off diagnostic, not part of the package.

    python trace_calls.py alst,zero3
"""
import collections
import sys
from unittest import mock

from autosp.experiments.simulate import simulate
from autosp.experiments.simulate.devices import get_device_model
from autosp.experiments.time_check import cell_configs
from baselines.deepspeed_env import import_deepspeed

import_deepspeed("zero3")
from deepspeed.runtime.zero.partitioned_param_coordinator import (  # noqa: E402
    PartitionedParameterCoordinator as Coordinator,
)

calls = collections.Counter()


def counted(name: str):
    method = getattr(Coordinator, name)

    def call(self, *args, **kwargs):
        calls[name] += 1
        return method(self, *args, **kwargs)
    return mock.patch.object(Coordinator, name, call)


for method in sys.argv[1].split(","):
    calls.clear()
    [(_, cfg)] = cell_configs("llama3-mini", [method], [2048], world_size=2, memory_budget=1 << 34, steps=3)
    with counted("_invalidate_trace"), counted("record_module"), counted("reset_step"):
        simulate(cfg, get_device_model("cpu", cfg.memory_budget))
    print(method, dict(calls), flush=True)
