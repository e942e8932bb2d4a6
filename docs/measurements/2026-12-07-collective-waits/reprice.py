"""One-off (not part of the package): the CPU check's 12 cells priced on several cpu rows against measured records.

Simulates each cell once (as `autosp time-check` does: llama3-mini, hf:llama3-mini for alst, 2 ranks, 16 GiB,
aot_eager), keeps the trace the record was priced from, and prices it on each row given:

    python reprice.py NAME=RATES_CSV[:column=value,...] ... -- MEASURED.jsonl ...

prints, per row and measured file, the cells within ±15%, the sum of absolute errors and each cell's error."""
import collections
import csv
import io
import json
import statistics
import sys

import autosp.experiments.simulate.clock as clock
import autosp.timing.rates as rates_module
from autosp.experiments.simulate import simulate
from autosp.experiments.simulate.devices import get_device_model
from autosp.harness.config import RunConfig
from autosp.harness.measure import parse_size
from autosp.harness.method_spec import parse_method_spec

CELLS = [(m, s) for m in ("autosp", "ulysses[ac=layer]", "zero3", "alst") for s in (1024, 2048, 4096)]


def traces() -> dict:
    """Each cell's priced trace (the last one `OpTrace.time` or `LinedTrace.time` was asked to price)."""
    seen = {}
    for cls in (clock.OpTrace, clock.LinedTrace):
        def priced(self, rates, gpus_per_node, original=cls.time):
            seen["last"] = self
            return original(self, rates, gpus_per_node)
        cls.time = priced
    out = {}
    for label, seq in CELLS:
        spec = parse_method_spec(label)
        model = "hf:llama3-mini" if spec.method == "alst" else "llama3-mini"
        cfg = spec.config(RunConfig(method=spec.method, model=model, seq_len=seq, world_size=2, device="cpu",
                                    memory_budget=parse_size("16GiB"), steps=3, compile_backend="aot_eager"))
        simulate(cfg, get_device_model("cpu", cfg.memory_budget))
        out[(label, seq)] = seen["last"]
    return out


def measured(path: str) -> dict:
    runs = collections.defaultdict(list)
    for line in open(path):
        record = json.loads(line)
        label = record["method"] + ("[ac=layer]" if record["config"].get("ac") == "layer" else "")
        runs[(label, record["seq_len"])].append(record["iter_time_s"]["median"])
    return {cell: statistics.median(v) for cell, v in runs.items()}


def row_rates(spec: str):
    path, _, changes = spec.partition(":")
    row = {r["device"]: r for r in csv.DictReader(io.StringIO(open(path).read()))}["cpu"]
    row.update(kv.split("=") for kv in changes.split(",") if kv)
    original = rates_module.rates_catalogue
    rates_module.rates_catalogue = lambda: {"cpu": row}
    try:
        return rates_module.device_rates("cpu")
    finally:
        rates_module.rates_catalogue = original


if __name__ == "__main__":
    split = sys.argv.index("--")
    rows = [arg.split("=", 1) for arg in sys.argv[1:split]]
    measured_files = sys.argv[split + 1:]
    cells = traces()
    for name, spec in rows:
        rates = row_rates(spec)
        for path in measured_files:
            steps = measured(path)
            errors = [cells[c].time(rates, 2).iteration_s / steps[c] - 1 for c in CELLS]
            print(f"{name:12s} {path.rsplit('/', 1)[-1]:42s} within {sum(abs(e) <= 0.15 for e in errors):2d}/12 "
                  f"sum|e| {100 * sum(map(abs, errors)):4.0f}  " + " ".join(f"{100 * e:+.0f}" for e in errors))
