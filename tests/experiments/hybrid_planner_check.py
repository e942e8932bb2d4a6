"""The memory planner on a hybrid (issue 45) against the simulator: Qwen3.5 tiny at P=2 on a 48 MiB `cpu` device, rank
0: what the planner chose and estimated (saved bytes, peak beyond the graph inputs) beside what the simulated step
keeps and peaks at. `python -m tests.experiments.hybrid_planner_check <tokens>...`
(docs/measurements/2026-12-05-hybrids.md)."""
import sys

from autosp.experiments import simulate as sim
from autosp.experiments.simulate.devices import get_device_model
from autosp.harness.config import RunConfig

if __name__ == "__main__":
    device = get_device_model("cpu", 48 * 2**20)
    for tokens in map(int, sys.argv[1:]):
        cfg = RunConfig(method="autosp", model="hf-qwen3.5:tiny", world_size=2, seq_len=tokens,
                        memory_budget=48 * 2**20)
        peak, _ = sim.extrapolate.predict_peak(cfg, device)
        for plan in peak.plans:
            print(tokens, {k: plan[k] for k in ("saved_activation_bytes", "estimated_peak_bytes", "offloaded_bytes",
                                                 "tokenwise_recompute_layers", "attention_recompute_layers")},
                  "simulated: saved", peak.saved_activation_bytes, "peak", peak.peak_bytes)
