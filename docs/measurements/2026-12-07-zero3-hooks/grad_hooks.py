"""DeepSpeed ZeRO-3's gradient hooks in the simulated steps of time-check cells: calls of
`reduce_ready_partitions_and_remove_grads` and `count_used_parameters_in_backward` (counts over the simulator's
warm-up and measured steps, so twice a step's). A one-off diagnostic, not part of the package.

    python grad_hooks.py alst,zero3 2048
"""
import collections
import sys
from unittest import mock

from autosp.experiments.simulate import simulate
from autosp.experiments.simulate.devices import get_device_model
from autosp.experiments.time_check import cell_configs
from baselines.deepspeed_env import import_deepspeed

import_deepspeed("zero3")
import deepspeed.runtime.zero.stage3 as stage3  # noqa: E402

calls = collections.Counter()


def counted(owner, name: str):
    method = getattr(owner, name)

    def call(*args, **kwargs):
        calls[name] += 1
        return method(*args, **kwargs)
    return mock.patch.object(owner, name, call)


for method in sys.argv[1].split(","):
    for seq_len in map(int, sys.argv[2].split(",")):
        calls.clear()
        [(_, cfg)] = cell_configs("llama3-mini", [method], [seq_len], world_size=2, memory_budget=1 << 34, steps=3)
        with counted(stage3, "count_used_parameters_in_backward"), \
                counted(stage3.DeepSpeedZeroOptimizer_Stage3, "reduce_ready_partitions_and_remove_grads"):
            simulate(cfg, get_device_model("cpu", cfg.memory_budget))
        print(method, seq_len, dict(calls), flush=True)
