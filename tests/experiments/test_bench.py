"""Throughput bench: interleaved repeats, every record kept, ratios against a reference of the same run."""
from __future__ import annotations

import pytest

from autosp.experiments.bench import run_bench
from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.records import load_records, new_record

STEP_S = {"ulysses": 0.010, "autosp": 0.0125}


def fake_run(calls: list):
    def run(cfg: RunConfig) -> dict:
        calls.append((cfg.method, cfg.seq_len))
        record = new_record(cfg, sp_size=cfg.world_size)
        t = STEP_S[cfg.method] * cfg.seq_len / 1024 * (1 + 0.01 * len(calls))  # a slowly drifting machine
        record.update(status="ok", iter_time_s={"median": t, "min": t, "max": t, "samples": [t]},
                      tokens_per_s=cfg.seq_len / t, peak_mem_bytes=cfg.seq_len)
        return record

    return run


def test_repeats_are_interleaved_and_ratios_use_the_reference(tmp_path) -> None:
    calls: list = []
    out = tmp_path / "bench.jsonl"
    cfg = RunConfig(method="ulysses", model="tiny", seq_len=1, world_size=2)
    table = run_bench(cfg, methods=["autosp", "ulysses"], seq_lens=[1024, 2048], repeats=3, out=str(out),
                      ratio_to="ulysses", run=fake_run(calls))
    assert calls[:4] == [("autosp", 1024), ("ulysses", 1024), ("autosp", 2048), ("ulysses", 2048)]
    assert len(calls) == 12 and len(load_records(out)) == 12
    t = table.set_index(["seq_len", "method"])
    assert t.loc[(1024, "autosp"), "repeats"] == 3
    assert t.loc[(1024, "autosp"), "iter_time_min_s"] < t.loc[(1024, "autosp"), "iter_time_max_s"]
    assert t.loc[(2048, "autosp"), "speed_vs_ulysses"] == pytest.approx(0.8, rel=0.03)
    assert t.loc[(2048, "ulysses"), "speed_vs_ulysses"] == pytest.approx(1.0)


def test_reference_must_be_measured_in_the_same_run(tmp_path) -> None:
    cfg = RunConfig(method="autosp", model="tiny", seq_len=1, world_size=2)
    with pytest.raises(ConfigError, match="--ratio-to"):
        run_bench(cfg, methods=["autosp"], seq_lens=[1024], repeats=1, out=str(tmp_path / "b.jsonl"),
                  ratio_to="ulysses", run=fake_run([]))


def test_real_bench_through_the_cli(tmp_path, capsys) -> None:
    from autosp.cli import main

    out = tmp_path / "bench.jsonl"
    code = main(["bench", "--methods", "single", "--model", "tiny", "--seq-lens", "128", "--world-size", "1",
                 "--repeats", "2", "--steps", "2", "--ratio-to", "single", "--out", str(out)])
    assert code == 0
    records = load_records(out)
    assert list(records["status"]) == ["ok", "ok"] and records["bench_id"].nunique() == 1
    printed = capsys.readouterr().out
    assert "speed_vs_single" in printed and "tokens_per_s" in printed


def test_bad_lengths_are_a_config_error() -> None:
    from autosp.cli import main

    assert main(["bench", "--methods", "single", "--model", "tiny", "--seq-lens", "1k", "--world-size", "1"]) == 2
