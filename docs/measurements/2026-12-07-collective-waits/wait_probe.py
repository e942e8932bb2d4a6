"""One-off diagnostic (not part of the package): where a real CPU step's wall time goes, per step and per rank.

Imported in every rank by `autosp run --import wait_probe`. For each `train_step` it writes to $PROBE_OUT/rank<r>.json
the step's wall seconds, the training thread's CPU seconds (`time.thread_time`), the wall and CPU seconds spent inside
torch.distributed's collectives and `Work.wait` (a nested call counts once), per collective name, and the same for
DeepSpeed ZeRO-3's coordinator calls (`fetch_sub_module` / `release_sub_module`, their gather waits included)."""
import json
import os
import time

import torch.distributed as dist

import autosp.harness.runner as runner

COLLECTIVES = ("all_gather_into_tensor", "all_reduce", "all_to_all_single", "reduce_scatter_tensor", "broadcast",
               "all_gather", "barrier")
_original_step = runner.train_step
_totals: dict[str, float] = {}
_by_name: dict[str, list] = {}
_depth = [0]
_records: list[dict] = []


def _add(key: str, name: str, wall: float, cpu: float) -> None:
    _totals[key + "_wall"] = _totals.get(key + "_wall", 0.0) + wall
    _totals[key + "_cpu"] = _totals.get(key + "_cpu", 0.0) + cpu
    _totals[key + "_n"] = _totals.get(key + "_n", 0) + 1
    entry = _by_name.setdefault(name, [0, 0.0])
    entry[0] += 1
    entry[1] += wall


def _timed(fn, key: str, name: str):
    def call(*args, **kwargs):
        if _depth[0] and key == "collective":
            return fn(*args, **kwargs)
        _depth[0] += key == "collective"
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _depth[0] -= key == "collective"
            _add(key, name, time.perf_counter() - wall, time.thread_time() - cpu)
    return call


for _name in COLLECTIVES:
    setattr(dist, _name, _timed(getattr(dist, _name), "collective", _name))
dist.Work.wait = _timed(dist.Work.wait, "collective", "wait")
try:
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as _Coordinator

    for _name in ("fetch_sub_module", "release_sub_module"):
        setattr(_Coordinator, _name, _timed(getattr(_Coordinator, _name), "coordinator", _name))
except ImportError:
    pass


def train_step(step, batch, number=0):
    _totals.clear()
    _by_name.clear()
    wall, cpu = time.perf_counter(), time.thread_time()
    loss = _original_step(step, batch, number)
    _records.append({"wall": time.perf_counter() - wall, "cpu": time.thread_time() - cpu, **_totals,
                     "by_name": {k: [n, round(s, 4)] for k, (n, s) in _by_name.items()}})
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(os.environ["PROBE_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(_records, f, indent=1)
    return loss


runner.train_step = train_step
