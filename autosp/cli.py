"""`autosp <command>`: a thin argparse layer over the harness. `run` and `check` live here; other modules add
their own commands through `add_<cmd>_parser(subparsers)` (listed in SUBCOMMANDS), which set `func` to a
function taking the parsed arguments and returning the exit code.

Bad input (ConfigError, bad flags) ends with one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence

from autosp.config import ConfigError, DataConfig, RunConfig
from autosp.measure import format_size, parse_size

#: (module, function) pairs that add a subcommand; a module that does not exist (yet) is skipped
SUBCOMMANDS = (
    ("autosp.search", "add_search_parser"),
    ("autosp.bench", "add_bench_parser"),
    ("autosp.tables", "add_table_parser"),
    ("autosp.plots", "add_plot_parser"),
    ("autosp.flops", "add_flops_parser"),
)
#: exit codes of `autosp run` per record status
RUN_EXIT_CODES = {"ok": 0, "error": 1, "timeout": 1, "oom": 3}
USAGE_ERROR = 2


class OneLineParser(argparse.ArgumentParser):
    """Reports bad arguments as one line (plus where to look), like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig) if f.default is not dataclasses.MISSING}
_DATA_DEFAULTS = DataConfig()


def add_run_config_arguments(parser: argparse.ArgumentParser, *, varied: Sequence[str] = ()) -> None:
    """One flag per RunConfig field (and per DataConfig field, prefixed), defaults taken from the dataclasses.

    `varied`: fields a command sets itself (e.g. `search` varies seq_len, `bench` also the method)."""
    d = _DEFAULTS
    g = parser.add_argument_group("run configuration")
    if "method" not in varied:
        g.add_argument("--method", required=True, help="training method (see `autosp methods`), e.g. single, autosp")
    g.add_argument("--model", required=True, help="model preset, e.g. tiny, small, llama-3.2-1b, hf:tiny")
    if "seq_len" not in varied:
        g.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    g.add_argument("--batch-size", type=int, default=d["batch_size"], help="sequences per data-parallel replica")
    g.add_argument("--world-size", type=int, default=d["world_size"], help="number of ranks")
    g.add_argument("--sp-size", type=int, default=d["sp_size"], help="SP degree (default: the method's)")
    g.add_argument("--dtype", default=d["dtype"], help="float32 | bfloat16 | float16")
    g.add_argument("--device", default=d["device"], help="cpu | cuda (ROCm builds of torch use cuda too)")
    g.add_argument("--seed", type=int, default=d["seed"])
    g.add_argument("--lr", type=float, default=d["lr"], help="AdamW learning rate")
    g.add_argument("--steps", type=int, default=d["steps"], help="timed steps")
    g.add_argument("--warmup", type=int, default=d["warmup"], help="untimed steps before measuring")
    g.add_argument("--sac", default=d["sac"], help="autosp checkpointing: off | sac | full | budget=<fraction>")
    g.add_argument("--compile-backend", default=d["compile_backend"], help="inductor | aot_eager | eager")
    g.add_argument("--memory-budget", default=None,
                   help="emulated device size, e.g. 512MiB or 2GiB: a higher peak ends the run as oom")
    g.add_argument("--timeout", "--timeout-s", dest="timeout_s", type=float, default=d["timeout_s"],
                   help="seconds before the whole run is ended as timeout")
    g.add_argument("--data-ignore-fraction", type=float, default=_DATA_DEFAULTS.ignore_fraction,
                   help="fraction of labels set to -100 (in uneven runs)")
    g.add_argument("--packed-documents", type=int, default=_DATA_DEFAULTS.packed_documents,
                   help="documents packed per row (position_ids restart per document)")
    g.add_argument("--pad-fraction", type=float, default=_DATA_DEFAULTS.pad_fraction,
                   help="fraction of each row that is right padding (attention_mask 0)")
    g.add_argument("--import", dest="extra_imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE in every rank first (out-of-tree methods register on import); repeatable")


def run_config_from_args(args: argparse.Namespace, **varied: object) -> RunConfig:
    """The RunConfig the flags of `add_run_config_arguments` describe (sizes parsed, e.g. 512MiB); `varied`
    supplies the fields the command set itself (a placeholder method or length for search/bench)."""
    budget = parse_size(args.memory_budget) if args.memory_budget is not None else None
    data = DataConfig(ignore_fraction=args.data_ignore_fraction, packed_documents=args.packed_documents,
                      pad_fraction=args.pad_fraction)
    fields = dict(method=getattr(args, "method", None), model=args.model, seq_len=getattr(args, "seq_len", None),
                  batch_size=args.batch_size, world_size=args.world_size, sp_size=args.sp_size, dtype=args.dtype,
                  device=args.device, seed=args.seed, lr=args.lr, steps=args.steps, warmup=args.warmup, sac=args.sac,
                  compile_backend=args.compile_backend, memory_budget=budget, timeout_s=args.timeout_s, data=data)
    return RunConfig(**{**fields, **varied})


def _cmd_run(args: argparse.Namespace) -> int:
    from autosp.runner import run

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
    print(summary + (f" -> {args.out}" if args.out else ""))
    return RUN_EXIT_CODES[record["status"]]


def _cmd_check(args: argparse.Namespace) -> int:
    from autosp.check import check

    if args.check_steps < 1:
        raise ConfigError(f"--check-steps must be positive, got {args.check_steps}")
    report = check(run_config_from_args(args), tolerance=args.tolerance, steps=args.check_steps,
                   extra_imports=args.extra_imports)
    print(report.format())
    if args.json_out:
        from autosp.records import write_json_atomic

        write_json_atomic(args.json_out, report.to_dict())
    return 0 if report.passed else 1


def _cmd_methods(args: argparse.Namespace) -> int:
    from baselines.base import get_strategy, method_names

    names = method_names()
    width = max(map(len, names)) + 2
    for name in names:
        print(f"{name:<{width}}{get_strategy(name).description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="autosp", description="AutoSP: compiler-based sequence parallelism and its harness")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="one measured training run, appended as a JSON record",
                       epilog="exit code: 0 ok, 3 oom, 1 error or timeout, 2 bad input")
    add_run_config_arguments(p)
    p.add_argument("--out", default="results/runs.jsonl", help="JSONL file the record is appended to")
    p.add_argument("--json", action="store_true", help="also print the record")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("check", help="compare a method on P ranks with single-process training",
                       epilog="exit code: 0 within tolerance, 1 not (or the run failed), 2 bad input")
    add_run_config_arguments(p)
    p.add_argument("--tolerance", type=float, default=None, help="relative error bound (default: 1e-4 in fp32)")
    p.add_argument("--check-steps", type=int, default=2, help="AdamW steps compared")
    p.add_argument("--json-out", help="write the report as JSON here")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("methods", help="list the registered training methods")
    p.set_defaults(func=_cmd_methods)

    for module_name, function in SUBCOMMANDS:
        if importlib.util.find_spec(module_name) is None:
            continue
        add_parser = getattr(importlib.import_module(module_name), function, None)
        if add_parser is not None:
            add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"autosp {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":  # `python -m autosp.cli ...`; the guard matters: ranks are spawned processes
    sys.exit(main())
