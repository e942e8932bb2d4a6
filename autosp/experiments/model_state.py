"""`autosp model-state`: does the model state each rank keeps shrink as its ZeRO stage predicts?

Reads run records (CPU profiler replay, deterministic) and puts, per (method, world size, stage), the bytes live
at the start of the measured step (after warm-up: parameters, AdamW moments, no gradients — they were zeroed to
None — plus the batch and small buffers) beside the floor's prediction of the stored parameters and moments
(`autosp.experiments.floor`, which owns the per-stage arithmetic), and the ratio measured / predicted.
"""
from __future__ import annotations

import argparse

import pandas as pd

from autosp.experiments.floor import floor_for
from autosp.harness.records import load_records

MIB = 1 << 20


def model_state_table(records: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, model, world size, seq len, stage) of the ok records: measured resident bytes at step
    start and peak, the predicted resident model state, their ratio, and the measured shrink vs stage 0."""
    ok = records[records["status"] == "ok"].copy()
    ok["resident"] = ok["extra.memory.resident_at_step_start_bytes"]
    ok["zero"] = ok["zero"].fillna(0).astype(int)
    rows = []
    for (method, model, world, seq_len, zero, dtype), group in ok.groupby(
            ["method", "model", "world_size", "seq_len", "zero", "dtype"], sort=True):
        last = group.iloc[-1]
        floor = floor_for(method, model, world_size=int(world), dtype=dtype, zero=int(zero))
        predicted = floor.params_bytes + floor.optimizer_bytes
        rows.append({"method": method, "model": model, "P": int(world), "seq_len": int(seq_len), "zero": int(zero),
                     "precision": floor.precision, "resident_mib": last["resident"] / MIB,
                     "predicted_state_mib": predicted / MIB,
                     "ratio": last["resident"] / predicted, "peak_mib": last["peak_mem_bytes"] / MIB})
    table = pd.DataFrame(rows)
    if not table.empty:
        keys = ["method", "model", "P", "seq_len", "precision"]
        stage0 = table[table["zero"] == 0].set_index(keys)["resident_mib"]
        table["vs_stage0"] = [r.resident_mib / stage0.get(tuple(r[k] for k in keys), float("nan"))
                              for _, r in table.iterrows()]
    return table


def _cmd_model_state(args: argparse.Namespace) -> int:
    table = model_state_table(load_records(args.results))
    print("resident bytes at the start of the measured step (parameters + AdamW moments + batch) vs the "
          "predicted parameters + moments of the stage; CPU profiler replay")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return 0


def add_model_state_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp model-state --results results/zero.jsonl`."""
    p = subparsers.add_parser("model-state", help="measured resident model state per ZeRO stage vs prediction")
    p.add_argument("--results", required=True, help="records (JSON lines) of `autosp run --zero Z` runs")
    p.set_defaults(func=_cmd_model_state)
