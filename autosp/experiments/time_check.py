"""`autosp time-check`: the time model's predicted step beside the measured one on this CPU (issue 43's check).

Each method at each length is simulated on the `cpu` device (its rates from `autosp calibrate`) and run for real
(`autosp run`, P gloo ranks) `--repeats` times, the runs interleaved (every cell once, then again) so that a
change of the machine's load falls on every cell alike; the measured step is the median of the runs' medians.
The verdict is ±15% (`TOLERANCE`), and a miss is printed as a miss. `--measured <jsonl>` runs nothing: it re-predicts
the cells of earlier runs' records (matched by `config_hash`) against their measured steps, so a change of the time
model is judged on a quiet machine's committed records without a new measurement."""
from __future__ import annotations

import argparse
import statistics
from typing import Any

from autosp.harness.config import ConfigError, RunConfig

METHODS = ("autosp", "ulysses[ac=layer]", "zero3", "alst")
#: methods that run on the HF form of a preset (`hf:<preset>`)
HF_METHODS = ("alst",)
TOLERANCE = 0.15


def cell_configs(model: str, methods: list[str], lengths: list[int], *, world_size: int, memory_budget: int,
                 steps: int, compile_backend: str = "aot_eager") -> list[tuple[str, RunConfig]]:
    """(label, configuration) per method spec and length, validated before anything runs."""
    from autosp.harness.method_spec import parse_method_spec
    from autosp.harness.runner import validate

    cells = []
    for label in methods:
        spec = parse_method_spec(label)
        variant = f"hf:{model}" if spec.method in HF_METHODS and not model.startswith("hf:") else model
        for seq_len in lengths:
            cfg = spec.config(RunConfig(method=spec.method, model=variant, seq_len=seq_len, world_size=world_size,
                                        device="cpu", memory_budget=memory_budget, steps=steps,
                                        compile_backend=compile_backend))
            validate(cfg)
            cells.append((label, cfg))
    return cells


def predicted_rows(cells: list[tuple[str, RunConfig]]) -> list[dict[str, Any]]:
    """One row per cell with its predicted step on the `cpu` rates and no runs yet."""
    from autosp.experiments.simulate import simulate
    from autosp.experiments.simulate.devices import get_device_model

    rows = []
    for label, cfg in cells:
        record = simulate(cfg, get_device_model("cpu", cfg.memory_budget))
        time = record["extra"].get("time")
        if time is None:
            raise ConfigError("the cpu device has no rates: run `autosp calibrate` first")
        rows.append({"method": label, "seq_len": cfg.seq_len, "predicted_s": time["iteration_s"],
                     "simulated_status": record["status"], "runs": []})
    return rows


def judge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's measured step (the median of its runs), its error and verdict."""
    for row in rows:
        row["measured_s"] = statistics.median(row["runs"]) if row["runs"] else None
        row["error"] = row["predicted_s"] / row["measured_s"] - 1 if row["measured_s"] else None
        row["within"] = row["error"] is not None and abs(row["error"]) <= TOLERANCE
    return rows


def repredict(cells: list[tuple[str, RunConfig]], measured: str) -> list[dict[str, Any]]:
    """The cells predicted now beside the measured steps of `measured`'s records of the same configurations (by
    `config_hash`; a cell with no record there is a ConfigError): nothing is run."""
    from autosp.harness.records import read_records

    runs: dict[str, list[float]] = {}
    for record in read_records(measured):
        median = (record.get("iter_time_s") or {}).get("median")
        if record.get("status") == "ok" and record.get("mode", "measured") == "measured" and median:
            runs.setdefault(record["config_hash"], []).append(median)
    missing = [f"{label} {cfg.seq_len}" for label, cfg in cells if cfg.config_hash() not in runs]
    if missing:
        raise ConfigError(f"--measured {measured}: no measured record of {', '.join(missing)}; pass the records "
                          "of a time-check with the same --model, --methods, --lengths and --world-size")
    rows = predicted_rows(cells)
    for row, (_, cfg) in zip(rows, cells, strict=True):
        row["runs"] = runs[cfg.config_hash()]
    return judge(rows)


def time_check(cells: list[tuple[str, RunConfig]], repeats: int, out: str | None) -> list[dict[str, Any]]:
    """One row per cell: predicted and measured step seconds (the module docstring says how)."""
    from autosp.harness.runner import run

    rows = predicted_rows(cells)
    for repeat in range(repeats):
        for row, (_, cfg) in zip(rows, cells, strict=True):
            record = run(cfg, out=out)
            median = (record.get("iter_time_s") or {}).get("median")
            if record["status"] == "ok" and median:
                row["runs"].append(median)
            else:
                row.setdefault("errors", []).append(record.get("error") or record["status"])
            print(f"[{repeat + 1}/{repeats}] {row['method']} {row['seq_len']}: {record['status']} "
                  f"{median if median else ''}", flush=True)
    return judge(rows)


def format_rows(rows: list[dict[str, Any]], records: str | None = None) -> str:
    """The rows as a Markdown table and a verdict line; `records`: the file the measured steps came from."""
    lines = ["| method | tokens | predicted step (s) | measured step (s), median of runs | runs | predicted/measured "
             f"- 1 | within ±{TOLERANCE:.0%} |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = f"{r['measured_s']:.3f}" if r["measured_s"] else "-"
        error = f"{r['error']:+.1%}" if r["error"] is not None else "-"
        lines.append(f"| {r['method']} | {r['seq_len']} | {r['predicted_s']:.3f} | {measured} | {len(r['runs'])} | "
                     f"{error} | {'yes' if r['within'] else 'MISS'} |")
    hits = sum(r["within"] for r in rows)
    where = f"the records of {records}" if records else "`autosp run` on this CPU"
    lines.append(f"\n{hits}/{len(rows)} cells within ±{TOLERANCE:.0%} (predictions of the time model; the measured "
                 f"steps are wall seconds of {where})")
    return "\n".join(lines)


def _cmd_time_check(args: argparse.Namespace) -> int:
    from autosp.experiments.flops import parse_seq_lens
    from autosp.harness.measure import parse_size
    from autosp.harness.method_spec import split_methods

    cells = cell_configs(args.model, split_methods(args.methods), parse_seq_lens(args.lengths),
                         world_size=args.world_size, memory_budget=parse_size(args.memory_budget), steps=args.steps,
                         compile_backend=args.compile_backend)
    rows = repredict(cells, args.measured) if args.measured else time_check(cells, args.repeats, args.out)
    print(format_rows(rows, args.measured))
    return 0 if all(r["within"] for r in rows) else 1


def add_time_check_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp time-check`: predicted vs measured step of four methods at three lengths on this CPU."""
    p = subparsers.add_parser("time-check", help="the time model's predicted step vs measured runs on this CPU",
                              epilog="exit code: 0 every cell within 15%%, 1 a miss, 2 bad input")
    p.add_argument("--model", default="llama3-mini")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated method specs")
    p.add_argument("--lengths", nargs="+", default=["1K,2K,4K"], help="sequence lengths, e.g. 1K,2K,4K")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--memory-budget", default="16GiB", help="the runs' and the simulation's memory budget")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per cell (the median is kept)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--compile-backend", default="aot_eager",
                   help="compiled methods' backend in the runs (default aot_eager: the unfused graphs the simulator "
                        "runs and the time model prices; inductor fuses element-wise ops the model prices one by one)")
    p.add_argument("--out", default=None, help="JSONL file the measured runs' records go to")
    p.add_argument("--measured", default=None, metavar="JSONL",
                   help="run nothing: re-predict the cells of these earlier time-check records beside their measured "
                        "steps (the model judged on a quiet machine's records)")
    p.set_defaults(func=_cmd_time_check)
