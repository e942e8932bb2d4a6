"""`autosp simulate-table`: the paper's trainability table (models x methods x device types), simulated.

Every probe of a search is one fake-tensor simulation (`autosp.experiments.simulate`) whose cost does not
depend on the length (shapes only), so the table's time is its number of probes times ~5-12 s of CPU.
Four levers keep that number small; none changes a prediction (each probe is the same simulation):

- one search per (model, method, ZeRO stage) serves every device type. Device types differ only in their
  allocator constants and capacity (`devices.py`): a length already simulated is reused (`predict_peak`'s
  cache, keyed by the allocator's block sizes), and the peak-vs-length line of the probes so far starts the
  next device's search at its boundary (`simulate.curve_hint`), so it usually takes two probes — the answer
  and one granularity step above, which `search_max_length` needs before it reports the answer;
- every probe of a cell after its first reuses the cell's rank programs (`simulate.shared_rank_programs`: the
  model, AdamW states and a compiled method's one symbolic Dynamo trace, specialised per length), so it runs only
  its measured step and, compiled, the per-length SP pass and partition (DeepSpeed's engines alike: one
  `deepspeed.initialize` per depth and cell);
- the first device's search starts at the analytic floor's limit (`floor.py`) instead of the minimum length;
- cells run in `--jobs` worker processes (one simulation is single-threaded Python), costliest first so the workers
  finish together (`cell_order`).

The Markdown table puts each cell's max length beside AutoSP's ratios to Ulysses, Ring and FSDP (ZeRO-3) and
the paper's claimed ratios (`autosp/reference/paper_claims.csv`): 2.7x NVIDIA / 2.5x AMD vs Ulysses, 5.6x vs
ZeRO-3 at 8B, 3.0x vs Ring.
"""
from __future__ import annotations

import argparse
import numbers
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING

from autosp.harness.config import ConfigError, RunConfig

if TYPE_CHECKING:
    import pandas as pd

PAPER_MODELS = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-2-13b")
#: method[:ZeRO stage]; the stage a method runs without one is its own default (3 for the SP methods at 8 ranks):
#: AutoSP as it runs by default (the memory planner), the paper's setting (`autosp[paper]`) and the SP methods at
#: ZeRO 0 and 3, each compared with AutoSP at the same stage (like with like)
PAPER_METHODS = ("autosp", "autosp[paper]:0", "autosp[paper]:3", "ulysses:0", "ulysses:3", "ring:0", "ring:3", "fsdp",
                 "zero3", "ds-autosp")
#: the practical anchors beside them (`--methods` adds them): ALST and the baselines with per-layer activation
#: checkpointing, each at ZeRO 3 (`method[ac=layer]:stage`), labelled in the table as their own columns
PRACTICAL_METHODS = ("alst", "ulysses[ac=layer]:3", "ring[ac=layer]:3", "fsdp[ac=layer]", "zero3[ac=layer]")
#: the default's share of them: all (alst's rank programs of two depths and device types share a fake world, each
#: with its own SP groups and Ulysses registration: `simulate.world.process_registrations`)
DEFAULT_PRACTICAL = PRACTICAL_METHODS
#: the paper's device types, then those the published peers' lengths were measured on (ALST, UPipe: H100, H200)
PAPER_DEVICES = ("a100-80gb", "gh200-96gb", "mi250-gcd", "h100-80gb", "h200-141gb")
#: AutoSP's ratio columns: (baseline method, paper claim ids by device vendor)
RATIOS = (("ulysses", {"nvidia": "trainability_vs_ulysses_nvidia", "amd": "trainability_vs_ulysses_amd"}),
          ("ring", {"nvidia": "trainability_vs_ring"}),
          ("zero3", {"nvidia": "trainability_vs_zero3"}),
          ("fsdp", {"nvidia": "trainability_vs_zero3"}),
          ("alst", {}), ("ulysses[ac=layer]", {}))  # the practical anchors: no paper claim beside them
#: methods simulated on HF's LlamaForCausalLM (`hf:<preset>`): DeepSpeed's AutoSP pass shards only that form
#: (on the project Llama its compile fails, as it does when measured; README "DeepSpeed's AutoSP"); ALST patches
#: HF's attention and MLP classes
HF_MODEL_METHODS = ("ds-autosp", "alst")


def parse_method(spec: str) -> tuple[str, int | None]:
    """`autosp:3` -> ("autosp", 3); `ring` -> ("ring", None); `ulysses[ac=layer]:3` -> ("ulysses[ac=layer]", 3);
    `autosp[tiling=auto:16384]:3` -> ("autosp[tiling=auto:16384]", 3): the stage follows the brackets."""
    options_end = spec.rfind("]") + 1
    method, _, stage = spec[options_end:].partition(":")
    if stage and not stage.isdigit():
        raise ConfigError(f"--methods entry {spec!r}: write method or method:<ZeRO stage>, e.g. autosp:3")
    return spec[:options_end] + method, int(stage) if stage else None


def cell_configs(models: list[str], methods: list[str], *, world_size: int, dtype: str) -> list[tuple[str, RunConfig]]:
    """(label, validated configuration) per (model, method spec, stage): a spec (`autosp.harness.method_spec`,
    e.g. `ulysses[ac=layer]:3`, `autosp[sac=auto,offload=auto+optimizer]:3`) sets the method's own options and
    labels its column as written; bad input fails here, before any simulation."""
    from autosp.harness.method_spec import parse_method_spec
    from autosp.harness.runner import validate

    configs = []
    for model in models:
        for entry in methods:
            label, zero = parse_method(entry)
            spec = parse_method_spec(label)
            variant = f"hf:{model}" if spec.method in HF_MODEL_METHODS and not model.startswith("hf:") else model
            cfg = spec.config(RunConfig(method=spec.method, model=variant, seq_len=2 * world_size,
                                        world_size=world_size, dtype=dtype, zero=zero, device="cpu"))
            validate(cfg)
            configs.append((label, cfg.replace(seq_len=1)))
    return configs


def search_cell(label: str, cfg: RunConfig, device_names: list[str], granularity: int | None,
                max_len: int) -> list[dict]:
    """One configuration's search rows, one per device type, sharing one peak-vs-length curve; a spec with options
    of its own labels its rows (`method_spec`, as `autosp bench` does), so that they stand as a column of their
    own."""
    from autosp.experiments.simulate import shared_rank_programs, simulated_search
    from autosp.experiments.simulate.devices import get_device_model

    curve: dict[int, int] = {}
    started = time.process_time()
    with shared_rank_programs():  # one rank program per depth serves every length of every device's search
        rows = [simulated_search(cfg, get_device_model(name), granularity=granularity, max_len=max_len,
                                 curve=curve) for name in device_names]
    for row in rows:
        row["extra"]["cell_cpu_s"] = round(time.process_time() - started, 1)  # the whole cell, every device
        row["extra"]["cell_simulated_lengths"] = len(curve)
        if label != _plain_label(cfg):
            row["method_spec"] = label
    return rows


def _plain_label(cfg: RunConfig) -> str:
    """The column a configuration takes without a spec's label: its method, or its checkpointed variant."""
    from autosp.experiments.tables import method_variant

    return method_variant(cfg.method, cfg.ac)


#: how costly a cell's probes are, by method: DeepSpeed's AutoSP compiles every length through DeepSpeed's pass and
#: aot_autograd; ZeRO-3 runs DeepSpeed's engine at full depth (`simulate.NOT_LINEAR_IN_DEPTH`); autosp compiles
#: every length; the eager baselines run each probe's step only (measured at c4116db: ~110-145, 36-124 and 30-41
#: CPU-s a cell against 3-20); alst's probes grow with the length (TiledMLP's and the tiled loss's shards: ~70 CPU-s
#: a 2-layer probe of llama-3.1-8b at 1M tokens on 8 ranks)
COST_RANK = {"alst": 4, "ds-autosp": 3, "zero3": 2, "autosp": 1, "ulysses-compile": 1}


def cell_order(configs: list[tuple[str, RunConfig]]) -> list[tuple[str, RunConfig]]:
    """Costliest first: the method's rank (`COST_RANK`), then the model's depth."""
    from autosp.models import get_preset

    return sorted(configs, key=lambda cell: (COST_RANK.get(cell[1].method, 0), get_preset(cell[1].model).num_layers),
                  reverse=True)


def simulate_table(configs: list[tuple[str, RunConfig]], device_names: list[str], *, jobs: int, out: str,
                   granularity: int | None = None, max_len: int = 1 << 22) -> list[dict]:
    """Every cell's search rows, appended to `out` as each cell finishes (a stopped run keeps what it did)."""
    from autosp.experiments.simulate import summary_line
    from autosp.harness.records import append_record

    rows: list[dict] = []

    def keep(cell_rows: list[dict]) -> None:
        for row in cell_rows:
            append_record(out, row)
            print(summary_line(row), flush=True)
        rows.extend(cell_rows)

    # the longest cells first, so that the workers finish together (longest-processing-time-first scheduling); any
    # method may follow DeepSpeed's AutoSP in a worker (the project's ops have a namespace of their own)
    order = cell_order(configs)
    if jobs <= 1:
        for label, cfg in order:
            keep(search_cell(label, cfg, device_names, granularity, max_len))
        return rows
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(search_cell, label, cfg, device_names, granularity, max_len) for label, cfg in order]
        for future in as_completed(futures):
            keep(future.result())
    return rows


def _length(row: pd.Series) -> str:
    import pandas as pd

    n = row["max_seq_len"]
    if row["status"] == "error":
        return "error"
    if pd.isna(n) or not n:  # a search that found no trainable length (a nullable Int64 column: NA)
        return "oom at min"
    text = f"{int(n) / 1024:g}K"
    return f">={text}" if row["status"] == "no_oom_up_to_max_len" else text


def _ratio(ours: float, theirs: float, lower_bound: bool = False) -> str:
    if not ours:
        return "-"
    return (">=" if lower_bound else "") + f"{ours / theirs:.2f}x" if theirs else "only autosp trains"


def markdown_table(table: pd.DataFrame) -> str:
    """Max length per cell (columns method zZeRO-stage) and AutoSP's best over its stages vs each baseline's best,
    beside the paper's claimed ratio for the device's vendor; each autosp method spec's best vs alst's."""
    from autosp.experiments.simulate.devices import get_device_model
    from autosp.experiments.tables import SPEC_RATIO, autosp_specs, paper_claims

    claims = paper_claims().set_index("claim_id")
    hf = table["model"].str.startswith("hf:")  # a method run on the HF variant of the row's model is labelled so
    table = table.assign(label=table["method"] + hf.map({True: " (hf)", False: ""}) + " z"
                         + table["zero"].astype("Int64").astype(str), model=table["model"].str.removeprefix("hf:"))
    labels = _column_order(list(table["label"]))
    specs = autosp_specs(table["method"])
    head = ["model", "device", *labels, *(f"autosp/{ref}" + (" (paper)" if ids else "") for ref, ids in RATIOS),
            *(f"{spec}/{SPEC_RATIO}" for spec in specs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (model, device), cell in _by_row(table):
        by_label = {row["label"]: _length(row) for _, row in cell.iterrows()}
        ran = cell[cell["status"] != "error"]  # a cell that could not be simulated has no length to compare
        best = ran.assign(n=ran["max_seq_len"].fillna(0).astype(float)).groupby("method")["n"].max()
        # a method whose longest length is a lower bound (`>=N`) has a ratio that is one too
        bounded = set(ran.loc[ran["status"] == "no_oom_up_to_max_len", "method"])
        vendor = get_device_model(device).vendor
        ratios = []
        for ref, claim_ids in RATIOS:
            claim_id = claim_ids.get(vendor, "")
            applies = claim_id in claims.index and str(claims.loc[claim_id, "model"]).lower() in ("up to", model)
            claimed = f" ({claims.loc[claim_id, 'factor']:g}x)" if applies else ""  # 5.6x is an 8B claim
            ratios.append(_ratio(best.get("autosp", 0.0), best.get(ref, 0.0), "autosp" in bounded) + claimed
                          if ref in best else "-")
        ratios += [_ratio(best.get(spec, 0.0), best[SPEC_RATIO], spec in bounded)
                   if spec in best and SPEC_RATIO in best else "-" for spec in specs]
        lines.append("| " + " | ".join([model, device, *(by_label.get(label, "") for label in labels), *ratios]) + " |")
    return "\n".join(lines)


def _by_row(table: pd.DataFrame) -> list[tuple[tuple[str, str], pd.DataFrame]]:
    """The table's (model, device) rows, models by size (`tables.model_order`), then device types by name, whichever
    file each cell came from."""
    from autosp.experiments.tables import model_order

    return sorted(table.groupby(["model", "device"], sort=False), key=lambda kv: (model_order(kv[0][0]), kv[0][1]))


def _column_order(labels: list[str]) -> list[str]:
    """Column labels (`method z<stage>`, `(hf)` where so) in the paper table's order, then the rest by name."""
    order = list(dict.fromkeys(parse_method(spec)[0] for spec in PAPER_METHODS + PRACTICAL_METHODS))
    rank = lambda label: (order.index(label.split(" ")[0]) if label.split(" ")[0] in order else len(order), label)  # noqa: E731
    return sorted(dict.fromkeys(labels), key=rank)


def time_markdown_table(table: pd.DataFrame) -> str:
    """Each cell's predicted step at its longest length (seconds, tokens/s per GPU, the length), laid out as the
    length table, with only the rows and columns that carry one (a rendered Markdown table's cells and device types
    without rates carry none; a search that found no length carries only its failed probe's, not shown). A
    prediction of an earlier time model says so, and what that model left out."""
    import pandas as pd

    from autosp.experiments.simulate.speed import EARLIER_TIME_MODELS, TIME_MODEL

    if "extra.time.iteration_s" not in table:
        return ""
    hf = table["model"].str.startswith("hf:")
    table = table.assign(label=table["method"] + hf.map({True: " (hf)", False: ""}) + " z"
                         + table["zero"].astype("Int64").astype(str), model=table["model"].str.removeprefix("hf:"))
    found = pd.to_numeric(table["max_seq_len"], errors="coerce").fillna(0) > 0
    timed = table[table["extra.time.iteration_s"].notna() & (table["status"] != "error") & found]
    version = timed.get("extra.time.time_model")  # a record without one: the first model
    timed = timed.assign(time_model=1 if version is None else version.fillna(1).astype(int))
    labels = _column_order(list(timed["label"]))  # the columns and rows with a prediction
    lines = ["| model | device | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 2)]
    for (model, device), cell in _by_row(timed):
        by_label = {row["label"]: f"{row['extra.time.iteration_s']:.3g} s, "
                                  f"{row['extra.time.tokens_per_s_per_gpu']:,.0f} tok/s/GPU at {_length(row)}"
                                  + ("" if row["time_model"] == TIME_MODEL else f" (time model {row['time_model']})")
                    for _, row in cell.iterrows()}
        lines.append("| " + " | ".join([model, device, *(by_label.get(label, "") for label in labels)]) + " |")
    older = sorted(set(timed["time_model"]) - {TIME_MODEL})
    notes = "".join(f"\n\n(time model {n}): predicted by time model {n}, which {EARLIER_TIME_MODELS[n]}; not "
                    "simulated again since." for n in older)
    return "\n".join(lines) + notes if labels else ""


def rendered_rows(paths: list[str], relabel: dict[str, str] | None = None, methods: list[str] | None = None,
                  world_size: int | None = None) -> list[dict]:
    """The search rows of earlier runs: JSONL records, or a rendered Markdown table (`results/simulated_table.md`,
    whose JSONL is not committed; its HF methods given their `hf:` model back). A cell (model, device, method,
    ZeRO stage) found in a later file replaces an earlier file's: new cells rendered into the committed table. A
    JSONL's single simulated lengths that fit (`autosp simulate --seq-len N`) fill cells no search answered, as
    lower bounds (`lower_bound_row`): one costly probe at a baseline's length shows a cell's order; one at the
    answer of a search before it gives that search its predicted step (`_reprice`). `relabel` moves a
    Markdown table's column to another (`{"autosp": "autosp[paper]"}`: a table recorded before autosp's default
    became the planner); a Markdown table carries no configuration that would say so, a JSONL's rows do. Only the
    rows `select_rows` keeps (`methods`, `world_size`) take part."""
    from autosp.experiments.tables import simulated_table_rows
    from autosp.harness.records import read_records

    cells: dict[tuple, dict] = {}
    bounds: list[dict] = []
    for path in paths:
        if str(path).endswith(".md"):
            table = simulated_table_rows(path)
            table["model"] = [f"hf:{m}" if method in HF_MODEL_METHODS else m
                              for m, method in zip(table["model"], table["method"], strict=True)]
            table["method"] = table["method"].replace(relabel or {})
            for row in select_rows(table.to_dict("records"), methods, world_size):
                cells[_cell(row)] = row
            continue
        for record in read_records(path):  # in the file's order: a record re-prices only the searches before it
            if record.get("kind") == "search":
                for row in select_rows([record], methods, world_size):
                    cells[_cell(row)] = row
            elif _fits_alone(record):
                for row in select_rows([lower_bound_row(record)], methods, world_size):
                    bounds.append(row)
                    _reprice(cells, row)
    for row in bounds:  # a search's answer stands, unless it is itself a lower bound below this one
        held = cells.get(_cell(row))
        if held is None or (held["status"] == "no_oom_up_to_max_len" and held["max_seq_len"] < row["max_seq_len"]):
            cells[_cell(row)] = row
    return list(cells.values())


def _reprice(cells: dict[tuple, dict], row: dict) -> None:
    """A single simulated length (`lower_bound_row`) at the answer of its cell's search so far gives that search
    its predicted step: the same configuration at the same length, simulated later (e.g. `autosp simulate --seq-len
    N` at a search's answer after the time model changed). The search keeps its length. The same configuration: equal
    in every field both records' configurations have (a field one lacks did not exist when it was simulated)."""
    held = cells.get(_cell(row))
    step = (row.get("extra") or {}).get("time")
    if held is None or step is None or held.get("max_seq_len") != row["seq_len"]:
        return
    ours, theirs = row.get("config") or {}, held.get("config") or {}
    if all(ours[key] == theirs[key] for key in ours.keys() & theirs.keys()):
        cells[_cell(row)] = dict(held, extra={**(held.get("extra") or {}), "time": step})


def _cell(row: dict) -> tuple:
    """(model, device, column, ZeRO stage): the column is the row's spec, or its method's (checkpointed) variant."""
    from autosp.experiments.tables import method_variant

    variant = row.get("method_spec") or method_variant(row["method"],
                                                       row.get("ac") or (row.get("config") or {}).get("ac"))
    return row["model"], row["device"], variant, row.get("zero")


def _fits_alone(record: dict) -> bool:
    """A simulated run of one length (`autosp simulate --seq-len N`, not a search or its probe) that fits."""
    return record.get("mode") == "simulated" and record.get("kind") is None and record.get("status") == "ok"


def lower_bound_row(record: dict) -> dict:
    """A single simulated length that fits, as its cell's row: a lower bound on the longest length (`>=N`, as a
    search that reached its --max-len), in the column of the spec it ran as (`method_spec.spec_label`)."""
    from autosp.experiments.tables import method_variant
    from autosp.harness.method_spec import spec_label

    config = record.get("config") or {}
    label = spec_label(config) if config else record["method"]
    row = dict(record, kind="search", status="no_oom_up_to_max_len", max_seq_len=record["seq_len"],
               first_oom_seq_len=None, num_probes=1, floor_limit_seq_len=None, achieved_over_limit=None)
    if label != method_variant(record["method"], config.get("ac")):
        row["method_spec"] = label
    return row


def select_rows(rows: list[dict], methods: list[str] | None, world_size: int | None) -> list[dict]:
    """The rendered rows of one table: those of `world_size` (rows that name none stay) and, where `methods` are
    given (`--methods`), of their columns (`method[:stage]`; without a stage, any stage)."""
    wanted = [parse_method(entry) for entry in methods or []]

    def kept(row: dict) -> bool:
        world = row.get("world_size")
        if world_size is not None and isinstance(world, numbers.Real) and world == world and world != world_size:
            return False
        _, _, column, zero = _cell(row)
        return not wanted or any(column == label and (stage is None or stage == zero) for label, stage in wanted)

    return [row for row in rows if kept(row)]


def shortfalls(table: pd.DataFrame, ours: str = "autosp") -> list[str]:
    """Every (model, device) where `ours` (its longest over its ZeRO stages) trains less than another column, as
    `model device: method N > autosp M`; a method with no length there is left out. The issue's must-show is that this
    is empty; the table says where it is not."""
    lengths = table.assign(n=table["max_seq_len"].astype("Float64").fillna(0).astype(float),
                           model=table["model"].str.removeprefix("hf:"))
    found = []
    for (model, device), cell in lengths.groupby(["model", "device"], sort=False):
        best = cell.groupby("method")["n"].max()
        mine = best.get(ours, 0.0)
        if not mine:
            continue
        found += [f"{model} {device}: {method} {_k(n)} > {ours} {_k(mine)}"
                  for method, n in best.sort_values(ascending=False).items() if method != ours and n > mine]
    return found


def _k(n: float) -> str:
    return f"{n / 1024:g}K"


def _command(args: argparse.Namespace) -> str:
    """The `autosp simulate-table --render ...` command that renders this table again, for its footnote."""
    import shlex

    words = ["autosp", "simulate-table", "--render", *args.render]
    words += [f"--relabel={pair}" for pair in args.relabel]
    if args.methods is not None:
        words += ["--methods", args.methods]
    if args.world_size is not None:
        words += ["--world-size", str(args.world_size)]
    words += ["--table-out", args.table_out]
    if args.figure:
        words += ["--figure", *args.figure]
    return shlex.join(words)


def _setting(rows: list[dict]) -> str:
    """`world size 8, bfloat16`: the rows' world sizes and dtypes (a rendered table's rows carry no dtype)."""
    worlds = sorted({int(r["world_size"]) for r in rows if isinstance(r.get("world_size"), numbers.Real)
                     and r["world_size"] == r["world_size"]})  # NaN: a table without its world size
    dtypes = sorted({r["dtype"] for r in rows if isinstance(r.get("dtype"), str)})
    return ", ".join(([f"world size {'/'.join(map(str, worlds))}"] if worlds else []) + dtypes)


def _relabel(pair: str) -> tuple[str, str]:
    old, sep, new = (part.strip() for part in pair.partition("="))
    if not sep or not old or not new:
        raise ConfigError(f"--relabel {pair!r}: write OLD=NEW, e.g. autosp=autosp[paper]")
    return old, new


def _cmd_simulate_table(args: argparse.Namespace) -> int:
    import pandas as pd

    from autosp.experiments.plots import check_figure_path, trainability_figure
    from autosp.experiments.simulate.devices import get_device_model
    from autosp.experiments.tables import trainability_table
    from autosp.harness.method_spec import split_methods
    from autosp.harness.records import check_writable

    devices = args.devices.split(",")
    for name in devices:
        if not get_device_model(name).memory_bytes:
            raise ConfigError(f"--devices {name}: the table is for GPU types with their own memory")
    methods = split_methods(args.methods) if args.methods is not None else None
    world_size = args.world_size or 8
    configs = cell_configs(args.models.split(","), methods or list(PAPER_METHODS + DEFAULT_PRACTICAL),
                           world_size=world_size, dtype=args.dtype)
    relabel = dict(_relabel(pair) for pair in args.relabel)
    if relabel and not args.render:
        raise ConfigError("--relabel reads a rendered table's columns: give the tables with --render")
    for path in args.figure:
        check_figure_path(path)
    check_writable(args.table_out, "--table-out")
    started, cpu = time.monotonic(), os.times()
    if args.render:  # the rows of an earlier (possibly stopped) run: table and figure only
        rows = rendered_rows(args.render, relabel, methods, args.world_size)
    else:
        rows = simulate_table(configs, devices, jobs=args.jobs, out=args.out, granularity=args.granularity,
                              max_len=args.max_len)
    table = trainability_table(pd.json_normalize(rows, sep="."))
    text = markdown_table(table)
    if times := time_markdown_table(table):
        text += ("\n\nPredicted iteration time at each cell's longest length (`extra.time`, a prediction of the "
                 "time model, docs/simulator.md):\n\n" + times)
    used = os.times()
    cpu_s = (used.user - cpu.user) + (used.system - cpu.system) + (used.children_user - cpu.children_user) \
        + (used.children_system - cpu.children_system)
    if "autosp" in set(table["method"]):  # the must-show: autosp's default >= every other column
        below = shortfalls(table)
        text += ("\n\nWhere autosp (its default, the planner) trains less than another column: " + "; ".join(below)
                 + "." if below else "\n\nautosp (its default) trains at least as long as every other column in "
                 "every row where it has a length.")
    footer = (f"\n\n{_setting(rows)}: rendered with `{_command(args)}`; an empty cell was not searched."
              if args.render else
              f"\n\n{len(configs)} cells x {len(devices)} device types, world size {world_size}, {args.dtype}: "
              f"{time.monotonic() - started:.0f} s wall, {cpu_s:.0f} s CPU (user+sys, workers included), "
              f"--jobs {args.jobs}.") + " Simulated (`autosp simulate-table`), not measured.\n"
    Path(args.table_out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{args.table_out}.tmp")
    tmp.write_text(text + footer)
    os.replace(tmp, args.table_out)
    print(text + footer)
    if args.figure:
        trainability_figure(table, args.figure)
        print(f"wrote {args.table_out} {' '.join(args.figure)}")
    return 1 if any(r["status"] == "error" for r in rows) and not args.allow_errors else 0


def add_simulate_table_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp simulate-table [--models ...] [--methods ...] [--devices ...]`: the whole simulated table."""
    p = subparsers.add_parser(
        "simulate-table", help="the paper's trainability table on GPU types you do not have (simulated searches)",
        epilog="exit code: 0 every cell simulated (or --allow-errors), 1 a method could not be simulated, 2 bad input")
    p.add_argument("--models", default=",".join(PAPER_MODELS), help="comma-separated model presets")
    p.add_argument("--methods", default=None,
                   help="comma-separated method[:ZeRO stage] (none: the method's default), e.g. "
                        "autosp,autosp[paper]:3,ring,fsdp; a method spec sets its own options, e.g. "
                        "'autosp[sac=auto,offload=auto+optimizer]:3' (default: "
                        f"{','.join(PAPER_METHODS + DEFAULT_PRACTICAL)}; with --render, the columns shown: all)")
    p.add_argument("--devices", default=",".join(PAPER_DEVICES), help="comma-separated device types (catalogue)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default 8); with --render, only the rows of this world size (default: all)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--granularity", type=int, default=None, help="search length step (default 2*P*128)")
    p.add_argument("--max-len", type=int, default=1 << 22, help="longest length a search tries")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    p.add_argument("--out", default="results/simulated_table.jsonl", help="JSONL file the search rows go to")
    p.add_argument("--table-out", default="results/simulated_table.md", help="the Markdown table")
    p.add_argument("--figure", nargs="*", default=[], help="trainability figure files (.png, .pdf)")
    p.add_argument("--render", nargs="+", default=[], metavar="JSONL",
                   help="no simulation: the table and figure of the search rows in these files (JSONL, or a "
                        "rendered table .md; a cell in a later file replaces an earlier file's, and a later "
                        "`autosp simulate --seq-len N` at a search's answer N gives it its predicted step)")
    p.add_argument("--relabel", action="append", default=[], metavar="OLD=NEW",
                   help="with --render: a Markdown table's column OLD is read as NEW, e.g. autosp=autosp[paper] "
                        "for a table recorded before autosp's default became the planner (repeatable)")
    p.add_argument("--allow-errors", action="store_true",
                   help="exit 0 even where a method cannot be simulated (its cells say why)")
    p.set_defaults(func=_cmd_simulate_table)
