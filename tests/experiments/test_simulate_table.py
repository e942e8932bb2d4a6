"""`autosp simulate-table`: every (model, method, stage) searched once for all device types, one Markdown table."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from autosp.cli import main
from autosp.experiments import simulate as sim
from autosp.experiments.simulate.table import PAPER_METHODS, markdown_table
from autosp.harness.config import RunConfig


def test_markdown_table_puts_autosps_best_stage_against_each_baseline_beside_the_papers_claim():
    cells = [("autosp", 0, 64), ("autosp", 3, 96), ("ulysses", 0, 32), ("ring", 0, 32), ("ring", 3, 48),
             ("fsdp", 3, 16)]
    rows = [dict(model="llama-3.1-8b", device=device, method=method, zero=zero, status="found",
                 max_seq_len=k * 1024) for device in ("a100-80gb", "mi250-gcd") for method, zero, k in cells]
    rows.append(dict(model="llama-3.1-8b", device="a100-80gb", method="zero3", zero=3, status="error",
                     max_seq_len=None))
    rows.append(dict(model="hf:llama-3.1-8b", device="a100-80gb", method="ds-autosp", zero=1, status="found",
                     max_seq_len=80 * 1024))  # DeepSpeed's AutoSP runs on the HF variant: same row, labelled so
    rows += [dict(model="llama-3.2-1b", device="a100-80gb", method=method, zero=zero, status="found",
                  max_seq_len=k * 1024) for method, zero, k in cells]
    frame = pd.DataFrame(rows).astype({"max_seq_len": "Int64"})  # as trainability_table gives it: NA where none
    lines = markdown_table(frame).splitlines()
    assert lines[0].split(" | ")[2:10] == ["autosp z0", "autosp z3", "ulysses z0", "ring z0", "ring z3", "fsdp z3",
                                           "zero3 z3", "ds-autosp (hf) z1"]
    a100, mi250 = lines[3].split(" | "), lines[4].split(" | ")
    assert a100[2:4] == ["64K", "96K"] and a100[8:10] == ["error", "80K"] and mi250[9] == ""
    # vs ring: its best stage (z3, like with like); zero3: error, no ratio
    assert a100[-6:] == ["3.00x (2.7x)", "2.00x (3x)", "-", "6.00x (5.6x)", "-", "- |"]  # no alst, no ac rows
    assert mi250[-6] == "3.00x (2.5x)"  # AMD: the paper's 2.5x
    assert lines[2].startswith("| llama-3.2-1b |")  # models by size, whatever their order in the rows
    assert lines[2].endswith("| 6.00x | - | - |")  # the 5.6x vs ZeRO-3 is the paper's claim for 8B only


def test_checkpointed_variants_and_alst_are_columns_of_their_own_with_autosps_ratio_to_them():
    """`ulysses[ac=layer]` beside plain `ulysses` (never in its place), alst on the HF variant; the paper's claimed
    ratio stays beside the plain baseline, the practical anchors get autosp/alst and autosp/ulysses[ac=layer]."""
    from autosp.experiments.tables import trainability_table

    records = [dict(kind="search", model="llama-3.1-8b", device="h100-80gb", device_name="h100-80gb", world_size=8,
                    memory_budget=None, mode="simulated", method=method, ac=ac, zero=3, status="found",
                    max_seq_len=k * 1024, first_oom_seq_len=None, floor_limit_seq_len=None,
                    achieved_over_limit=None, num_probes=2, timestamp="2026-12-02")
               for method, ac, k in (("autosp", "off", 400), ("ulysses", "off", 80), ("ulysses", "layer", 200))]
    records.append(dict(records[0], model="hf:llama-3.1-8b", method="alst", max_seq_len=800 * 1024))
    records = [dict(r, config={"ac": r.pop("ac")}) for r in records]  # where a record keeps it
    table = trainability_table(pd.json_normalize(records, sep="."))
    assert sorted(table["method"]) == ["alst", "autosp", "ulysses", "ulysses[ac=layer]"]
    autosp = table.set_index("method").loc["autosp"]
    assert autosp["vs_ulysses"] == 5.0 and autosp["vs_ulysses[ac=layer]"] == 2.0
    lines = markdown_table(table).splitlines()
    head, row = lines[0].split(" | "), lines[2].split(" | ")
    assert head[2:6] == ["autosp z3", "ulysses z3", "alst (hf) z3", "ulysses[ac=layer] z3"]
    assert row[2:6] == ["400K", "80K", "800K", "200K"]
    assert head[-2:] == ["autosp/alst", "autosp/ulysses[ac=layer] |"] and row[-2:] == ["0.50x", "2.00x |"]
    assert row[-6] == "5.00x (2.7x)"  # vs plain ulysses, beside the paper's claim (NVIDIA)


def test_a_variant_column_reads_back_from_the_markdown_table(tmp_path):
    from autosp.experiments.tables import simulated_table_rows

    (tmp_path / "t.md").write_text("| model | device | autosp z3 | ulysses[ac=layer] z3 | alst (hf) z3 |\n"
                                   "|---|---|---|---|---|\n"
                                   "| llama-3.1-8b | h100-80gb | 400K | 200K | 800K |\n\nworld size 8\n")
    rows = simulated_table_rows(tmp_path / "t.md")
    assert list(rows["method"]) == ["autosp", "ulysses[ac=layer]", "alst"] and list(rows["max_seq_len"]) == [
        409600, 204800, 819200]


def test_render_takes_the_committed_markdown_table_and_new_rows_a_later_cell_replacing_an_earlier(tmp_path):
    """`--render results/simulated_table.md new.jsonl`: the committed table's cells (its JSONL is not committed)
    plus new cells; an HF method's column keeps its `(hf)` label, and a cell of the later file replaces the
    table's."""
    (tmp_path / "t.md").write_text(
        "| model | device | autosp z3 | ds-autosp (hf) z1 | alst (hf) z3 |\n|---|---|---|---|---|\n"
        "| llama-3.1-8b | h100-80gb | 400K | 80K | error |\n\nworld size 8, bfloat16\n")
    new = dict(kind="search", model="hf:llama-3.1-8b", device="h100-80gb", device_name="h100-80gb", world_size=8,
               memory_budget=8e10, mode="simulated", method="alst", zero=3, status="found", max_seq_len=1600 * 1024,
               dtype="bfloat16", config={"ac": "off"})
    (tmp_path / "new.jsonl").write_text(json.dumps(new) + "\n")
    out = tmp_path / "out.md"
    assert main(["simulate-table", "--render", str(tmp_path / "t.md"), str(tmp_path / "new.jsonl"),
                 "--table-out", str(out)]) == 0
    head, row = (line.split(" | ") for line in out.read_text().splitlines()[:3:2])
    assert head[2:5] == ["autosp z3", "ds-autosp (hf) z1", "alst (hf) z3"] and row[2:5] == ["400K", "80K", "1600K"]
    assert "0.25x" in row  # autosp/alst
    assert "world size 8, bfloat16" in out.read_text()
    again = tmp_path / "again.md"  # the table alone, re-rendered: the same cells
    assert main(["simulate-table", "--render", str(out), "--table-out", str(again), "--allow-errors"]) == 0
    assert again.read_text().split("\n\n")[0] == out.read_text().split("\n\n")[0]


def test_the_paper_methods_compare_every_sp_method_at_autosps_zero_3_stage_too():
    """AutoSP's default (the planner, ZeRO 3 at 8 ranks) and the paper's setting at both stages, each its own column."""
    assert {"autosp", "autosp[paper]:0", "autosp[paper]:3", "ulysses:3", "ring:3"} <= set(PAPER_METHODS)


def test_render_relabels_an_old_tables_autosp_keeps_one_world_size_and_says_where_autosp_trains_less(tmp_path):
    """The paper table regenerated: an old table's `autosp` cells (the paper's setting then) read as
    `autosp[paper]`, the new rows of the default as `autosp`; rows of another world size and columns not in
    --methods left out; each cell where the default trains less than another column named under the table; the
    footnote gives the command that renders it again, and rendering the output again gives the same table."""
    from autosp.experiments.simulate.speed import TIME_MODEL

    (tmp_path / "old.md").write_text(
        "| model | device | autosp z0 | autosp z3 | ulysses z3 | fsdp z3 | alst (hf) z3 |\n"
        "|---|---|---|---|---|---|---|\n"
        "| llama-3.1-8b | a100-80gb | oom at min | 186K | 62K | 8K | 3216K |\n"
        "| llama-3.2-1b | a100-80gb | 252K | 302K | 174K | 24K | error |\n\nworld size 8, bfloat16\n")
    search = dict(kind="search", device="a100-80gb", device_name="a100-80gb", memory_budget=8e10, mode="simulated",
                  method="autosp", zero=3, status="found", dtype="bfloat16", config={"ac": "off"})
    rows = [dict(search, model="llama-3.1-8b", world_size=8, max_seq_len=4000 * 1024,
                 extra={"time": {"iteration_s": 4750.0, "tokens_per_s_per_gpu": 117.0, "time_model": TIME_MODEL}}),
            dict(search, model="llama-3.2-1b", world_size=8, max_seq_len=300 * 1024),
            dict(search, model="llama-3.1-8b", world_size=1, max_seq_len=400 * 1024),  # another table's
            dict(search, model="llama-3.1-8b", world_size=8, method="ring", max_seq_len=60 * 1024),
            dict(search, model="llama-3.1-8b", world_size=8, method="ulysses", status="oom_at_min_len",
                 max_seq_len=None,  # no length, so no time: the step of the probe that did not fit is not its time
                 extra={"time": {"iteration_s": 0.7, "tokens_per_s_per_gpu": 343.0, "time_model": TIME_MODEL}})]
    (tmp_path / "new.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.md"
    args = ["simulate-table", "--render", str(tmp_path / "old.md"), str(tmp_path / "new.jsonl"),
            "--relabel", "autosp=autosp[paper]", "--methods", "autosp,autosp[paper],ulysses:3,alst",
            "--world-size", "8", "--table-out", str(out), "--allow-errors"]
    assert main(args) == 0
    text = out.read_text()
    lines = text.splitlines()
    head = lines[0].split(" | ")
    assert head[2:6] == ["autosp z3", "autosp[paper] z0", "autosp[paper] z3", "ulysses z3"]
    assert "ring z3" not in head and "fsdp z3" not in head  # not in --methods
    rows8 = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines[2:4]}
    assert rows8["llama-3.1-8b"][2:5] == ["4000K", "oom at min", "186K"]  # the world size 1 row left out
    assert rows8["llama-3.1-8b"][head.index("autosp/alst")] == "1.24x"
    times = text.split("Predicted iteration time")[1].split("\n\n")[1].splitlines()
    assert times == ["| model | device | autosp z3 |", "|---|---|---|",  # only the cell with a prediction
                     "| llama-3.1-8b | a100-80gb | 4.75e+03 s, 117 tok/s/GPU at 4000K |"]
    assert ("Where autosp (its default, the planner) trains less than another column: "
            "llama-3.2-1b a100-80gb: autosp[paper] 302K > autosp 300K.") in text
    assert "rendered with `autosp simulate-table --render" in text and "--relabel=autosp=autosp[paper]" in text
    again = tmp_path / "again.md"  # the output read back (its autosp column is the default's): the same table
    assert main(["simulate-table", "--render", str(out), "--table-out", str(again), "--allow-errors"]) == 0
    assert again.read_text().split("\n\n")[0] == text.split("\n\n")[0]
    assert main(["simulate-table", "--relabel", "autosp", "--render", str(out), "--table-out", str(again)]) == 2
    assert main(["simulate-table", "--relabel", "autosp=autosp[paper]", "--table-out", str(again)]) == 2


def test_simulate_table_cli_writes_rows_and_the_table(tmp_path, capsys):
    sim.extrapolate._PREDICTIONS.clear()
    out, table = tmp_path / "rows.jsonl", tmp_path / "table.md"
    args = ["simulate-table", "--models", "tiny", "--methods", "ring:0,ulysses", "--devices", "a100-80gb,mi250-gcd",
            "--world-size", "2", "--dtype", "float32", "--granularity", "512", "--max-len", "1024", "--jobs", "1",
            "--out", str(out), "--table-out", str(table)]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["method"], r["zero"], r["device"]) for r in rows] == [  # ulysses (default z3): FSDP2 on fake tensors
        ("ring", 0, "a100-80gb"), ("ring", 0, "mi250-gcd"), ("ulysses", 3, "a100-80gb"), ("ulysses", 3, "mi250-gcd")]
    assert rows[0]["status"] == "no_oom_up_to_max_len" and rows[0]["mode"] == "simulated"
    assert rows[1]["extra"]["cell_simulated_lengths"] == 1  # the second device type reused the first's probe
    text = table.read_text()
    assert "| tiny | a100-80gb | >=1K | >=1K |" in text and "CPU" in text
    assert "Predicted iteration time" in text  # each cell's step at its longest length, beside the lengths
    assert [line for line in text.splitlines() if line.startswith("| tiny | mi250-gcd |")][-1].count("tok/s/GPU") == 2
    rendered = tmp_path / "rendered.md"  # the same table again from the rows alone, no simulation
    assert main(["simulate-table", "--render", str(out), "--table-out", str(rendered), "--allow-errors"]) == 0
    assert rendered.read_text().split("\n\n")[0] == text.split("\n\n")[0]
    assert main(["simulate-table", "--methods", "autosp:x", "--out", str(out), "--table-out", str(table)]) == 2
    capsys.readouterr()


def test_the_costliest_cells_start_first():
    """Longest-processing-time first so the workers finish together: DeepSpeed's AutoSP, ZeRO-3 (whole depth,
    deepest first), then autosp's compiled cells, then the eager baselines (the table's cells at c4116db: 110-145 /
    36-124 / 30-41 / 3-20 CPU-s)."""
    from autosp.experiments.simulate.table import cell_configs, cell_order

    configs = cell_configs(["llama-3.2-1b", "llama-2-13b"], ["ulysses:0", "autosp:3", "zero3", "ds-autosp"],
                           world_size=8, dtype="bfloat16")
    order = [(cfg.method, cfg.model) for _, cfg in cell_order(configs)]
    assert order[:4] == [("ds-autosp", "hf:llama-2-13b"), ("ds-autosp", "hf:llama-3.2-1b"), ("zero3", "llama-2-13b"),
                         ("zero3", "llama-3.2-1b")]
    assert [method for method, _ in order[4:]] == ["autosp", "autosp", "ulysses", "ulysses"]


def test_a_method_spec_sets_its_own_options_and_is_a_column_of_its_own_against_alst(tmp_path):
    """`autosp[sac=auto,tiling=auto:16384,offload=auto+optimizer]:3`: the planner's levers as one column beside
    plain autosp (never in its place), its stage after the brackets, `+` for a list value, its ratio to alst; the
    column reads back from the Markdown table and a later file's cell replaces it, not plain autosp's."""
    from autosp.experiments.simulate.table import cell_configs, parse_method
    from autosp.experiments.tables import trainability_table

    spec = "autosp[sac=auto,tiling=auto:16384,offload=auto+optimizer]"
    assert parse_method(f"{spec}:3") == (spec, 3) and parse_method(spec) == (spec, None)
    (label, cfg), (plain, _) = cell_configs(["llama-3.1-8b"], [f"{spec}:3", "autosp:3"], world_size=8,
                                            dtype="bfloat16")
    assert (label, plain) == (spec, "autosp")
    assert (cfg.method, cfg.zero, cfg.sac, cfg.tiling, cfg.offload) == ("autosp", 3, "auto", "auto:16384",
                                                                       "auto,optimizer")
    records = [dict(kind="search", model=model, device="a100-80gb", device_name="a100-80gb", world_size=8,
                    memory_budget=None, mode="simulated", method=method, zero=3, status="found", max_seq_len=k * 1024,
                    first_oom_seq_len=None, floor_limit_seq_len=None, achieved_over_limit=None, num_probes=2,
                    timestamp="2026-12-03", **extra)
               for model, method, k, extra in (("llama-3.1-8b", "autosp", 200, {}),
                                               ("llama-3.1-8b", "autosp", 4000, {"method_spec": spec}),
                                               ("hf:llama-3.1-8b", "alst", 3200, {}))]
    lines = markdown_table(trainability_table(pd.DataFrame(records))).splitlines()
    head, row = lines[0].split(" | "), lines[2].split(" | ")
    assert head[2:5] == ["autosp z3", "alst (hf) z3", f"{spec} z3"] and row[2:5] == ["200K", "3200K", "4000K"]
    assert head[-1] == f"{spec}/alst |" and row[-1] == "1.25x |"
    assert row[head.index("autosp/alst")] == "0.06x"  # plain autosp keeps its own ratio
    (tmp_path / "t.md").write_text("\n".join(lines) + "\n\nworld size 8, bfloat16\n")
    later = dict(records[1], max_seq_len=4400 * 1024, config={"ac": "off"})
    (tmp_path / "new.jsonl").write_text(json.dumps(later) + "\n")
    out = tmp_path / "out.md"
    assert main(["simulate-table", "--render", str(tmp_path / "t.md"), str(tmp_path / "new.jsonl"),
                 "--table-out", str(out)]) == 0
    head, row = (line.split(" | ") for line in out.read_text().splitlines()[:3:2])
    assert row[head.index(f"{spec} z3")] == "4400K" and row[head.index("autosp z3")] == "200K"
    from autosp.experiments.tables import headline_table, simulated_table_rows

    headline = headline_table(trainability_table(simulated_table_rows(tmp_path / "t.md")))  # the README's table
    # the headline shows AutoSP as it runs by default; a spec of its own options stays in the full table
    assert list(headline[["autosp", "alst", "autosp / strongest peer"]].iloc[0]) == ["200K", "3200K", "0.06x"]
    assert spec not in headline


def test_a_searched_cells_rows_carry_the_specs_label_only_where_it_has_options_of_its_own(monkeypatch):
    from autosp.experiments.simulate import table as simulate_table

    monkeypatch.setattr(sim, "simulated_search", lambda cfg, device, **kw: {"extra": {}, "device": device.name})
    (spec, cfg), (variant, checkpointed) = simulate_table.cell_configs(
        ["tiny"], ["autosp[sac=auto]:3", "ulysses[ac=layer]:3"], world_size=2, dtype="float32")
    assert [r.get("method_spec") for r in simulate_table.search_cell(spec, cfg, ["a100-80gb"], None, 1024)] == [spec]
    assert [r.get("method_spec") for r in simulate_table.search_cell(variant, checkpointed, ["a100-80gb"], None,
                                                                     1024)] == [None]


def test_a_single_simulated_length_that_fits_renders_as_a_lower_bound_in_its_specs_column(tmp_path):
    """`autosp simulate --seq-len N` records that fit fill their spec's cell as `>=N`, with `>=` ratios; an oom
    one fills nothing; the longest fitting length wins; a search's answer is never replaced by a shorter bound."""
    from autosp.harness.method_spec import parse_method_spec

    spec = "autosp[tiling=auto:16384,offload=auto+optimizer]"  # sac=auto: the default
    cfg = parse_method_spec(spec).config(RunConfig(method="-", model="llama-3.1-8b", seq_len=1, world_size=8,
                                                   dtype="bfloat16", zero=3))

    def probe(device, k, status):
        return dict(model="llama-3.1-8b", device=device, device_name=device, memory_budget=8e10, world_size=8,
                    dtype="bfloat16", mode="simulated", method="autosp", zero=3, status=status, seq_len=k * 1024,
                    config=cfg.to_dict(), timestamp="2026-12-03")

    alst = dict(kind="search", model="hf:llama-3.1-8b", memory_budget=8e10, world_size=8, dtype="bfloat16",
                mode="simulated", method="alst", zero=3, status="found", config={"ac": "off"}, timestamp="2026-12-03")
    records = [probe("a100-80gb", 3216, "ok"), probe("a100-80gb", 3000, "ok"), probe("a100-80gb", 4000, "oom"),
               dict(alst, device="a100-80gb", device_name="a100-80gb", max_seq_len=3216 * 1024),
               probe("mi250-gcd", 1000, "ok"),
               dict(alst, device="mi250-gcd", device_name="mi250-gcd", max_seq_len=1448 * 1024),
               probe("gh200-96gb", 2000, "ok"),
               dict(probe("gh200-96gb", 0, "found"), kind="search", method_spec=spec, max_seq_len=2500 * 1024)]
    (tmp_path / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out.md"
    assert main(["simulate-table", "--render", str(tmp_path / "probes.jsonl"), "--table-out", str(out),
                 "--allow-errors"]) == 0
    lines = out.read_text().split("\n\n")[0].splitlines()
    head = lines[0].split(" | ")
    rows = {line.split(" | ")[1]: line.split(" | ") for line in lines[2:]}
    column, ratio = head.index(f"{spec} z3"), head.index(f"{spec}/alst |")
    assert rows["a100-80gb"][column] == ">=3216K" and rows["a100-80gb"][ratio] == ">=1.00x |"
    assert rows["mi250-gcd"][column] == ">=1000K" and rows["mi250-gcd"][ratio] == ">=0.69x |"
    assert rows["gh200-96gb"][column] == "2500K"  # the search's answer, not the probe's shorter length
    from autosp.experiments.tables import headline_table, simulated_table_rows, trainability_table

    headline = headline_table(trainability_table(simulated_table_rows(out))).set_index("setting")  # README's table
    assert headline.loc["simulated: a100-80gb, 8 ranks", "alst"] == "3216K" and spec not in headline


def test_a_later_single_length_at_a_searchs_answer_reprices_its_step_and_an_earlier_time_model_says_so(tmp_path):
    """`autosp simulate --seq-len N` at a search's answer, in a later file (or later in the same one) and of the
    same configuration, gives the cell its predicted step; the length stays the search's. A prediction without
    `time_model` (the time model before 69cbb22) is marked in the time table, with what that model left out."""
    from autosp.experiments.simulate.speed import EARLIER_TIME_MODELS, TIME_MODEL

    config = dict(method="alst", model="hf:llama-3.1-8b", dtype="bfloat16", ac="off", seq_len=3204 * 1024)

    def record(device, seconds, *, version=None, **fields):
        time = dict(iteration_s=seconds, tokens_per_s_per_gpu=3204 * 1024 / seconds / 8,
                    **({"time_model": version} if version else {}))
        return dict(dict(model="hf:llama-3.1-8b", device=device, device_name=device, memory_budget=8e10,
                         world_size=8, dtype="bfloat16", mode="simulated", method="alst", zero=3, status="ok",
                         seq_len=3204 * 1024, config=config, timestamp="2026-12-05", extra={"time": time}), **fields)

    def search(device, seconds):
        return record(device, seconds, kind="search", status="found", max_seq_len=3204 * 1024, num_probes=2,
                      first_oom_seq_len=None, floor_limit_seq_len=None, achieved_over_limit=None)

    old = [record("h200-141gb", 9.0, version=TIME_MODEL),  # before its search: re-prices nothing
           search("h100-80gb", 4640.0), search("h200-141gb", 15100.0), search("a100-80gb", 4000.0),
           search("gh200-96gb", 5000.0), record("gh200-96gb", 9000.0, version=TIME_MODEL)]
    new = [record("h100-80gb", 9100.0, version=TIME_MODEL),
           dict(record("a100-80gb", 7.0, version=TIME_MODEL), seq_len=3000 * 1024),  # another length: a bound
           dict(record("h200-141gb", 8.0, version=TIME_MODEL), config=dict(config, dtype="float32"))]
    (tmp_path / "old.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    (tmp_path / "new.jsonl").write_text("".join(json.dumps(r) + "\n" for r in new))
    out = tmp_path / "out.md"
    assert main(["simulate-table", "--render", str(tmp_path / "old.jsonl"), str(tmp_path / "new.jsonl"),
                 "--table-out", str(out)]) == 0
    lengths, _, times, note, *_ = out.read_text().split("\n\n")
    assert all(line.split(" | ")[2] == "3204K" for line in lengths.splitlines()[2:])  # every search's length
    cells = {line.split(" | ")[1]: line.split(" | ")[2] for line in times.splitlines()[2:]}
    assert cells == {"a100-80gb": "4e+03 s, 103 tok/s/GPU at 3204K (time model 1) |",
                     "gh200-96gb": "9e+03 s, 46 tok/s/GPU at 3204K |",
                     "h100-80gb": "9.1e+03 s, 45 tok/s/GPU at 3204K |",
                     "h200-141gb": "1.51e+04 s, 27 tok/s/GPU at 3204K (time model 1) |"}
    assert note == (f"(time model 1): predicted by time model 1, which {EARLIER_TIME_MODELS[1]}; not simulated "
                    "again since.")


#: the commit that made each time model after the first (a record made at or after it carries that version)
TIME_MODEL_COMMITS = {2: "69cbb22"}


def test_every_committed_record_says_the_time_model_its_commit_ran():
    """A record without `extra.time.time_model` is read as model 1 (the table marks it so), which is wrong for one
    made by a later model before the field existed (69cbb22 made model 2; the field came in 4203f5e). Each committed
    record's version is checked against its `git_commit`'s history; a dirty record may say a newer model than its
    commit (its working tree may have held the change), and a commit missing from the history is reported."""
    from autosp.experiments.simulate.speed import TIME_MODEL

    root = Path(__file__).resolve().parents[2]
    assert max(TIME_MODEL_COMMITS) == TIME_MODEL, "a new time model: add the commit that made it"

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)

    if git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("needs the whole git history (a shallow clone, or no repository)")

    def version_of(commit: str) -> int | None:
        """The newest time model whose commit `commit` contains; None: `commit` is not in this history."""
        versions = [1]
        for version, made in TIME_MODEL_COMMITS.items():
            code = git("merge-base", "--is-ancestor", made, commit).returncode
            if code not in (0, 1):
                return None
            versions += [version] * (code == 0)
        return max(versions)

    checked, wrong, cache = 0, [], {}
    for path in sorted([*root.glob("docs/measurements/*.jsonl"), *root.glob("results/**/*.jsonl")]):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            record = json.loads(line) if line.strip() else {}
            time = (record.get("extra") or {}).get("time")
            if not time or not record.get("git_commit"):
                continue
            commit = record["git_commit"]
            if commit not in cache:
                cache[commit] = version_of(commit)
            said, ran = time.get("time_model", 1), cache[commit]
            if ran is None:
                wrong.append(f"{path.name}:{number}: its commit {commit[:9]} is not in this history")
            elif said < ran or (said > ran and not record.get("git_dirty")):
                wrong.append(f"{path.name}:{number} says time model {said}, its commit {commit[:9]} ran {ran}")
            checked += 1
    assert checked > 10 and not wrong, wrong
