"""Each `pipeline._lower` call of an 8B search's rung probes, timed (CPU-s) with what it raised: a one-off diagnostic.

python lowerings.py [world_size] [lengths,comma-separated] [model]   (from the repository's root, PYTHONPATH set)
"""
import json
import sys
import time

import autosp.compiler.pipeline as pipeline
from autosp.experiments.simulate.devices import get_device_model
from autosp.experiments.simulate.lengths import _last_rung, simulate
from autosp.experiments.simulate.programs import shared_rank_programs
from autosp.harness.config import RunConfig

lower = pipeline._lower


def logged(c, gm, example_inputs, dump, **kw):
    start, outcome = time.process_time(), "ok"
    try:
        return lower(c, gm, example_inputs, dump, **kw)
    except Exception as e:
        outcome = type(e).__name__
        raise
    finally:
        print(f"  _lower halvings={getattr(c.graph_tiling, 'mlp_halvings', None)} kw={kw} -> {outcome} "
              f"{time.process_time() - start:.1f} CPU-s", flush=True)


pipeline._lower = logged
ws = int(sys.argv[1]) if len(sys.argv) > 1 else 8
lengths = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [681984, 4352000]
model = sys.argv[3] if len(sys.argv) > 3 else "llama-3.1-8b"
# the configuration of the must-show searches (bf16, no memory flags), from their records
with open("docs/measurements/2026-12-07-musts-quiet.jsonl") as f:
    config = json.loads(f.readline())["config"]
cfg = RunConfig.from_dict({**config, "world_size": ws, "model": model})
device = get_device_model("h100-80gb")
rung = _last_rung(cfg, device)
print(rung.sac, rung.offload, flush=True)
with shared_rank_programs():
    for n in lengths:
        start = time.process_time()
        r = simulate(rung.replace(seq_len=n), device)
        print(n, r["status"], r["peak_mem_bytes"], f"{time.process_time() - start:.1f} CPU-s", flush=True)
