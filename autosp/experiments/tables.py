"""Result tables from records: trainability per method (with ratios to the baselines) and throughput.

Tables read records only (JSONL written by `autosp search` / `autosp bench` / `autosp run`), never live
objects, so CPU runs, cluster runs and simulated runs all flow through the same code, told apart by their
`device` / `mode` columns. The paper's claims come from a copy of the reference data inside the package.
"""
from __future__ import annotations

import argparse
import io
from importlib import resources
from pathlib import Path

import pandas as pd

from autosp.harness.config import ConfigError

#: runs are comparable only within one (model, ranks, device, budget) setting, measured or simulated
TRAINABILITY_GROUP = ["model", "world_size", "device", "memory_budget", "mode"]
THROUGHPUT_GROUP = ["model", "world_size", "device", "seq_len"]
#: the baselines the paper compares AutoSP's trainability with (it names ZeRO-3 "ZeRO-3 (FSDP)": both are kept)
TRAINABILITY_REFERENCES = ("ulysses", "ds-autosp", "zero3", "fsdp")
ITER_TIME_MEDIAN = "iter_time_s.median"  # flattened name of the record's iter_time_s.median


def paper_claims() -> pd.DataFrame:
    """The paper's headline claims (`autosp/reference/paper_claims.csv`): claims, never measurements."""
    text = resources.files("autosp").joinpath("reference/paper_claims.csv").read_text()
    return pd.read_csv(io.StringIO(text))


def _latest(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One row per key: the most recent (a re-run search supersedes the old one)."""
    order = df.sort_values("timestamp", kind="stable") if "timestamp" in df else df
    return order.drop_duplicates(subset=keys, keep="last")


def _ratio_to(table: pd.DataFrame, group: list[str], value: str, reference: str) -> pd.Series:
    """value / value of `reference` method in the same group (NaN where the reference was not measured)."""
    ref = table.loc[table["method"] == reference, group + [value]].rename(columns={value: "_ref"})
    merged = table[group].merge(ref, on=group, how="left")
    return pd.Series(table[value].to_numpy() / merged["_ref"].to_numpy(), index=table.index)


def search_rows(records: pd.DataFrame) -> pd.DataFrame:
    """The result rows of searches (kind == "search"), without their probe records."""
    if "kind" not in records:
        return records.iloc[0:0]
    return records[records["kind"] == "search"]


def trainability_table(records: pd.DataFrame, references: tuple[str, ...] = TRAINABILITY_REFERENCES) -> pd.DataFrame:
    """Max trainable length per method and setting, achieved/limit, and ratios `vs_<ref>` to each baseline."""
    rows = search_rows(records)
    if rows.empty:
        raise ConfigError("no search results in the given records; run `autosp search ... --out FILE` first")
    group = [c for c in TRAINABILITY_GROUP if c in rows]
    table = _latest(rows, group + ["method"])
    table = table[group + ["method", "status", "max_seq_len", "first_oom_seq_len", "floor_limit_seq_len",
                           "achieved_over_limit", "num_probes"]].copy()
    table["memory_budget"] = table["memory_budget"].astype("float")  # NaN-safe for merging
    for ref in references:
        table[f"vs_{ref}"] = _ratio_to(table, group, "max_seq_len", ref)
    lengths = ["max_seq_len", "first_oom_seq_len", "floor_limit_seq_len", "num_probes"]
    table[lengths] = table[lengths].astype("Int64")  # lengths stay integers where some are missing
    return table.sort_values(group + ["max_seq_len"], ascending=[True] * len(group) + [False]).reset_index(drop=True)


def throughput_table(records: pd.DataFrame, reference: str | None = "ulysses") -> pd.DataFrame:
    """Iteration time and tokens/s per (setting, length, method) with spread over repeated runs.

    Each run contributes its median step time; the table gives the median, min and max of those over the
    repeats, and `speed_vs_<reference>` = reference time / this time (> 1: faster than the reference), the
    paper's "iteration speed"; `tokens_per_s_vs_<reference>` compares throughput.
    """
    runs = records
    if "kind" in runs:
        runs = runs[runs["kind"].isna() | (runs["kind"] != "search")]
    if "search_id" in runs:
        runs = runs[runs["search_id"].isna()]
    runs = runs[runs["status"] == "ok"]
    if runs.empty:
        raise ConfigError("no successful runs in the given records; run `autosp bench ... --out FILE` first")
    keys = THROUGHPUT_GROUP + ["method"]
    table = (
        runs.groupby(keys, dropna=False)
        .agg(
            repeats=(ITER_TIME_MEDIAN, "size"),
            iter_time_s=(ITER_TIME_MEDIAN, "median"),
            iter_time_min_s=(ITER_TIME_MEDIAN, "min"),
            iter_time_max_s=(ITER_TIME_MEDIAN, "max"),
            tokens_per_s=("tokens_per_s", "median"),
            peak_mem_bytes=("peak_mem_bytes", "max"),
        )
        .reset_index()
    )
    if reference is not None:
        table[f"speed_vs_{reference}"] = 1.0 / _ratio_to(table, THROUGHPUT_GROUP, "iter_time_s", reference)
        # differs from the iteration-speed ratio for data-parallel methods, which train dp_size sequences per step
        table[f"tokens_per_s_vs_{reference}"] = _ratio_to(table, THROUGHPUT_GROUP, "tokens_per_s", reference)
    return table.sort_values(keys).reset_index(drop=True)


def write_csv_atomic(table: pd.DataFrame, path: str | Path) -> None:
    """Write a table so a reader (or an interrupted workflow) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    table.to_csv(tmp, index=False)
    tmp.replace(path)


def format_table(table: pd.DataFrame) -> str:
    """The table as aligned text: budgets in binary units, ratios to 3 significant digits."""
    from autosp.harness.measure import format_size

    shown = table.copy()
    if "memory_budget" in shown:
        shown["memory_budget"] = [format_size(b) if pd.notna(b) else "device" for b in shown["memory_budget"]]
    with pd.option_context("display.width", 250, "display.max_columns", None, "display.float_format", "{:.3g}".format):
        return shown.to_string(index=False)


def _cmd_table(args: argparse.Namespace) -> int:
    from autosp.harness.records import load_records

    records = load_records(args.inputs)
    if args.kind == "trainability":
        table = trainability_table(records)
    else:
        table = throughput_table(records, reference=args.ratio_to or None)
    print(format_table(table))
    if args.out:
        write_csv_atomic(table, args.out)
    return 0


def add_table_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp table trainability|throughput --in FILES... [--out table.csv]`."""
    p = subparsers.add_parser("table", help="tables (trainability, throughput) from result records")
    p.add_argument("kind", choices=["trainability", "throughput"])
    p.add_argument("--in", dest="inputs", nargs="+", required=True, help="JSONL record files")
    p.add_argument("--out", help="write the table as CSV here")
    p.add_argument("--ratio-to", default="ulysses", help="throughput: reference method for the speed ratio")
    p.set_defaults(func=_cmd_table)
