"""The history store: raw samples of every recorded run, keyed by commit and machine, in one SQLite file.

Why SQLite and not asv's results directory (see DESIGN.md, "Regression history"): asv keeps raw samples only
for benchmarks it times itself in-process (`time_*`); a `track_*` benchmark returns one number, so `asv
compare` could not test our samples, which are step times of multi-process runs timed by the harness. Its
environment management builds every commit into a fresh virtualenv (torch, deepspeed per commit). SQLite is
in the standard library, one file, transactional (a crash never leaves half a record) and readable by pandas.

The store is append-only: rows are only ever inserted, never updated or deleted; a (run, metric, sample)
already stored is skipped, so recording the same file twice adds nothing.

One row per sample: a step time, a tokens/s value, a speed ratio to the reference method of the same bench
run, a peak, a run's status, or a search's max length. Rows carry the record's whole identity (commit,
dirty flag, commit time, device, device_name, hostname, versions and the run configuration).
"""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from autosp.harness.config import ConfigError
from autosp.harness.records import read_records

#: version of the table layout below; a store written by a newer layout is refused, never misread
STORE_VERSION = 1
#: record schema versions this module reads (records.SCHEMA_VERSION of the code that wrote them)
READABLE_RECORD_SCHEMAS = (1,)
DEFAULT_STORE = "results/history/history.sqlite"
#: significance level of the comparisons: several series per comparison, so keep false alarms rare
DEFAULT_ALPHA = 0.01

#: what makes two samples the same series (besides the machine): the run configuration and the metric
SERIES_KEY = ("metric", "method", "model", "seq_len", "world_size", "sp_size", "zero", "dtype", "sac",
              "compile_backend", "batch_size", "memory_budget", "mode")
#: samples of different machines are never compared
MACHINE_KEY = ("device", "device_name")
#: metrics where a larger value is better (the others: smaller is better)
HIGHER_IS_BETTER = ("tokens_per_s", "max_seq_len", "simulator_agrees")
SPEED_RATIO_PREFIX = "speed_vs_"  # normalised throughput: reference iteration time / this one (higher better)
#: compared exactly, reported apart from throughput. `simulator_agrees`: 1 when a guided search's every probe was as
#: the simulator predicted, 0 when one was not (a drifting simulator regresses it)
TRAINABILITY_METRICS = ("max_seq_len", "trains", "simulator_agrees")

_COLUMNS = {
    "commit_sha": "TEXT", "dirty": "INTEGER", "commit_time": "TEXT", "device": "TEXT", "device_name": "TEXT",
    "hostname": "TEXT", "versions": "TEXT", "method": "TEXT", "model": "TEXT", "seq_len": "INTEGER",
    "world_size": "INTEGER", "sp_size": "INTEGER", "zero": "INTEGER", "dtype": "TEXT", "sac": "TEXT",
    "compile_backend": "TEXT", "batch_size": "INTEGER", "memory_budget": "INTEGER", "mode": "TEXT",
    "metric": "TEXT NOT NULL", "value": "REAL", "status": "TEXT", "run_id": "TEXT NOT NULL",
    "group_id": "TEXT", "sample_index": "INTEGER NOT NULL", "record_schema": "INTEGER", "timestamp": "TEXT",
    "suite": "TEXT", "source": "TEXT", "recorded_at": "TEXT",
}


def higher_is_better(metric: str) -> bool:
    return metric in HIGHER_IS_BETTER or metric.startswith(SPEED_RATIO_PREFIX) or metric == "trains"


@contextmanager
def open_store(path: str | os.PathLike, *, create: bool = False) -> Iterator[sqlite3.Connection]:
    """A connection to the store at `path` (created with `create`); refuses stores of another layout."""
    path = Path(path)
    if not path.exists() and not create:
        raise ConfigError(f"no history store at {path}; record results first (`autosp history record FILE...`)")
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path, timeout=60)
    try:
        con.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        con.execute("INSERT OR IGNORE INTO meta VALUES ('store_version', ?)", (str(STORE_VERSION),))
        version = int(con.execute("SELECT value FROM meta WHERE key = 'store_version'").fetchone()[0])
        if version != STORE_VERSION:
            raise ConfigError(f"{path} is a history store of layout {version}; this autosp reads layout "
                              f"{STORE_VERSION}: use the autosp version that wrote it, or record into a new store")
        columns = ", ".join(f"{name} {kind}" for name, kind in _COLUMNS.items())
        con.execute(f"CREATE TABLE IF NOT EXISTS samples ({columns}, UNIQUE (run_id, metric, sample_index))")
        con.commit()
        yield con
    finally:
        con.close()


def load_history(path: str | os.PathLike) -> pd.DataFrame:
    """Every stored sample as a DataFrame (one row per sample, columns as stored)."""
    with open_store(path) as con:
        return pd.read_sql_query("SELECT rowid AS row, * FROM samples ORDER BY rowid", con)


def _git(repo: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def repo_root() -> Path:
    """The git checkout this package runs from (older commits' worktrees share its objects)."""
    return Path(__file__).resolve().parents[3]


def commit_time(commit: str | None, repo: Path | None = None) -> str | None:
    """Committer date of `commit` (ISO 8601, UTC), or None when the commit is not in the repository."""
    if not commit:
        return None
    text = _git(repo or repo_root(), "show", "-s", "--format=%cI", commit)
    if not text:
        return None
    return datetime.fromisoformat(text).astimezone(timezone.utc).isoformat(timespec="seconds")


def _check_schema(record: dict[str, Any], where: str) -> int:
    version = record.get("schema_version")
    if version not in READABLE_RECORD_SCHEMAS:
        raise ConfigError(f"{where}: record schema_version {version!r} is not one this autosp reads "
                          f"({', '.join(map(str, READABLE_RECORD_SCHEMAS))}); record it with the autosp version "
                          "that wrote it, or teach autosp.experiments.history.store to read it")
    return version


def _identity(record: dict[str, Any]) -> dict[str, Any]:
    """The columns every sample of one record shares."""
    config = record.get("config") or {}
    return {
        "commit_sha": record.get("git_commit"), "dirty": None if record.get("git_dirty") is None
        else int(bool(record["git_dirty"])), "device": record.get("device"),
        "device_name": record.get("device_name"), "hostname": record.get("hostname"),
        "versions": json.dumps(record.get("versions") or {}, sort_keys=True), "method": record.get("method"),
        "model": record.get("model"), "seq_len": record.get("seq_len"), "world_size": record.get("world_size"),
        "sp_size": record.get("sp_size"), "zero": int(config.get("zero") or 0), "dtype": record.get("dtype"),
        "sac": record.get("sac"), "compile_backend": record.get("compile_backend"),
        "batch_size": record.get("batch_size"), "memory_budget": record.get("memory_budget"),
        "mode": record.get("mode") or "measured", "status": record.get("status"), "run_id": record["run_id"],
        "record_schema": record.get("schema_version"), "timestamp": record.get("timestamp"),
    }


def _median_time(record: dict[str, Any]) -> float | None:
    return (record.get("iter_time_s") or {}).get("median")


def samples_of_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sample rows of one results file's records.

    Bench and plain runs give step times, tokens/s (per step, from the same tokens per step), the peak,
    whether the length trained (`trains`: 1 ok / 0 oom) and, where a reference method ran in the same bench
    invocation, repeat and length, `speed_vs_<ref>` = the reference's step time / this method's, step i with
    step i (each step used once, so the ratios stay independent samples for the test).
    A search row gives `max_seq_len` (0 when not even the shortest length trained) and, when the simulator
    guided it, `simulator_agrees`; its probes are only lengths on the way and give nothing (their one timed step
    is not a throughput measurement).
    """
    rows: list[dict[str, Any]] = []
    reference_steps: dict[tuple, tuple[str, list[float]]] = {}
    for record in records:
        ref = record.get("ratio_to")
        if record.get("bench_id") and ref == record.get("method") and _median_time(record):
            key = (record["bench_id"], record.get("seq_len"), (record.get("extra") or {}).get("repeat"))
            reference_steps[key] = (ref, record["iter_time_s"]["samples"])

    def add(record: dict[str, Any], metric: str, values: Iterable[float | None], **columns: Any) -> None:
        for index, value in enumerate(values):
            rows.append({**_identity(record), "group_id": record.get("bench_id") or record.get("search_id"),
                         "metric": metric, "value": value, "sample_index": index, **columns})

    for record in records:
        if record.get("kind") == "search":
            found = record.get("max_seq_len") or 0
            if record.get("status") in ("ok", "found", "no_oom_up_to_max_len", "oom_at_min_len"):
                add(record, "max_seq_len", [found], seq_len=None)
                if record.get("predicted_max_seq_len") is not None:
                    add(record, "simulator_agrees", [0.0 if record.get("guide_disagreements") else 1.0], seq_len=None)
            continue
        if record.get("search_id") or record.get("kind") is not None:
            continue
        if record.get("status") in ("ok", "oom"):
            add(record, "trains", [1.0 if record["status"] == "ok" else 0.0])
        if record.get("status") != "ok":
            continue
        samples = (record.get("iter_time_s") or {}).get("samples") or []
        add(record, "iter_time_s", samples)
        if record.get("tokens_per_s") and _median_time(record):
            tokens_per_step = record["tokens_per_s"] * _median_time(record)
            add(record, "tokens_per_s", [tokens_per_step / s for s in samples if s])
        if record.get("peak_mem_bytes") is not None:
            add(record, "peak_mem_bytes", [record["peak_mem_bytes"]])
        key = (record.get("bench_id"), record.get("seq_len"), (record.get("extra") or {}).get("repeat"))
        if key in reference_steps and reference_steps[key][0] != record.get("method"):
            ref, ref_steps = reference_steps[key]  # step i of each: every sample used once, pairs independent
            add(record, f"{SPEED_RATIO_PREFIX}{ref}", [r / s for r, s in zip(ref_steps, samples) if s])
    return rows


def record_files(store: str | os.PathLike, paths: Iterable[str | os.PathLike], *, suite: str | None = None,
                 reference: str | None = None, repo: Path | None = None) -> int:
    """Add the samples of the records in `paths` to the store (one transaction per file); returns rows added.

    `reference`: the method whose median step time normalises the others of the same bench run (the bench
    command's `--ratio-to`; records do not carry it). `repo`: where the commits' times are looked up (default:
    the checkout this package runs from)."""
    added = 0
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    times: dict[str | None, str | None] = {}
    with open_store(store, create=True) as con:
        for path in paths:
            if not Path(path).exists():
                raise ConfigError(f"no results file {path}: name JSONL files written by `autosp bench/search/run`")
            try:
                records = read_records(path)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            for number, record in enumerate(records, 1):
                _check_schema(record, f"{path}:{number}")
                if reference and record.get("bench_id"):
                    record.setdefault("ratio_to", reference)
            rows = samples_of_records(records)
            for row in rows:
                sha = row["commit_sha"]
                if sha not in times:
                    times[sha] = commit_time(sha, repo)
                row.update(commit_time=times[sha] or row["timestamp"], suite=suite, source=str(path),
                           recorded_at=now)
            names = list(_COLUMNS)
            with con:  # one transaction: a file is recorded whole or not at all
                before = con.total_changes
                con.executemany(
                    f"INSERT OR IGNORE INTO samples ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                    [tuple(row.get(name) for name in names) for row in rows])
                added += con.total_changes - before
    return added
