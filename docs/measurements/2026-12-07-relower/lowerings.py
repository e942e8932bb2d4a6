"""Count and time pipeline._lower calls in the 8 x h100 search's first two last-rung probes."""
import sys, time
import autosp.compiler.pipeline as pipeline
import json
from autosp.experiments.simulate.devices import get_device_model as get_device
from autosp.experiments.simulate.lengths import _last_rung, simulate
from autosp.experiments.simulate.programs import shared_rank_programs
from autosp.harness.config import RunConfig

orig = pipeline._lower
def logged(c, gm, example_inputs, dump, **kw):
    t0 = time.process_time()
    ok = "ok"
    try:
        return orig(c, gm, example_inputs, dump, **kw)
    except Exception as e:
        ok = type(e).__name__
        raise
    finally:
        print(f"  _lower halvings={getattr(c.graph_tiling, 'mlp_halvings', None)} kw={kw} -> {ok} "
              f"{time.process_time() - t0:.1f} CPU-s", flush=True)
pipeline._lower = logged

ws = int(sys.argv[1]) if len(sys.argv) > 1 else 8
lengths = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [681984, 4352000]
model = sys.argv[3] if len(sys.argv) > 3 else "llama-3.1-8b"
c = json.loads(open("/work/main/docs/measurements/2026-12-07-musts-quiet.jsonl").readline())["config"]
cfg = RunConfig.from_dict({**c, "world_size": ws, "model": model})
device = get_device("h100-80gb")
rung = _last_rung(cfg, device)
print(rung.sac, rung.offload, flush=True)
with shared_rank_programs():
    for n in lengths:
        t0 = time.process_time()
        r = simulate(rung.replace(seq_len=n), device)
        print(n, r["status"], r["peak_mem_bytes"], f"{time.process_time() - t0:.1f} CPU-s", flush=True)
