"""`autosp simulate` and `autosp simulate --check` (the simulation beside measured runs: `validation_table`)."""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from autosp.experiments.simulate.devices import DeviceModel, get_device_model
from autosp.experiments.simulate.lengths import simulate, simulated_search, summary_line
from autosp.experiments.simulate.programs import deeper_programs_elsewhere, shared_rank_programs
from autosp.harness.config import ConfigError, RunConfig

if TYPE_CHECKING:
    import pandas as pd

def _cmd_simulate(args: argparse.Namespace) -> int:
    from autosp.harness.flags import run_config_from_args

    if (args.seq_len is None) == (not args.search):
        raise ConfigError("give exactly one of --seq-len S or --search")
    if args.jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {args.jobs}")
    devices = [get_device_model(name, None) for name in args.sim_device.split(",")] if args.memory_budget is None \
        else [get_device_model(name, _budget(args)) for name in args.sim_device.split(",")]
    args.device = "cpu"  # the simulation runs on this CPU; --device named the simulated device type
    cfg = run_config_from_args(args, seq_len=args.seq_len or 1)
    curve: dict[int, int] = {}  # one configuration's peaks, shared by the searches for every device type
    with shared_rank_programs():
        return _simulate_devices(args, cfg, devices, curve)


def _simulate_devices(args: argparse.Namespace, cfg: RunConfig, devices: list[DeviceModel],
                      curve: dict[int, int]) -> int:
    from autosp.harness.records import append_record

    status = 0
    for device in devices:
        max_len = args.max_len or default_max_len(cfg.world_size)
        if args.search:
            record = simulated_search(cfg, device, granularity=args.granularity, max_len=max_len, curve=curve,
                                      jobs=args.jobs)
        else:
            with deeper_programs_elsewhere(args.jobs):  # an extrapolated pair's deeper program in a second process
                record = simulate(cfg, device)
        append_record(args.out, record)
        print(summary_line(record) + f" -> {args.out}", flush=True)
        if record.get("status") == "no_oom_up_to_max_len":
            print(f"no oom up to --max-len {max_len}: the longest length lies above it; give a larger --max-len",
                  flush=True)
        status = max(status, 1 if record["status"] == "error" else 0)
    return status


#: what identifies one cell of the validation: the same run, measured and simulated
VALIDATION_KEY = ["method", "model", "world_size", "seq_len", "dtype", "batch_size"]


def validation_table(records: pd.DataFrame) -> pd.DataFrame:
    """Simulated vs measured per-rank peak for every configuration with both (CPU meter vs `cpu` device)."""
    import pandas as pd

    runs = records[records["kind"].isna()] if "kind" in records else records
    runs = runs[(runs["device"] == "cpu") & (runs["status"] == "ok")]
    measured = runs[runs["mode"] == "measured"].drop_duplicates(VALIDATION_KEY, keep="last")
    simulated = runs[runs["mode"] == "simulated"].drop_duplicates(VALIDATION_KEY, keep="last")
    table = measured[VALIDATION_KEY + ["peak_mem_bytes"]].merge(
        simulated[VALIDATION_KEY + ["peak_mem_bytes", "extra.breakdown.peak_op"]], on=VALIDATION_KEY,
        suffixes=("_measured", "_simulated"))
    table["error"] = (table["peak_mem_bytes_simulated"] - table["peak_mem_bytes_measured"]) \
        / table["peak_mem_bytes_measured"]
    table["within_10pct"] = table["error"].abs() <= 0.10
    return pd.DataFrame(table).sort_values(["model", "world_size", "method", "seq_len"]).reset_index(drop=True)


def _cmd_simulate_check(args: argparse.Namespace) -> int:
    from autosp.experiments.tables import format_table
    from autosp.harness.records import load_records

    table = validation_table(load_records(args.inputs))
    if table.empty:
        raise ConfigError("no configuration was both measured (autosp run) and simulated (--device cpu) in --in")
    print(format_table(table))
    print(f"{int(table['within_10pct'].sum())}/{len(table)} cells within 10%, max |error| "
          f"{table['error'].abs().max():.2%}")
    return 0 if table["within_10pct"].all() else 1


def default_max_len(world_size: int) -> int:
    """`--max-len`'s default: 2M tokens per rank, at least 4M: above what the planner trains on the catalogue's
    devices at 8B (a fixed 4M stopped the 8 x h100-80gb search: docs/measurements/2026-12-06-search-wall.md)."""
    return max(1 << 22, world_size << 21)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _budget(args: argparse.Namespace) -> int:
    from autosp.harness.measure import parse_size

    return parse_size(args.memory_budget)


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp simulate --method M --model X --device a100-80gb --world-size P (--seq-len S | --search)`."""
    from autosp.harness.flags import add_run_config_arguments

    p = subparsers.add_parser(
        "simulate", help="predict one rank's peak memory (or max trainable length) on a GPU type, on fake tensors",
        epilog="exit code: 0 predicted (ok or oom), 1 the method cannot be simulated, 2 bad input")
    add_run_config_arguments(p, varied=("seq_len",))
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence to predict the peak for")
    p.add_argument("--search", action="store_true", help="longest trainable length (autosp search's logic)")
    p.add_argument("--granularity", type=int, default=None, help="search length step (default 2*P*128)")
    p.add_argument("--max-len", type=int, default=None,
                   help="longest length the search tries (default: 2M tokens per rank, at least 4M)")
    p.add_argument("--jobs", type=int, default=_cores(),
                   help="processes simulating at once, from 2: an extrapolated pair's two depths, and a search's "
                        "whole-depth planner probes at the answer and one granule above (default: the cores "
                        "available; 1: one process)")
    p.add_argument("--out", default="results/simulated.jsonl", help="JSONL file the records are appended to")
    p.set_defaults(func=_cmd_simulate)
    # --device names the simulated device type here (a catalogue entry, comma-separated for several)
    for action in p._actions:
        if action.dest == "device":
            action.dest, action.default = "sim_device", "a100-80gb"
            action.help = ("device type(s) to simulate, comma-separated: " + ", ".join(_catalogue_names()))


    p = subparsers.add_parser("simulate-check", help="simulated vs measured CPU peaks of the same runs (validation)",
                              epilog="exit code: 0 every cell within 10%%, 1 not, 2 no pairs")
    p.add_argument("--in", dest="inputs", nargs="+", required=True, help="JSONL files with both kinds of records")
    p.set_defaults(func=_cmd_simulate_check)


def _catalogue_names() -> list[str]:
    from autosp.experiments.simulate.devices import device_catalogue

    return list(device_catalogue())
