"""One-off diagnostic (not part of the package): a real CPU step's aten ops by self CPU time (torch.profiler).

Imported in every rank by `autosp run --import opclass_probe`: wraps `autosp.harness.runner.train_step`; of the
OPCLASS_TOTAL calls (warmup + 1 measured + steps) the last OPCLASS_MODED run under the profiler, the ones before it
are timed plainly. Writes $OPCLASS_OUT/rank<r>.json."""
import json
import os
import time

import torch
import torch.distributed as dist

import autosp.harness.runner as runner

_original = runner.train_step
_calls = {"n": 0}
_results = []


def train_step(step, batch, number=0):
    _calls["n"] += 1
    total, moded = int(os.environ["OPCLASS_TOTAL"]), int(os.environ.get("OPCLASS_MODED", "1"))
    if _calls["n"] <= total - moded:
        start = time.perf_counter()
        loss = _original(step, batch, number)
        _results.append({"profiled": False, "wall": time.perf_counter() - start})
        return loss
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        loss = _original(step, batch, number)
        wall = time.perf_counter() - start
    ops = {e.key: [e.count, e.self_cpu_time_total / 1e6] for e in prof.key_averages()}
    _results.append({"profiled": True, "wall": wall, "ops": ops})
    if _calls["n"] == total:
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(os.path.join(os.environ["OPCLASS_OUT"], f"rank{rank}.json"), "w") as f:
            json.dump(_results, f, indent=1)
    return loss


runner.train_step = train_step
