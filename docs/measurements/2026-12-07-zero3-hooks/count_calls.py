"""One simulated step of a time-check cell on the cpu rates: DeepSpeed ZeRO-3's coordinator calls (fetch and release,
counted apart) and the predicted seconds per op class. A one-off diagnostic, not part of the package.

    python count_calls.py alst,zero3 1024,2048,4096
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


def counted(name: str, calls: collections.Counter):
    method = getattr(Coordinator, name)

    def call(self, *args, **kwargs):
        calls[name] += 1
        return method(self, *args, **kwargs)
    return call


for method in sys.argv[1].split(","):
    for seq_len in map(int, sys.argv[2].split(",")):
        [(_, cfg)] = cell_configs("llama3-mini", [method], [seq_len], world_size=2, memory_budget=1 << 34, steps=3)
        calls = collections.Counter()  # every step the simulator runs (a warm-up and the measured one)
        with mock.patch.object(Coordinator, "fetch_sub_module", counted("fetch_sub_module", calls)), \
                mock.patch.object(Coordinator, "release_sub_module", counted("release_sub_module", calls)):
            time = simulate(cfg, get_device_model("cpu", cfg.memory_budget))["extra"]["time"]
        by_class = {k: round(v, 3) for k, v in time["seconds_by_class"].items()}
        print(method, seq_len, dict(calls), round(time["iteration_s"], 3), by_class, flush=True)
