"""Tables from records (trainability ratios, throughput spread and speed ratios, paper claims) and the
figures drawn from them (autosp.experiments.plots)."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from autosp.experiments.plots import _method_legend_label, throughput_figure, trainability_figure, trainability_ratios
from autosp.experiments.tables import (
    headline_table,
    paper_claims,
    simulated_table_rows,
    throughput_table,
    trainability_table,
    write_csv_atomic,
)
from autosp.harness.config import ConfigError

MiB = 2**20


def search_row(method: str, max_len: int | None, *, model: str = "tiny", ts: str = "2026-01-01T00:00:00",
               status: str = "found", budget: float = 64 * MiB) -> dict:
    return {
        "kind": "search", "method": method, "model": model, "world_size": 2, "device": "cpu",
        "memory_budget": budget, "status": status, "max_seq_len": max_len,
        "first_oom_seq_len": None if max_len is None else max_len + 512, "floor_limit_seq_len": 8192,
        "achieved_over_limit": None if max_len is None else max_len / 8192, "num_probes": 7, "timestamp": ts,
    }


def run_row(method: str, seq_len: int, t: float, *, status: str = "ok") -> dict:
    return {"method": method, "model": "tiny", "world_size": 2, "device": "cpu", "seq_len": seq_len,
            "status": status, "iter_time_s.median": t, "tokens_per_s": seq_len / t, "peak_mem_bytes": 1000,
            "timestamp": "2026-01-01T00:00:00"}


def test_trainability_ratios_to_each_baseline_within_a_setting() -> None:
    records = pd.DataFrame([
        search_row("autosp", 6144), search_row("ulysses", 2048), search_row("zero3", 1024),
        search_row("ds-autosp", 4096),
        search_row("autosp", 20480, model="small"), search_row("ulysses", 10240, model="small"),
        {"method": "autosp", "model": "tiny", "status": "ok", "seq_len": 6144},  # a probe record: ignored
    ])
    t = trainability_table(records).set_index(["model", "method"])
    assert t.loc[("tiny", "autosp"), "vs_ulysses"] == pytest.approx(3.0)
    assert t.loc[("tiny", "autosp"), "vs_zero3"] == pytest.approx(6.0)
    assert t.loc[("tiny", "autosp"), "vs_ds-autosp"] == pytest.approx(1.5)
    assert t.loc[("tiny", "ulysses"), "vs_ulysses"] == pytest.approx(1.0)
    assert t.loc[("small", "autosp"), "vs_ulysses"] == pytest.approx(2.0)  # not mixed with tiny's ulysses
    assert math.isnan(t.loc[("small", "autosp"), "vs_zero3"])  # zero3 not measured for small
    assert t.loc[("tiny", "autosp"), "achieved_over_limit"] == pytest.approx(0.75)


def test_the_peak_slope_is_fitted_through_the_probes_that_ran() -> None:
    # 3 KiB per token plus 1 MiB through the probes that ran; the oom probe (cut short on a GPU) does not pull it
    probes = [{"seq_len": s, "peak_mem_bytes": MiB + 3072 * s, "status": "ok"} for s in (512, 4096, 6144)]
    records = pd.DataFrame([
        {**search_row("autosp", 6144), "device": "cuda",
         "probes": probes + [{"seq_len": 6656, "peak_mem_bytes": MiB, "status": "oom"}]},
        {**search_row("ulysses", 512), "device": "cuda", "probes": probes[:1]},  # one length: no slope
    ])
    t = trainability_table(records).set_index("method")
    assert t.loc["autosp", "peak_bytes_per_token"] == pytest.approx(3072)
    assert math.isnan(t.loc["ulysses", "peak_bytes_per_token"])
    # under the CPU's emulated budget an oom probe ran its whole step: a guided search's two probes give the slope
    guided = [probes[-1], {"seq_len": 6656, "peak_mem_bytes": MiB + 3072 * 6656, "status": "oom"}]
    cpu = pd.DataFrame([{**search_row("autosp", 6144), "device": "cpu", "probes": guided}])
    assert trainability_table(cpu).loc[0, "peak_bytes_per_token"] == pytest.approx(3072)


def test_latest_search_supersedes_and_budgets_are_separate_settings() -> None:
    records = pd.DataFrame([
        search_row("ulysses", 1024, ts="2026-01-01T00:00:00"),
        search_row("ulysses", 2048, ts="2026-01-02T00:00:00"),
        search_row("ulysses", 4096, budget=128 * MiB),
    ])
    t = trainability_table(records)
    assert sorted(t["max_seq_len"]) == [2048, 4096]


def test_failed_search_keeps_its_status_and_no_search_is_a_config_error() -> None:
    t = trainability_table(pd.DataFrame([search_row("ring", None, status="error"), search_row("ulysses", 2048)]))
    ring = t[t["method"] == "ring"].iloc[0]
    assert ring["status"] == "error" and math.isnan(ring["vs_ulysses"])
    with pytest.raises(ConfigError, match="autosp search"):
        trainability_table(pd.DataFrame([run_row("autosp", 1024, 1.0)]))


def test_throughput_spread_over_repeats_and_speed_ratio() -> None:
    records = pd.DataFrame([
        run_row("ulysses", 1024, 1.0), run_row("ulysses", 1024, 1.2), run_row("ulysses", 1024, 0.8),
        run_row("autosp", 1024, 2.0), run_row("autosp", 1024, 2.2), run_row("autosp", 1024, 1.8),
        run_row("autosp", 1024, 0.01, status="error"),  # failed runs are not timed
        run_row("autosp", 2048, 3.0),
    ])
    t = throughput_table(records, reference="ulysses").set_index(["seq_len", "method"])
    row = t.loc[(1024, "autosp")]
    assert (row["repeats"], row["iter_time_s"], row["iter_time_min_s"], row["iter_time_max_s"]) == (3, 2.0, 1.8, 2.2)
    assert row["speed_vs_ulysses"] == pytest.approx(0.5)
    assert row["tokens_per_s_vs_ulysses"] == pytest.approx(0.5)  # same tokens per step here
    assert math.isnan(t.loc[(2048, "autosp"), "speed_vs_ulysses"])


def test_paper_claims_load_from_the_package() -> None:
    claims = paper_claims()
    row = claims.set_index("claim_id").loc["trainability_vs_ulysses_nvidia"]
    assert row["factor"] == pytest.approx(2.7) and row["metric"] == "max_trainable_seq_len_ratio"


def test_csv_written_atomically(tmp_path) -> None:
    out = tmp_path / "sub" / "t.csv"
    write_csv_atomic(pd.DataFrame({"a": [1]}), out)
    assert out.read_text().splitlines() == ["a", "1"]
    assert [p.name for p in out.parent.iterdir()] == ["t.csv"]



def test_trainability_figure_and_its_ratios(tmp_path) -> None:
    table = trainability_table(pd.DataFrame([
        search_row("autosp", 6144), search_row("ulysses", 2048), search_row("zero3", 1024),
        search_row("ring", None, status="error"),
    ]))
    ratios = trainability_ratios(table, paper_claims()).set_index("baseline")
    assert ratios.loc["ulysses", "ratio"] == 3.0 and ratios.loc["zero3", "ratio"] == 6.0
    assert "ring" not in ratios.index  # its search failed
    assert "2.7x NVIDIA" in ratios.loc["ulysses", "claim"] and "5.6x" in ratios.loc["zero3", "claim"]
    out = tmp_path / "t.png"
    trainability_figure(table, out)
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_only_compiled_methods_name_a_compile_backend() -> None:
    rows = [dict(search_row(m, 4096), compile_backend="inductor") for m in ("autosp", "ulysses", "zero3")]
    backends = trainability_table(pd.DataFrame(rows)).set_index("method")["compile_backend"]
    assert backends["autosp"] == "inductor"
    assert pd.isna(backends["ulysses"]) and pd.isna(backends["zero3"])  # eager baselines: no backend


SIMULATED_MD = """| model | device | autosp z0 | autosp z3 | ulysses z3 | ds-autosp (hf) z1 | autosp/ulysses (paper) |
|---|---|---|---|---|---|---|
| llama-3.1-8b | a100-80gb | oom at min | 186K | 62K | 64K | 3.00x (2.7x) |
| llama-3.1-8b | mi250-gcd | oom at min | >=142K | 48K | error | 2.96x (2.5x) |

36 cells x 3 device types, world size 8, bfloat16: 526 s wall. Simulated (`autosp simulate-table`), not measured.
"""


def test_the_simulated_markdown_table_reads_back_as_search_rows(tmp_path) -> None:
    path = tmp_path / "simulated_table.md"
    # the predicted times follow as a table of their own (`simulate.table.time_markdown_table`): not lengths
    path.write_text(SIMULATED_MD.replace("\n\n", "\n\nPredicted iteration time:\n\n| model | device | autosp z3 |\n"
                                         "|---|---|---|\n| llama-3.1-8b | a100-80gb | 33.4 s, 988 tok/s/GPU at 186K |"
                                         "\n\n", 1))
    rows = simulated_table_rows(path).set_index(["device", "method", "zero"])
    assert len(rows) == 8  # 2 rows x 4 length columns, none from the times' table
    assert rows.loc[("a100-80gb", "autosp", 3), "max_seq_len"] == 186 * 1024
    assert rows.loc[("a100-80gb", "autosp", 0), "status"] == "oom_at_min_len"
    assert rows.loc[("mi250-gcd", "autosp", 3), "status"] == "no_oom_up_to_max_len"
    assert rows.loc[("mi250-gcd", "ds-autosp", 1), "status"] == "error"
    assert set(rows["mode"]) == {"simulated"} and set(rows["world_size"]) == {8}
    assert set(rows.reset_index()["model"]) == {"llama-3.1-8b"}  # the HF-variant column keeps the row's model
    with pytest.raises(ConfigError, match="no `autosp simulate-table` table"):
        (tmp_path / "other.md").write_text("# notes\n")
        simulated_table_rows(tmp_path / "other.md")


def test_headline_table_labels_measured_and_simulated_rows(tmp_path, capsys) -> None:
    import json

    from autosp.cli import main

    (tmp_path / "sim.md").write_text(SIMULATED_MD)
    records = tmp_path / "search.jsonl"
    rows = [dict(search_row("autosp", 16384, model="hf:tiny"), zero=3, device_name="AMD EPYC 7B13"),
            dict(search_row("ds-autosp", 11264, model="hf:tiny"), zero=0),
            dict(search_row("autosp", 18432), zero=3), dict(search_row("ulysses", 4608), zero=3)]
    records.write_text("".join(json.dumps(dict(row, schema_version=1, run_id=str(i))) + "\n"
                               for i, row in enumerate(rows)))
    measured = trainability_table(pd.DataFrame(rows))
    simulated = trainability_table(simulated_table_rows(tmp_path / "sim.md"))
    table = headline_table(pd.concat([measured, simulated], ignore_index=True))
    assert len(table.columns) <= 8  # the README's headline: AutoSP, the strongest peer of each class, one ratio
    rows = table.set_index(["model", "setting"])
    tiny = rows.loc[("tiny", "measured: cpu, 2 ranks, 64 MiB")]
    assert tiny["autosp"] == "18K" and tiny["hand-written SP"] == "4.5K (ulysses)"
    assert tiny["autosp / strongest peer"] == "4.00x"
    assert rows.loc[("hf:tiny", "measured: cpu, 2 ranks, 64 MiB"), "autosp / strongest peer"] == "1.45x"  # ds-autosp
    a100 = rows.loc[("llama-3.1-8b", "simulated: a100-80gb, 8 ranks")]
    assert a100["autosp"] == "186K" and a100["ds-autosp"] == "64K" and a100["autosp / strongest peer"] == "2.91x"
    # a method that failed there (refused, crashed) is an error, not a length that does not fit
    assert rows.loc[("llama-3.1-8b", "simulated: mi250-gcd, 8 ranks"), "ds-autosp"] == "error"
    assert "alst" not in table  # a class column only where one of its methods has records
    assert main(["table", "headline", "--in", str(tmp_path / "sim.md"), str(records), "--devices", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| model | setting | autosp |") and "a100" not in out and "| tiny | measured: cpu" in out


def test_the_headlines_lower_bounds_carry_into_its_ratio_and_a_peers_bound_leaves_it_unknown() -> None:
    rows = [dict(search_row("autosp", 8192), status="no_oom_up_to_max_len"), search_row("ulysses", 4096),
            dict(search_row("ds-autosp", 2048, model="tiny")), dict(search_row("autosp", 4096, model="small")),
            dict(search_row("ulysses[ac=layer]", 8192, model="small"), status="no_oom_up_to_max_len")]
    rows = headline_table(trainability_table(pd.DataFrame(rows))).set_index("model")
    assert rows.loc["tiny", "autosp"] == ">=8K" and rows.loc["tiny", "autosp / strongest peer"] == ">=2.00x"
    assert rows.loc["small", "hand-written SP"] == ">=8K (ulysses[ac=layer])"
    assert rows.loc["small", "autosp / strongest peer"] == ""


def test_throughput_figure(tmp_path) -> None:
    table = throughput_table(pd.DataFrame([run_row(m, s, t * s / 1024) for m, t in (("ulysses", 1.0), ("autosp", 1.1))
                                           for s in (1024, 2048)]))
    out = tmp_path / "tp.png"
    throughput_figure(table, out)
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("command,message", [
    (["table", "trainability", "--in", "{tmp}/missing.jsonl"], "cannot read records file {tmp}/missing.jsonl"),
    (["table", "throughput", "--in", "{tmp}/torn.jsonl"], "{tmp}/torn.jsonl:1: not a JSON record"),
    (["plot", "trainability", "--in", "{tmp}/torn.jsonl", "--out", "{tmp}/f.png"], "{tmp}/torn.jsonl:1: not a JSON"),
    (["plot", "trainability", "--in", "{tmp}/missing.jsonl", "--out", "{tmp}/f.png"], "cannot read records file"),
    (["table", "trainability", "--in", "{tmp}/torn.jsonl", "--out", "{tmp}/torn.jsonl/t.csv"],
     "cannot write --out {tmp}/torn.jsonl/t.csv: {tmp}/torn.jsonl is a file, not a folder"),
    (["plot", "trainability", "--in", "{tmp}/torn.jsonl", "--out", "{tmp}/x.xyz"], "cannot write a figure as 'xyz'"),
    (["plot", "simulated", "--in", "{tmp}/torn.jsonl", "--out", "{tmp}/f.png"], "no `autosp simulate-table` table"),
    (["plot", "simulated", "--in", "{tmp}/missing.md", "--out", "{tmp}/f.png"], "cannot read {tmp}/missing.md"),
    (["table", "headline", "--in", "{tmp}/missing.md"], "cannot read {tmp}/missing.md"),
])
def test_bad_table_or_plot_input_is_one_line_and_exit_2(tmp_path, capsys, command, message) -> None:
    from autosp.cli import main

    (tmp_path / "torn.jsonl").write_text('{"status": "o')
    assert main([part.format(tmp=tmp_path) for part in command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(tmp=tmp_path) in err and "Traceback" not in err


def test_table_skips_and_reports_bad_lines_when_asked(tmp_path, capsys) -> None:
    from autosp.cli import main
    from autosp.harness.config import RunConfig
    from autosp.harness.records import append_record, new_record

    path = tmp_path / "runs.jsonl"
    path.write_text('{"status": "o\n')
    record = new_record(RunConfig(method="ulysses", model="tiny", seq_len=128, world_size=2), sp_size=2)
    record.update(status="ok", iter_time_s={"median": 0.5, "min": 0.4, "max": 0.6, "samples": [0.5]},
                  tokens_per_s=256.0, peak_mem_bytes=1)
    append_record(path, record)
    assert main(["table", "throughput", "--in", str(path), "--skip-bad-lines"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"skipped {path}:1: not a JSON record (") and captured.err.count("\n") == 1
    assert "ulysses" in captured.out


def test_each_zero_stage_is_its_own_row_and_ratios_compare_like_stages() -> None:
    rows = [dict(search_row(m, n), zero=z) for m, n, z in
            [("autosp", 4096, 0), ("autosp", 8192, 3), ("ulysses", 2048, 0), ("ulysses", 4096, 3), ("zero3", 1024, 3)]]
    t = trainability_table(pd.DataFrame(rows)).set_index(["method", "zero"])
    assert t.loc[("autosp", 0), "vs_ulysses"] == pytest.approx(2.0)  # vs ulysses at stage 0
    assert t.loc[("autosp", 3), "vs_ulysses"] == pytest.approx(2.0)  # vs ulysses at stage 3, not 4x
    assert t.loc[("autosp", 0), "vs_zero3"] == pytest.approx(4.0)  # zero3 runs only stage 3


def test_figure_legends_name_the_stage_each_method_ran() -> None:
    assert _method_legend_label("autosp", pd.DataFrame({"zero": [3], "compile_backend": ["aot_eager"]})) \
        == "autosp ZeRO-3 [aot_eager]"
    assert _method_legend_label("ulysses", pd.DataFrame({"zero": [0, 3]})) == "ulysses ZeRO-0/3"
    assert _method_legend_label("zero3", pd.DataFrame({"max_seq_len": [1]})) == "zero3"  # records without a stage


def test_alsts_published_lengths_stand_beside_the_alst_records_as_a_ratio(tmp_path, capsys) -> None:
    """arXiv 2506.13996: 500K on 1 H100, 3.7M on 8, 15M on 32 (Llama-3.1-8B); a search's longest length is put
    beside them as a ratio, a run at the published length with its status and peak; no record, empty cells."""
    import json

    from autosp.cli import main
    from autosp.experiments.tables import alst_published, alst_table

    headline = alst_published().query("kind == 'headline'")
    assert list(zip(headline["world_size"], headline["seq_len"], strict=True)) == [(1, 500_000), (8, 3_700_000),
                                                                                 (32, 15_000_000)]
    records = [dict(search_row("alst", 3_145_728, model="hf:llama-3.1-8b"), world_size=8, device="h100-80gb",
                    mode="simulated", seq_len=3_145_728),
               {"kind": None, "method": "alst", "model": "hf:llama-3.1-8b", "world_size": 1, "device": "h100-80gb",
                "mode": "simulated", "seq_len": 500_000, "status": "oom", "peak_mem_bytes": 90 * 2**30}]
    records.append(dict(records[1], seq_len=250_000, peak_mem_bytes=50 * 2**30, memory_budget=80 * 2**30))
    records[1]["memory_budget"] = 80 * 2**30
    table = alst_table(pd.DataFrame(records)).set_index("world_size")
    assert table.loc[1, "line_max_seq_len"] == 250_000 + 30 * 250_000 // 40  # 50 GiB at 250K, 90 at 500K: 80 at 437.5K
    assert table.loc[8, "max_over_published"] == pytest.approx(3_145_728 / 3_700_000)
    assert table.loc[1, "at_published"] == "oom" and table.loc[1, "peak_at_published_gib"] == 90
    assert pd.isna(table.loc[32, "max_seq_len"]) and table.loc[32, "published"] == 15_000_000
    path = tmp_path / "alst.jsonl"
    path.write_text("".join(json.dumps(dict(r, schema_version=1, run_id=str(i))) + "\n" for i, r in enumerate(records)))
    assert main(["table", "alst", "--in", str(path)]) == 0
    assert "3700000" in capsys.readouterr().out


def test_the_published_peers_are_data_with_their_sources(capsys) -> None:
    """ALST (1/8/32 H100 and 1 H200), UPipe (8 and 16 H100) and torchtitan's 8B context-parallel throughput, each row
    with its source; `autosp table peers` prints them without records, the other kinds still need --in."""
    from autosp.cli import main
    from autosp.experiments.tables import peers_published

    peers = peers_published()
    anchors = {(r.peer, r.device, r.world_size): r.seq_len for r in peers.itertuples()}
    assert anchors == {("alst", "h100-80gb", 1): 500_000, ("alst", "h100-80gb", 8): 3_700_000,
                       ("alst", "h100-80gb", 32): 15_000_000, ("alst", "h200-141gb", 1): 1_200_000,
                       ("upipe", "h100-80gb", 8): 5_000_000, ("upipe", "h100-80gb", 16): 8_000_000,
                       ("torchtitan", "h100-96gb", 8): 262_144}
    assert peers["source"].str.len().min() > 20
    assert peers.set_index("peer").loc["torchtitan", "tokens_per_s_per_gpu"] == 548
    assert main(["table", "peers"]) == 0
    assert "arXiv 2602.21196" in capsys.readouterr().out
    assert main(["table", "alst"]) == 2
    assert "needs --in FILES" in capsys.readouterr().err


def test_a_throughput_anchor_gets_our_tokens_per_second_at_its_length_on_the_same_chip() -> None:
    """torchtitan's 548 tokens/s/GPU (8B, 262,144 tokens, 8 H100 96GB): beside it our latest run that fit at that length
    on the same chip (the catalogue's h100-80gb), predicted (`extra.time`) or measured (tokens/s over the GPUs), and
    autosp's ratio of tokens/s; a run at another length or GPU count, or a search, is not its speed, and a measured
    run outranks a later prediction."""
    from autosp.experiments.tables import peers_table

    def run(method: str, tokens_per_s_per_gpu: float, **fields) -> dict:
        return dict(dict(run_row(method, 262_144, 1.0), model="llama-3.1-8b", device="h100-80gb", world_size=8,
                         mode="simulated", timestamp="2026-02-01T00:00:00",
                         **{"extra.time.tokens_per_s_per_gpu": tokens_per_s_per_gpu}), **fields)

    records = pd.DataFrame([
        run("autosp", 2_000.0, timestamp="2026-01-01T00:00:00"),  # an earlier prediction: the later one stands
        run("autosp", 1_096.0),
        run("autosp", 5_000.0, seq_len=131_072), run("autosp", 5_000.0, world_size=4),
        dict(search_row("autosp", 6_498_304, model="llama-3.1-8b"), device="h100-80gb", world_size=8),
        run("alst", float("nan"), mode="measured", model="hf:llama-3.1-8b", tokens_per_s=8 * 500.0,
            timestamp="2026-01-01T00:00:00"),
        run("alst", 900.0),  # a later prediction of the same cell: the measurement stands
    ])
    row = peers_table(records).set_index("peer").loc["torchtitan"]
    assert row["autosp (ours)"] == "1,096 tokens/s/GPU (predicted, h100-80gb)"
    assert row["autosp / published"] == "2.00x tokens/s"
    assert row["alst (ours)"] == "500 tokens/s/GPU (measured, h100-80gb)"


def test_our_longest_lengths_stand_beside_the_published_peers_with_autosps_ratio() -> None:
    """`autosp table peers --in RECORDS`: autosp's search answer at each anchor's model (or one of the same shapes),
    device and GPU count, its ratio to the published length; alst's runs that fit as `>=` lower bounds; nothing beside
    a throughput anchor's ratio (a length it ran at, not its longest)."""
    from autosp.experiments.tables import peers_table

    records = pd.DataFrame([
        dict(search_row("autosp", 4_458_496, model="llama-3.1-8b"), device="h100-80gb", world_size=8),
        dict(search_row("autosp", 18_866_176, model="llama-3.1-8b"), device="h100-80gb", world_size=32),
        dict(run_row("alst", 524_288, 1.0), model="hf:llama-3.1-8b", device="h100-80gb", world_size=8),
        dict(run_row("alst", 3_700_000, 1.0, status="oom"), model="hf:llama-3.1-8b", device="h100-80gb", world_size=8),
    ])
    table = peers_table(records).set_index(["peer", "world_size"])
    assert table.loc[("alst", 8), "autosp (ours)"] == "4,458,496" and table.loc[("alst", 8), "autosp / published"] \
        == "1.20x"
    assert table.loc[("upipe", 8), "autosp / published"] == "0.89x"  # Llama-3-8B: Llama-3.1-8B's shapes
    assert table.loc[("alst", 8), "alst (ours)"] == ">=524,288"  # the run that fit, not the oom at 3.7M
    assert table.loc[("alst", 32), "autosp / published"] == "1.26x" and table.loc[("upipe", 16), "autosp (ours)"] == ""
    assert table.loc[("torchtitan", 8), "autosp / published"] == ""
    assert list(table.columns)[-1] == "source"
