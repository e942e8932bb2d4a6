"""One JSON line per run: the contract between measuring and everything downstream (tables, figures, history).

Appends are atomic: the whole line goes out in one write() on an O_APPEND descriptor under an exclusive
flock, so concurrent writers (Snakemake jobs, search probes) never interleave or leave half a line.
"""
from __future__ import annotations

import fcntl
import json
import os
import platform
import socket
import subprocess
import uuid
from collections.abc import Iterable
from datetime import datetime, timezone
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from autosp.harness.config import ConfigError, RunConfig

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "timeout", "error")
#: every record has these keys (None where not applicable); `extra` holds method-specific metrics
FIELDS = (
    "schema_version", "run_id", "method", "implementation", "model", "seq_len", "batch_size", "world_size",
    "sp_size", "dp_size", "dtype", "device", "device_name", "mode", "status", "error", "peak_mem_bytes",
    "peak_mem_by_rank", "iter_time_s", "tokens_per_s", "loss", "memory_budget", "sac", "compile_backend",
    "zero",    "git_commit", "git_dirty", "versions", "hostname", "timestamp", "config_hash", "config", "extra",
)
_VERSIONED = ("deepspeed", "transformers", "numpy", "pandas", "autosp")


@lru_cache(maxsize=1)
def software_versions() -> dict[str, str | None]:
    """Versions of Python and the libraries that change results (None when a library is not installed)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    import torch

    versions["torch"] = torch.__version__
    versions["cuda"] = torch.version.cuda
    versions["hip"] = torch.version.hip
    return versions


@lru_cache(maxsize=1)
def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout this package runs from; (None, None) outside a git checkout."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, dirty


def _zero_stage(cfg: RunConfig) -> int | None:
    """The ZeRO stage `cfg.method` runs (its own default when cfg.zero is None); None for an unknown method."""
    from baselines.base import get_strategy

    try:
        return get_strategy(cfg.method).zero_stage(cfg)
    except ConfigError:
        return cfg.zero


def new_record(cfg: RunConfig, *, sp_size: int, mode: str = "measured", zero: int | None = None) -> dict[str, Any]:
    """A record with every field present: identity, configuration and provenance filled, results None.
    `zero`: the ZeRO stage the method runs (its own default when cfg.zero is None)."""
    commit, dirty = git_state()
    record: dict[str, Any] = dict.fromkeys(FIELDS)
    record.update(
        schema_version=SCHEMA_VERSION,
        run_id=uuid.uuid4().hex,
        method=cfg.method,
        implementation=cfg.method,
        model=cfg.model,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        world_size=cfg.world_size,
        sp_size=sp_size,
        dp_size=cfg.world_size // sp_size,
        dtype=cfg.dtype,
        device=cfg.device,
        mode=mode,
        memory_budget=cfg.memory_budget,
        sac=cfg.sac,
        compile_backend=cfg.compile_backend,
        zero=zero if zero is not None else _zero_stage(cfg),
        git_commit=commit,
        git_dirty=dirty,
        versions=software_versions(),
        hostname=socket.gethostname(),
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        config_hash=cfg.config_hash(),
        config=cfg.to_dict(),
        extra={},
    )
    return record


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append `record` as one JSON line, atomically: a reader sees the whole line or none of it."""
    missing = [k for k in ("schema_version", "run_id", "status") if k not in record]
    if missing:
        raise ValueError(f"record lacks {missing}; build it with new_record()")
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # also orders writers on filesystems where O_APPEND alone is not atomic
        written = 0
        while written < len(line):  # a regular file takes it in one call; the loop only guards short writes
            written += os.write(fd, line[written:])
        os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as a JSON file atomically: a temporary file in the same folder, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of one JSONL file, in file order (a corrupt line is an error naming file and line)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON record ({exc.msg})") from exc
    return records


def load_records(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> pd.DataFrame:
    """All records of one or more JSONL files as one DataFrame.

    Nested dicts are flattened with dots (`iter_time_s.median`, `versions.torch`, `config.data.pad_fraction`,
    `extra.<metric>`); lists (`peak_mem_by_rank`, `iter_time_s.samples`) stay lists in one cell. A `source`
    column names the file each row came from. Missing files are an error: a typo must not look like no data.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    rows: list[dict[str, Any]] = []
    for path in paths:
        for record in read_records(path):
            record["source"] = str(path)
            rows.append(record)
    if not rows:
        return pd.DataFrame(columns=[*FIELDS, "source"])
    return pd.json_normalize(rows, sep=".")
