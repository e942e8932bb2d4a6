"""Regression history on synthetic histories: the statistics, the trainability verdicts, the machine rule,
the store's guarantees, the suite runner (with a stand-in CLI) and the figures. Nothing here trains."""
from __future__ import annotations

import json
import sqlite3
import sys
import textwrap
import uuid

import numpy as np
import pytest

from autosp.cli import main
from autosp.experiments.history.compare import REGRESSION, UNCHANGED, bisect_hint, compare
from autosp.experiments.history.store import load_history, record_files
from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.records import append_record, new_record

STEP = 0.100  # seconds per step of autosp in the synthetic base


def run_record(commit: str, method: str, samples, *, day: int, seq_len: int = 512, status: str = "ok",
               device_name: str = "cpu-A", bench_id: str = "b", repeat: int = 0) -> dict:
    cfg = RunConfig(method=method, model="tiny", seq_len=seq_len, world_size=2, compile_backend="aot_eager")
    record = new_record(cfg, sp_size=2)
    median = float(np.median(samples)) if samples else None
    record.update(git_commit=commit, git_dirty=False, device_name=device_name, status=status, bench_id=bench_id,
                  timestamp=f"2026-01-{day:02d}T00:00:00+00:00", peak_mem_bytes=5_000_000 if samples else None,
                  iter_time_s={"samples": list(samples), "median": median} if samples else None,
                  tokens_per_s=seq_len / median if median else None)
    record["extra"]["repeat"] = repeat
    return record


def search_row(commit: str, max_seq_len: int, *, day: int, device_name: str = "cpu-A") -> dict:
    cfg = RunConfig(method="autosp", model="tiny", seq_len=max_seq_len, world_size=2, memory_budget=24 << 20)
    row = new_record(cfg, sp_size=2)
    row.update(kind="search", search_id=uuid.uuid4().hex, status="found", max_seq_len=max_seq_len,
               git_commit=commit, git_dirty=False, device_name=device_name,
               timestamp=f"2026-01-{day:02d}T00:00:00+00:00")
    row["run_id"] = row["search_id"]
    return row


def bench(commit: str, autosp_steps, ulysses_steps, *, day: int, **kw) -> list[dict]:
    """Two repeats of autosp and ulysses (the reference) in one bench invocation."""
    bench_id = uuid.uuid4().hex
    half = len(autosp_steps) // 2
    return [run_record(commit, method, steps[r * half:(r + 1) * half], day=day, bench_id=bench_id, repeat=r, **kw)
            for r in range(2) for method, steps in (("autosp", autosp_steps), ("ulysses", ulysses_steps))]


def record(tmp_path, name: str, records: list[dict], store) -> None:
    path = tmp_path / f"{name}.jsonl"
    for r in records:
        append_record(path, r)
    record_files(store, [path], reference="ulysses")


def noisy(center: float, seed: int, n: int = 10, spread: float = 0.05) -> list[float]:
    return list(center * (1 + spread * np.random.default_rng(seed).standard_normal(n)))


@pytest.fixture
def store(tmp_path):
    return tmp_path / "history.sqlite"


def compare_cli(store, *extra: str) -> int:
    return main(["history", "compare", "--store", str(store), *extra])


def test_identical_samples_are_no_regression(tmp_path, store, capsys):
    same = noisy(STEP, 1)
    record(tmp_path, "a", bench("a" * 40, same, same, day=1) + [search_row("a" * 40, 3584, day=1)], store)
    record(tmp_path, "b", bench("b" * 40, same, same, day=2) + [search_row("b" * 40, 3584, day=2)], store)
    table, _ = compare(load_history(store), threshold=0.05)
    assert set(table["verdict"]) == {UNCHANGED}
    assert {"iter_time_s", "tokens_per_s", "speed_vs_ulysses", "max_seq_len", "trains"} <= set(table["metric"])
    assert compare_cli(store) == 0
    assert "no regression" in capsys.readouterr().out


def test_injected_20_percent_slowdown_is_flagged_with_exit_1(tmp_path, store, capsys):
    record(tmp_path, "a", bench("a" * 40, noisy(STEP, 1), noisy(STEP, 2), day=1), store)
    record(tmp_path, "b", bench("b" * 40, noisy(1.2 * STEP, 3), noisy(STEP, 4), day=2), store)
    table, _ = compare(load_history(store), threshold=0.05)
    flagged = table[table["verdict"] == REGRESSION]
    assert set(flagged["method"]) == {"autosp"}
    assert {"iter_time_s", "tokens_per_s", "speed_vs_ulysses"} <= set(flagged["metric"])
    slow = flagged[flagged["metric"] == "iter_time_s"].iloc[0]
    assert 0.1 < slow["change"] < 0.3 and slow["ci_low"] > 0.05 and slow["p_value"] < 0.05
    assert compare_cli(store, "--base", "aaaa", "--head", "bbbb") == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "regression(s)" in out


def test_noise_inside_the_spread_is_not_flagged(tmp_path, store):
    record(tmp_path, "a", bench("a" * 40, noisy(STEP, 1), noisy(STEP, 2), day=1), store)
    record(tmp_path, "b", bench("b" * 40, noisy(STEP, 5), noisy(STEP, 6), day=2), store)
    record(tmp_path, "c", bench("c" * 40, noisy(1.03 * STEP, 7, spread=0.01), noisy(STEP, 8), day=3), store)
    history = load_history(store)
    for base, head in (("aaaa", "bbbb"), ("bbbb", "cccc")):  # same distribution; a 3% shift below the threshold
        table, _ = compare(history, base=base, head=head, threshold=0.05)
        assert REGRESSION not in set(table["verdict"])


def test_max_length_drop_and_ok_to_oom_are_trainability_regressions(tmp_path, store, capsys):
    steps = noisy(STEP, 1)
    record(tmp_path, "a", bench("a" * 40, steps, steps, day=1) + [search_row("a" * 40, 3584, day=1)], store)
    oom = [run_record("b" * 40, "autosp", [], day=2, status="oom", bench_id="x", repeat=r) for r in range(2)]
    ulysses = [run_record("b" * 40, "ulysses", steps[:5], day=2, bench_id="x", repeat=r) for r in range(2)]
    record(tmp_path, "b", oom + ulysses + [search_row("b" * 40, 3072, day=2)], store)
    table, _ = compare(load_history(store), threshold=0.05)
    lost = table[(table["kind"] == "trainability") & (table["verdict"] == REGRESSION)]
    assert set(lost["metric"]) == {"max_seq_len", "trains"}
    assert lost.set_index("metric").loc["max_seq_len", "head"] == 3072
    assert compare_cli(store) == 1
    out = capsys.readouterr().out
    assert out.index("trainability:") < out.rindex("REGRESSION")


def test_another_device_is_never_compared(tmp_path, store, capsys):
    record(tmp_path, "a", bench("a" * 40, noisy(STEP, 1), noisy(STEP, 2), day=1, device_name="cpu-A"), store)
    record(tmp_path, "b", bench("b" * 40, noisy(2 * STEP, 3), noisy(STEP, 4), day=2, device_name="cpu-B"), store)
    table, info = compare(load_history(store), threshold=0.05)
    assert table.empty and info["bases"] == {}
    table, info = compare(load_history(store), base="aaaa", head="bbbb", threshold=0.05)
    assert table.empty and info["unmeasured"]  # even when asked for, series of different machines do not meet
    assert compare_cli(store) == 0
    assert "nothing to compare" in capsys.readouterr().out
    # a third commit back on machine A compares with A's last commit, skipping B's
    record(tmp_path, "c", bench("c" * 40, noisy(1.2 * STEP, 5), noisy(STEP, 6), day=3, device_name="cpu-A"), store)
    table, info = compare(load_history(store), threshold=0.05)
    assert list(info["bases"].values()) == ["a" * 9] and REGRESSION in set(table["verdict"])
    assert info["other_machines"] == ["cpu / cpu-B"]


def test_a_deterministic_peak_memory_increase_needs_no_test(tmp_path, store):
    steps = noisy(STEP, 1)
    record(tmp_path, "a", bench("a" * 40, steps, steps, day=1), store)
    grown = bench("b" * 40, steps, steps, day=2)
    for r in grown:
        r["peak_mem_bytes"] = int(r["peak_mem_bytes"] * (1.2 if r["method"] == "autosp" else 1.0))
    record(tmp_path, "b", grown, store)
    table, _ = compare(load_history(store), threshold=0.05)
    peaks = table[table["metric"] == "peak_mem_bytes"].set_index("method")["verdict"]
    assert peaks.to_dict() == {"autosp": REGRESSION, "ulysses": UNCHANGED}


def test_store_is_append_only_and_refuses_unknown_schemas(tmp_path, store, capsys):
    path = tmp_path / "a.jsonl"
    for r in bench("a" * 40, noisy(STEP, 1), noisy(STEP, 2), day=1):
        append_record(path, r)
    added = record_files(store, [path], reference="ulysses")
    assert added > 0 and record_files(store, [path], reference="ulysses") == 0
    assert len(load_history(store)) == added
    future = run_record("f" * 40, "autosp", [0.1], day=3)
    future["schema_version"] = 99
    bad = tmp_path / "future.jsonl"
    append_record(bad, future)
    with pytest.raises(ConfigError, match="schema_version 99"):
        record_files(store, [bad])
    assert main(["history", "record", "--store", str(store), str(bad)]) == 2
    assert "schema_version 99" in capsys.readouterr().err
    with sqlite3.connect(store) as con:
        con.execute("UPDATE meta SET value = '7' WHERE key = 'store_version'")
    with pytest.raises(ConfigError, match="layout 7"):
        load_history(store)


def test_speed_ratio_is_against_the_reference_of_the_same_repeat(tmp_path, store):
    record(tmp_path, "a", bench("a" * 40, [0.2, 0.4, 0.2, 0.1], [0.1, 0.2, 0.3, 0.3], day=1), store)
    ratios = load_history(store).query("metric == 'speed_vs_ulysses'")["value"].tolist()
    assert ratios == pytest.approx([0.5, 0.5, 1.5, 3.0])


def test_bisect_hint_names_the_first_commit_that_moved(tmp_path, store, capsys):
    for day, (commit, step) in enumerate((("a", STEP), ("b", STEP), ("c", 1.3 * STEP), ("d", 1.3 * STEP)), 1):
        record(tmp_path, commit, bench(commit * 40, noisy(step, day), noisy(STEP, 10 + day), day=day), store)
    hints = bisect_hint(load_history(store), threshold=0.05)
    moved = hints[(hints["method"] == "autosp") & (hints["metric"] == "iter_time_s")]
    assert list(moved["moved_at"]) == ["c" * 9] and list(moved["previous"]) == ["b" * 9]
    assert main(["history", "bisect-hint", "--store", str(store)]) == 0
    assert "first moved at cccccccc" in capsys.readouterr().out


def test_plot_writes_png_pdf_and_a_self_contained_page(tmp_path, store):
    for day, (commit, step) in enumerate((("a", STEP), ("b", STEP), ("c", 1.3 * STEP)), 1):
        record(tmp_path, commit, bench(commit * 40, noisy(step, day), noisy(STEP, 10 + day), day=day)
               + [search_row(commit * 40, 3584, day=day)], store)
    out, page = tmp_path / "fig" / "history.png", tmp_path / "index.html"
    assert main(["history", "plot", "--store", str(store), "--out", str(out), "--html", str(page)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and out.with_suffix(".pdf").read_bytes()[:4] == b"%PDF"
    text = page.read_text()
    assert "data:image/png;base64," in text and "ccccccccc" in text and "REGRESSION" in text


def test_suite_runs_each_cell_through_the_cli_and_records_it(tmp_path, capsys):
    """The cpu suite with a stand-in `autosp` that writes synthetic records where each cell says --out."""
    steps = noisy(STEP, 1)
    canned = tmp_path / "records.json"
    canned.write_text(json.dumps({"bench": bench("a" * 40, steps, steps, day=1),
                                  "search": [search_row("a" * 40, 3584, day=1)]}))
    fake = tmp_path / "fake_autosp.py"
    fake.write_text(textwrap.dedent(f"""
        import json, sys
        args = sys.argv[1:]
        with open(args[args.index("--out") + 1], "a") as out:
            for record in json.load(open({str(canned)!r}))[args[0]]:
                out.write(json.dumps(record) + "\\n")
    """))
    store = tmp_path / "history.sqlite"
    code = main(["history", "run", "--suite", "cpu", "--store", str(store), "--runs-dir", str(tmp_path / "runs"),
                 "--autosp-cmd", f"{sys.executable} {fake}"])
    assert code == 0
    out = capsys.readouterr().out
    assert "[1/2] bench-tiny-512" in out and "[2/2] search-tiny-autosp" in out
    history = load_history(store)
    assert set(history["suite"]) == {"cpu"}
    assert {"iter_time_s", "speed_vs_ulysses", "max_seq_len"} <= set(history["metric"])


def test_bad_threshold_and_unknown_revision_are_one_line_errors(tmp_path, store, capsys):
    record(tmp_path, "a", bench("a" * 40, noisy(STEP, 1), noisy(STEP, 2), day=1), store)
    assert compare_cli(store, "--threshold", "five") == 2
    assert compare_cli(store, "--base", "0123456789abcdef") == 2
    err = capsys.readouterr().err
    assert "--threshold takes" in err and "no recorded measurements" in err


def test_gpu_suite_on_a_machine_without_gpus_is_a_one_line_error(tmp_path, capsys):
    assert main(["history", "run", "--suite", "cuda", "--store", str(tmp_path / "h.sqlite"),
                 "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "needs CUDA GPUs" in capsys.readouterr().err


FAKE_CLI = """
import json, os, subprocess, sys, uuid
args = sys.argv[1:]
sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
answer = int(open("answer.txt").read())  # this commit's own code decides the answer
ids = {}
with open(args[args.index("--out") + 1], "a") as out:
    for record in json.load(open(os.environ["FAKE_RECORDS"]))[args[0]]:
        for key in ("run_id", "bench_id", "search_id"):
            if record.get(key):
                record[key] = ids.setdefault(record[key], uuid.uuid4().hex)
        record.update(git_commit=sha, git_dirty=False, device_name=os.environ["FAKE_DEVICE_NAME"])
        if record.get("kind") == "search":
            record["max_seq_len"] = answer
        out.write(json.dumps(record) + "\\n")
"""


def _repo_with_answers(path, answers):
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, check=True).stdout

    path.mkdir()
    git("init", "-q")
    (path / "autosp").mkdir()
    (path / "autosp" / "__init__.py").write_text("")
    for answer in answers:
        (path / "answer.txt").write_text(str(answer))
        git("add", "-A")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", f"answer {answer}")
    return git


def test_history_run_over_a_commit_range_records_each_commit_with_its_own_code_once(tmp_path, monkeypatch, capsys):
    from autosp.harness.runner import device_name

    git = _repo_with_answers(tmp_path / "repo", [4096, 4096, 3584, 4608])
    steps = noisy(STEP, 1)
    canned = tmp_path / "records.json"
    canned.write_text(json.dumps({"bench": bench("0" * 40, steps, steps, day=1),
                                  "search": [search_row("0" * 40, 1, day=1)]}))
    fake = tmp_path / "fake_autosp.py"
    fake.write_text(FAKE_CLI)
    monkeypatch.setenv("FAKE_RECORDS", str(canned))
    monkeypatch.setenv("FAKE_DEVICE_NAME", device_name("cpu"))
    store = tmp_path / "history.sqlite"

    def run(*revisions: str) -> int:
        return main(["history", "run", "--suite", "cpu", "--store", str(store), "--runs-dir", str(tmp_path / "runs"),
                     "--autosp-cmd", f"{sys.executable} {fake}", "--repo", str(tmp_path / "repo"),
                     "--commits", *revisions])

    assert run("HEAD~3..HEAD") == 0
    assert "recorded 3 commit(s)" in capsys.readouterr().out
    shas = git("rev-list", "--reverse", "HEAD").split()
    history = load_history(store)
    answers = history[history["metric"] == "max_seq_len"].set_index("commit_sha")["value"].to_dict()
    assert answers == {shas[1]: 4096, shas[2]: 3584, shas[3]: 4608}  # each commit's own answer.txt
    assert git("worktree", "list").count("\n") == 1  # the temporary worktrees are gone
    table, info = compare(history, threshold=0.05)
    assert info["head"] == shas[3][:9] and info["bases"] and not table.empty
    assert compare_cli(store) == 0
    capsys.readouterr()
    rows = len(history)
    assert run("HEAD~3..HEAD") == 0  # the same range again: nothing new
    assert "recorded 0 commit(s) (0 new samples), skipped 3 already recorded" in capsys.readouterr().out
    assert len(load_history(store)) == rows
    assert run(shas[0], "HEAD") == 0  # a list: only the commit not yet recorded runs
    assert "recorded 1 commit(s)" in capsys.readouterr().out
    assert set(load_history(store)["commit_sha"]) == set(shas)


def test_history_run_commits_bad_revision_is_one_line(tmp_path, capsys):
    _repo_with_answers(tmp_path / "repo", [4096])
    assert main(["history", "run", "--suite", "cpu", "--store", str(tmp_path / "h.sqlite"),
                 "--repo", str(tmp_path / "repo"), "--commits", "nosuchrev"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nosuchrev" in err


def test_a_simulator_that_stops_agreeing_with_the_measured_search_is_flagged(tmp_path, store, capsys):
    rows = []
    for day, (commit, disagreements) in enumerate((("a", []), ("b", [{"seq_len": 4608, "predicted": "oom",
                                                                      "measured": "ok"}])), 1):
        row = search_row(commit * 40, 4096, day=day)
        row.update(guide="simulate", predicted_max_seq_len=4096 if not disagreements else 3584,
                   guide_disagreements=disagreements)
        rows.append(row)
        record(tmp_path, commit, [row], store)
    unguided = search_row("c" * 40, 4096, day=3)  # a plain search says nothing of the simulator
    record(tmp_path, "c", [unguided], store)
    history = load_history(store)
    agrees = history[history["metric"] == "simulator_agrees"].set_index("commit_sha")["value"].to_dict()
    assert agrees == {"a" * 40: 1.0, "b" * 40: 0.0}
    table, _ = compare(history, base="aaaa", head="bbbb", threshold=0.05)
    verdicts = table.set_index("metric")["verdict"].to_dict()
    assert verdicts == {"max_seq_len": UNCHANGED, "simulator_agrees": REGRESSION}
