"""Step time of a tiny hybrid (`tests.compiler.hf_models`, default HF's Qwen3-Next: a gated delta-net layer and an
attention layer) under AutoSP at P=2 and P=4 against single-process training, on CPU
(docs/measurements/2026-12-04-hybrids.md, 2026-12-05-hybrids.md): per step, each rank's CPU-seconds and the wall time
of the slowest rank. `flock ~/.autosp-measure.lock python -m tests.compiler.hybrid_step_time <tokens> [family]`."""
from __future__ import annotations

import json
import sys
import time

import torch

import autosp
from autosp.harness.launch import launch
from tests.compiler.exactness import _batch
from tests.compiler.hf_models import build_hf

WARMUP, STEPS = 2, 5


def _timed_steps(sp: bool, seq_len: int, family: str) -> dict[str, float]:
    model = build_hf(family)
    run = autosp.compile(model, backend="aot_eager", sac="off", zero=0) if sp else model
    cpu, wall = [], []
    for step in range(WARMUP + STEPS):
        batch = _batch(model.config.vocab_size, 1, seq_len, step, 0.0)
        c, w = time.process_time(), time.perf_counter()
        run(**batch).loss.backward()
        if step >= WARMUP:
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - w)
        model.zero_grad()
    return {"cpu_s": sorted(cpu)[len(cpu) // 2], "wall_s": sorted(wall)[len(wall) // 2]}


def main(seq_len: int, family: str = "qwen3-next") -> None:
    torch.set_num_threads(1)
    rows = [{"P": 1, **_timed_steps(False, seq_len, family)}]
    for world in (2, 4):
        outcome = launch(_timed_steps, (True, seq_len, family), world_size=world, timeout_s=900)
        assert outcome.status == "ok", outcome.error
        ranks = outcome.results
        rows.append({"P": world, "cpu_s_per_rank": [round(r["cpu_s"], 3) for r in ranks],
                     "cpu_s_total": round(sum(r["cpu_s"] for r in ranks), 3),
                     "wall_s": round(max(r["wall_s"] for r in ranks), 3)})
    json.dump({"family": family, "seq_len": seq_len, "median_of": STEPS, "rows": rows}, sys.stdout, indent=1)


if __name__ == "__main__":
    from tests.compiler import hybrid_step_time  # the ranks import the step function by its module's name

    hybrid_step_time.main(int(sys.argv[1]), *sys.argv[2:3])
