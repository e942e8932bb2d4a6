"""Predicted vs measured, per length, from `autosp simulate` and `autosp run` records of the same configuration:
device peak (and their ratio), host bytes offloaded, and what the planner chose (the measured run's plans).
Usage: python3 tests/gpu/planner_compare.py simulated.jsonl measured.jsonl"""
from __future__ import annotations

import json
import sys


def _records(path: str) -> dict[int, dict]:
    with open(path) as f:
        return {r["seq_len"]: r for r in map(json.loads, f) if r.get("kind", "run") == "run"}


def main(simulated_path: str, measured_path: str) -> None:
    simulated, measured = _records(simulated_path), _records(measured_path)
    print("seq_len  status(sim/run)  sim_peak_GiB  run_peak_GiB  ratio  sim_host_GiB  run_host_GiB  plan")
    for seq_len in sorted(set(simulated) | set(measured)):
        sim, run = simulated.get(seq_len, {}), measured.get(seq_len, {})
        sim_peak, run_peak = sim.get("peak_mem_bytes"), run.get("peak_mem_bytes")
        ratio = f"{sim_peak / run_peak:.3f}" if sim_peak and run_peak else "-"
        sim_host = sim.get("extra", {}).get("breakdown", {}).get("host_offloaded_bytes")
        run_host = run.get("extra", {}).get("memory", {}).get("host_offloaded_bytes")
        plans = [{k: p[k] for k in ("tokenwise_recompute_layers", "attention_recompute_layers", "offloaded_bytes",
                                    "recompute_flops")} for p in run.get("extra", {}).get("sac_auto", [])]
        gib = lambda b: f"{b / 2**30:.2f}" if b is not None else "-"  # noqa: E731
        print(f"{seq_len:>7}  {sim.get('status', '-')}/{run.get('status', '-')}  {gib(sim_peak):>12}  "
              f"{gib(run_peak):>12}  {ratio:>5}  {gib(sim_host):>12}  {gib(run_host):>12}  {plans}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
