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
        t = STEP_S.get(cfg.method, 0.01) * cfg.seq_len / 1024 * (1 + 0.01 * len(calls))  # a slowly drifting machine
        t *= 1.1 if cfg.tiling == "auto" else 1.0
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


def test_each_method_receives_and_records_only_the_options_it_honours(tmp_path) -> None:
    """autosp's flags (tiling, sac, offload, ulysses_size, attention_chunks) reach autosp only; `zero` every method
    with a choice of stages; `compile_backend` the methods that compile. The rest run, and are recorded, at the
    defaults."""
    received: dict = {}
    run = fake_run([])
    out = tmp_path / "bench.jsonl"
    cfg = RunConfig(method="autosp", model="tiny", seq_len=1, world_size=2, sac="auto", compile_backend="aot_eager",
                    zero=3, tiling="auto", ulysses_size=2, offload="activations", attention_chunks=2)
    run_bench(cfg, methods=["autosp", "ulysses", "zero3", "ulysses-compile"], seq_lens=[128], repeats=1, out=str(out),
              run=lambda c: received.setdefault(c.method, c) and run(c))
    options = ("sac", "compile_backend", "zero", "tiling", "ulysses_size", "offload", "attention_chunks")
    got = {m: tuple(getattr(c, o) for o in options) for m, c in received.items()}
    assert got == {"autosp": ("auto", "aot_eager", 3, "auto", 2, "activations", 2),
                   "ulysses": ("sac", "inductor", 3, "off", None, "off", 1),
                   "zero3": ("sac", "inductor", None, "off", None, "off", 1),
                   "ulysses-compile": ("sac", "aot_eager", None, "off", None, "off", 1)}
    records = load_records(out).set_index("method")
    assert records.loc["ulysses", "config.tiling"] == "off" and records.loc["zero3", "zero"] == 3
    # a record built from the raw configuration (a search's result row) leaves the foreign options out too
    row = new_record(cfg.replace(method="ring"), sp_size=2)
    assert (row["config"]["tiling"], row["config"]["offload"], row["sac"], row["zero"]) == ("off", "off", "sac", 3)


def test_two_settings_of_one_method_share_one_interleaved_run(tmp_path) -> None:
    calls: list = []
    out = tmp_path / "bench.jsonl"
    cfg = RunConfig(method="autosp", model="tiny", seq_len=1, world_size=2, tiling="auto")
    table = run_bench(cfg, methods=["autosp", "autosp[tiling=off]"], seq_lens=[1024, 2048], repeats=2, out=str(out),
                      ratio_to="autosp[tiling=off]", run=fake_run(calls))
    assert calls[:2] == [("autosp", 1024), ("autosp", 1024)] and len(calls) == 8
    records = load_records(out)
    assert sorted(records.groupby("config.tiling")["method_spec"].first().fillna("-").items()) == [
        ("auto", "-"), ("off", "autosp[tiling=off]")]
    t = table.set_index(["seq_len", "method"])
    assert t.loc[(2048, "autosp"), "speed_vs_autosp[tiling=off]"] == pytest.approx(1 / 1.1, rel=0.03)


@pytest.mark.parametrize("methods, message", [
    (["ulysses[tiling=off]"], r"ulysses does not take tiling \(its options: ac, zero\)"),
    (["autosp[tiling]"], "autosp has no preset 'tiling'"),
    (["autosp[tiling=]"], "not option=value"),
    (["autosp[zero=two]"], "--zero takes an integer"),
    (["autosp", "autosp"], "names autosp twice"),
])
def test_bad_method_specs_are_config_errors(tmp_path, methods, message) -> None:
    cfg = RunConfig(method="autosp", model="tiny", seq_len=1, world_size=2)
    with pytest.raises(ConfigError, match=message):
        run_bench(cfg, methods=methods, seq_lens=[128], repeats=1, out=str(tmp_path / "b.jsonl"), run=fake_run([]))


def test_real_bench_through_the_cli(tmp_path, capsys) -> None:
    from autosp.cli import main

    out = tmp_path / "bench.jsonl"
    code = main(["bench", "--methods", "single", "--model", "tiny", "--seq-lens", "128", "--world-size", "1",
                 "--repeats", "2", "--steps", "2", "--ratio-to", "single", "--out", str(out)])
    assert code == 0
    records = load_records(out)
    assert list(records["status"]) == ["ok", "ok"] and records["bench_id"].nunique() == 1
    cpu = records["extra.cpu_time_s.median"]  # CPU seconds per step: a step does work, never more than 2 threads' worth
    assert ((cpu > 0) & (cpu < 2 * records["iter_time_s.median"] + 0.01)).all()
    printed = capsys.readouterr().out
    assert "speed_vs_single" in printed and "tokens_per_s" in printed and "cpu_speed_vs_single" in printed


def test_bad_lengths_are_a_config_error() -> None:
    from autosp.cli import main

    assert main(["bench", "--methods", "single", "--model", "tiny", "--seq-lens", "1k", "--world-size", "1"]) == 2
