"""`autosp <command>`: a thin argparse layer over the harness. `run` and `check` live here; other modules add
their own commands through `add_<cmd>_parser(subparsers)` (listed in SUBCOMMANDS), which set `func` to a
function taking the parsed arguments and returning the exit code.

Bad input (an `AutoSPError`: a ConfigError, a rates file of other columns...; bad flags) ends with one line on
stderr and exit code 2, never a traceback. Commands that start ranks set `starts_ranks` and run with SIGTERM/SIGINT
trapped: the run in flight is ended and recorded as `interrupted`, and the command exits with INTERRUPTED_EXIT_CODE;
their CPU ranks are forked from a warm server (`supervisor.warm_ranks`), so a search's probes do not each import
torch again.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Sequence

from autosp.errors import AutoSPError
from autosp.harness.config import ConfigError
from autosp.harness.flags import add_run_config_arguments, run_config_from_args
from autosp.harness.measure import format_size
from autosp.harness.supervisor import INTERRUPTED_EXIT_CODE

#: (module, function) pairs that add a subcommand; each must exist (a missing one fails every command, loudly)
SUBCOMMANDS = (
    ("autosp.experiments.search", "add_search_parser"),
    ("autosp.experiments.bench", "add_bench_parser"),
    ("autosp.experiments.tables", "add_table_parser"),
    ("autosp.experiments.plots", "add_plot_parser"),
    ("autosp.experiments.flops", "add_flops_parser"),
    ("autosp.experiments.history.cli", "add_history_parser"),
    ("autosp.experiments.floor", "add_floor_parser"),
    ("autosp.experiments.model_state", "add_model_state_parser"),
    ("autosp.experiments.activations", "add_activations_parser"),
    ("autosp.experiments.levers", "add_levers_parser"),
    ("autosp.experiments.simulate", "add_simulate_parser"),
    ("autosp.experiments.simulate.table", "add_simulate_table_parser"),
    ("autosp.experiments.calibrate", "add_calibrate_parser"),
    ("autosp.experiments.time_check", "add_time_check_parser"),
)
#: exit codes of `autosp run` per record status
RUN_EXIT_CODES = {"ok": 0, "error": 1, "timeout": 1, "oom": 3, "interrupted": INTERRUPTED_EXIT_CODE}
USAGE_ERROR = 2


class OneLineParser(argparse.ArgumentParser):
    """Reports bad arguments as one line (plus where to look), like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _cmd_run(args: argparse.Namespace) -> int:
    from autosp.harness.runner import run

    record = run(run_config_from_args(args), out=args.out, extra_imports=args.extra_imports)
    if args.json:
        print(json.dumps(record, sort_keys=True))
    times = record["iter_time_s"] or {}
    summary = (f"{record['status']}: {record['method']} {record['model']} seq {record['seq_len']} x "
               f"{record['world_size']} rank(s): peak {format_size(record['peak_mem_bytes'])}")
    if times.get("median") is not None:
        summary += (f", step {times['median']:.4f} s (median of {len(times['samples'])}), "
                    f"{record['tokens_per_s']:.0f} tokens/s, loss {record['loss']:.4f}")
    if record["error"]:
        summary += f" | {record['error']}"
    print(summary + (f" -> {args.out}" if args.out else ""), flush=True)
    return RUN_EXIT_CODES[record["status"]]


def _cmd_check(args: argparse.Namespace) -> int:
    from autosp.harness.check import check

    if args.check_steps < 1:
        raise ConfigError(f"--check-steps must be positive, got {args.check_steps}")
    if args.tolerance is not None and not 0 < args.tolerance < math.inf:
        raise ConfigError(f"--tolerance must be positive (a finite number), got {args.tolerance}")
    if args.json_out:
        from autosp.harness.records import check_writable

        check_writable(args.json_out, "--json-out")
    report = check(run_config_from_args(args), tolerance=args.tolerance, steps=args.check_steps,
                   extra_imports=args.extra_imports)
    print(report.format())
    if report.status == "interrupted":
        return INTERRUPTED_EXIT_CODE
    if args.json_out:
        from autosp.harness.records import write_json_atomic

        write_json_atomic(args.json_out, {**report.to_dict(), "model": args.model})  # tables key checks by model
    return 0 if report.passed else 1


def _cmd_methods(args: argparse.Namespace) -> int:
    from autosp.harness.strategy import get_strategy, method_names

    names = method_names()
    width = max(map(len, names)) + 2
    for name in names:
        strategy = get_strategy(name)
        stages = f"ZeRO {strategy.zero_stages[0]} by default" + (
            f", --zero {'/'.join(map(str, sorted(strategy.zero_stages)))}" if len(strategy.zero_stages) > 1 else "")
        print(f"{name:<{width}}{strategy.description} [{stages}]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="autosp", description="AutoSP: compiler-based sequence parallelism and its harness")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="one measured training run, appended as a JSON record",
                       epilog=f"exit code: 0 ok, 3 oom, 1 error or timeout, {INTERRUPTED_EXIT_CODE} interrupted "
                              "(SIGTERM/SIGINT), 2 bad input")
    add_run_config_arguments(p)
    p.add_argument("--out", default="results/runs.jsonl", help="JSONL file the record is appended to")
    p.add_argument("--json", action="store_true", help="also print the record")
    p.set_defaults(func=_cmd_run, starts_ranks=True)

    p = sub.add_parser("check", help="compare a method on P ranks with single-process training",
                       epilog="exit code: 0 within tolerance, 1 not (or the run failed), 2 bad input")
    add_run_config_arguments(p)
    p.add_argument("--tolerance", type=float, default=None, help="relative error bound (default: 1e-4 in fp32)")
    p.add_argument("--check-steps", type=int, default=2, help="AdamW steps compared")
    p.add_argument("--json-out", help="write the report as JSON here")
    p.set_defaults(func=_cmd_check, starts_ranks=True)

    p = sub.add_parser("methods", help="list the registered training methods")
    p.set_defaults(func=_cmd_methods)

    for module_name, function in SUBCOMMANDS:  # a module or function missing is an ImportError/AttributeError here
        getattr(importlib.import_module(module_name), function)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if not getattr(args, "starts_ranks", False):
            return args.func(args)
        from autosp.harness.launch import interruptible, warm_preload
        from autosp.harness.supervisor import warm_ranks

        methods = getattr(args, "method", None) or getattr(args, "methods", "")
        # SIGTERM/SIGINT: ranks ended, `interrupted` recorded, a normal exit. CPU ranks fork from one warm server.
        with interruptible(), warm_ranks(warm_preload(methods)):
            return args.func(args)
    except AutoSPError as exc:
        print(f"autosp {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":  # `python -m autosp.cli ...`; the guard matters: ranks are spawned processes
    sys.exit(main())
