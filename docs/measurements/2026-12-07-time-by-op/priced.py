"""One-off (not part of the package): the simulated step's priced seconds per aten op name on the cpu rates."""
import json
import sys
from collections import defaultdict

import autosp.experiments.simulate.clock as clock
from autosp.experiments.simulate import simulate
from autosp.experiments.simulate.devices import get_device_model
from autosp.harness.config import RunConfig
from autosp.harness.measure import parse_size
from autosp.harness.method_spec import parse_method_spec
from autosp.timing.rates import device_rates

RATES = device_rates("cpu")
per_trace = defaultdict(lambda: defaultdict(lambda: [0, 0.0, ""]))
original = clock.StepClock.op


def op(self, func, args, kwargs, out, serial, host):
    before = len(self.trace.events)
    original(self, func, args, kwargs, out, serial, host)
    name = clock._name(clock.unwrap_rng(func, args)[0])
    for event in self.trace.events[before:]:  # each event priced alone, as `OpTrace.time` prices it in line
        entry = per_trace[id(self.trace)][name]
        entry[0] += 1
        entry[1] += clock.OpTrace(events=[event]).time(RATES, gpus_per_node=2).iteration_s
        entry[2] = event[0]


clock.StepClock.op = op
given = dict(arg.split("=", 1) for arg in sys.argv[1:])  # method=autosp model=llama3-mini seq=4096 out=priced.json
label, model, seq, out = given["method"], given["model"], int(given["seq"]), given["out"]
spec = parse_method_spec(label)
cfg = spec.config(RunConfig(method=spec.method, model=model, seq_len=seq, world_size=2, device="cpu",
                            memory_budget=parse_size("16GiB"), steps=3, compile_backend="aot_eager"))
record = simulate(cfg, get_device_model("cpu", cfg.memory_budget))
time = record["extra"]["time"]
traces = {k: {n: v for n, v in d.items()} for k, d in per_trace.items()}
totals = {k: sum(v[1] for v in d.values()) for k, d in traces.items()}
print(json.dumps(time), totals)
json.dump({"time": time, "traces": list(traces.values()), "totals": list(totals.values())}, open(out, "w"))
