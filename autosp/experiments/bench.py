"""Throughput at fixed lengths: iteration time and tokens/s per method, with spread over repeated runs.

Each repeat is an independent run (fresh rank processes), so the spread covers launch-to-launch variation,
not only step-to-step noise within one run. Repeats are interleaved (every method at every length, then
again) so a slow drift of the machine (other jobs, thermal state) spreads over all methods instead of
biasing whichever ran last. Ratios are only taken against a reference measured in the same invocation.
"""
from __future__ import annotations

import argparse
import itertools
import uuid
from collections.abc import Callable

import pandas as pd

from autosp.experiments.progress import progress
from autosp.experiments.tables import throughput_table
from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.supervisor import INTERRUPTED_EXIT_CODE, stop_requested


def run_bench(
    cfg: RunConfig,
    *,
    methods: list[str],
    seq_lens: list[int],
    repeats: int,
    out: str,
    ratio_to: str | None = None,
    run: Callable[[RunConfig], dict] | None = None,
) -> pd.DataFrame:
    """Run every (method, length) `repeats` times, append each record to `out`; return the throughput table.

    `methods` are method specs (`autosp.harness.method_spec`): a method, or one with its own options
    (`autosp[tiling=off]`). Each gets only the options of `cfg` it honours, so a row records what it ran."""
    from autosp.harness.method_spec import parse_method_spec
    from autosp.harness.records import append_record, check_writable, load_records

    specs = [parse_method_spec(m) for m in methods]
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:
        raise ConfigError(f"--methods names {', '.join(twice)} twice; name each method or spec once")
    configs = {spec.label: spec.config(cfg) for spec in specs}
    if run is None:
        from autosp.harness.runner import run, validate

        for method_cfg in configs.values():  # a typo fails before the first run, not an hour in
            for seq_len in seq_lens:
                validate(method_cfg.replace(seq_len=seq_len))
    if repeats < 1:
        raise ConfigError(f"--repeats must be positive, got {repeats}")
    if ratio_to is not None and ratio_to not in configs:
        raise ConfigError(f"--ratio-to {ratio_to} is not among --methods {','.join(configs)}; add it or drop the ratio")
    check_writable(out)
    bench_id = uuid.uuid4().hex
    cells = list(itertools.product(range(repeats), seq_lens, specs))
    with progress(cells, desc="bench") as bar:
        for repeat, seq_len, spec in bar:
            method = spec.label
            bar.set_postfix_str(f"{method} S={seq_len} repeat {repeat + 1}")
            record = run(configs[method].replace(seq_len=seq_len))
            if spec.options:  # names its rows in the table (and for --ratio-to) apart from the plain method's
                record["method_spec"] = method
            record["bench_id"] = bench_id
            record["extra"]["repeat"] = repeat
            append_record(out, record)
            median = (record.get("iter_time_s") or {}).get("median")
            timing = f"{median * 1e3:.1f} ms/iter" if median else record.get("error") or ""
            print(f"  [{repeat + 1}/{repeats}] {method} S={seq_len}: {record['status']} {timing}", flush=True)
            if record["status"] == "interrupted":  # SIGTERM/SIGINT: the remaining runs are not started
                break
    records = load_records(out, skip_bad_lines=True)  # only this bench's rows are read
    mine = records[records["bench_id"] == bench_id]
    failed = mine[mine["status"] != "ok"]
    for _, row in failed.iterrows():
        print(f"  not timed: {row['method']} S={row['seq_len']}: {row['status']} ({row['error']})")
    return throughput_table(mine, reference=ratio_to)


def _cmd_bench(args: argparse.Namespace) -> int:
    from autosp.harness.flags import run_config_from_args
    from autosp.harness.method_spec import split_methods

    methods = split_methods(args.methods)
    if not methods:
        raise ConfigError("--methods needs at least one method, e.g. --methods autosp,ulysses")
    ratio_to = args.ratio_to or (methods[0] if "ulysses" not in methods else "ulysses")
    try:
        table = run_bench(run_config_from_args(args, method="autosp", seq_len=1), methods=methods,
                          seq_lens=_seq_lens(args.seq_lens), repeats=args.repeats, out=args.out, ratio_to=ratio_to)
    except ConfigError:
        if stop_requested():  # interrupted before any run was timed: nothing to tabulate, the records are written
            return INTERRUPTED_EXIT_CODE
        raise
    shown = table.assign(iter_ms=table["iter_time_s"] * 1e3, min_ms=table["iter_time_min_s"] * 1e3,
                         max_ms=table["iter_time_max_s"] * 1e3, peak_mib=table["peak_mem_bytes"] / 2**20,
                         cpu_ms=table["cpu_time_s"] * 1e3, cpu_min_ms=table["cpu_time_min_s"] * 1e3,
                         cpu_max_ms=table["cpu_time_max_s"] * 1e3)
    columns = ["model", "seq_len", "method", "repeats", "peak_mib", "iter_ms", "min_ms", "max_ms", "tokens_per_s",
               f"speed_vs_{ratio_to}", f"tokens_per_s_vs_{ratio_to}", "cpu_ms", "cpu_min_ms", "cpu_max_ms",
               f"cpu_speed_vs_{ratio_to}"]
    with pd.option_context("display.width", 200, "display.float_format", "{:.3g}".format):
        print(shown[columns].to_string(index=False))
    return INTERRUPTED_EXIT_CODE if stop_requested() else 0


def _seq_lens(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--seq-lens takes comma-separated integers like 1024,2048, got {text!r}") from None
    if not lens:
        raise ConfigError("--seq-lens needs at least one length, e.g. --seq-lens 1024,2048")
    return lens


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp bench --methods a,b --model X --seq-lens 1024,2048 --world-size P --repeats N --out FILE`."""
    from autosp.harness.flags import add_run_config_arguments

    p = subparsers.add_parser("bench", help="iteration time and tokens/s of several methods at fixed lengths")
    p.add_argument("--methods", required=True, help="comma-separated, e.g. autosp,ulysses,zero3; a method with its "
                   "own options as method[option=value,...], e.g. autosp,autosp[tiling=off] (one interleaved run)")
    p.add_argument("--seq-lens", required=True, help="comma-separated lengths, e.g. 1024,2048")
    p.add_argument("--repeats", type=int, default=3, help="independent runs per (method, length)")
    p.add_argument("--ratio-to", default=None, help="reference method for speed ratios (default: ulysses if given)")
    p.add_argument("--out", default="results/bench.jsonl")
    add_run_config_arguments(p, varied=("method", "seq_len"))
    p.set_defaults(func=_cmd_bench, starts_ranks=True)
