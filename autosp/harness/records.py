"""One JSON line per run: the contract between measuring and everything downstream (tables, figures, history).

Appends are atomic: the whole line goes out in one write() on an O_APPEND descriptor under an exclusive
flock, so concurrent writers (Snakemake jobs, search probes) never interleave or leave half a line. A last line
torn by something else (a killed writer of an older version, a full disk, a hand edit) is closed with a newline
before the next record, so the new record is always a line of its own; `load_records(..., skip_bad_lines=True)`
then reads every whole record and reports the torn one instead of failing on the whole file.
Commands check their output paths with `check_writable` before any work, so a finished run is never lost to an
unwritable `--out`; a write that fails midway (a full disk) is taken back, and the error is one line.
"""
from __future__ import annotations

import enum
import errno
import fcntl
import json
import os
import platform
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterable
from datetime import datetime, timezone
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autosp.harness.config import ConfigError, RunConfig

if TYPE_CHECKING:
    import pandas as pd

SCHEMA_VERSION = 1


class RunStatus(str, enum.Enum):
    """How a run (or a search probe) ended, as its record's `status` says: a `str`, so a status read back from a
    record compares equal to its member (`RunStatus.OK == "ok"`)."""

    OK = "ok"
    OOM = "oom"
    TIMEOUT = "timeout"
    ERROR = "error"
    INTERRUPTED = "interrupted"

    def __str__(self) -> str:
        return self.value


STATUSES = tuple(status.value for status in RunStatus)
#: every record has these keys (None where not applicable); `extra` holds method-specific metrics
FIELDS = (
    "schema_version", "run_id", "method", "implementation", "model", "seq_len", "batch_size", "world_size",
    "sp_size", "dp_size", "dtype", "device", "device_name", "mode", "status", "error", "peak_mem_bytes",
    "peak_mem_by_rank", "iter_time_s", "tokens_per_s", "loss", "memory_budget", "sac", "compile_backend",
    "zero", "precision", "git_commit", "git_dirty", "versions", "hostname", "timestamp", "config_hash", "config",
    "extra",
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
    from autosp.harness.strategy import get_strategy

    try:
        return get_strategy(cfg.method).zero_stage(cfg)
    except ConfigError:
        return cfg.zero


def _own_config(cfg: RunConfig) -> RunConfig:
    """`cfg` as `cfg.method` receives it: the options it does not honour at their defaults (unknown method: as is)."""
    from autosp.harness.strategy import get_strategy

    try:
        return get_strategy(cfg.method).own_config(cfg)
    except ConfigError:
        return cfg


def _precision(cfg: RunConfig) -> str | None:
    """What `--dtype` ran: float32, bfloat16-mixed (fp32 state), bfloat16-pure, ...; None for an unknown name."""
    from autosp.harness.precision import precision_of

    try:
        return precision_of(cfg.dtype).label
    except ConfigError:
        return None


def new_record(cfg: RunConfig, *, sp_size: int, mode: str = "measured", zero: int | None = None) -> dict[str, Any]:
    """A record with every field present: identity, configuration and provenance filled, results None.
    `zero`: the ZeRO stage the method runs (its own default when cfg.zero is None). The configuration recorded is
    the one the method receives: options it does not honour are left out (at their defaults)."""
    commit, dirty = git_state()
    cfg = _own_config(cfg)
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
        precision=_precision(cfg),
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
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # also orders writers on filesystems where O_APPEND alone is not atomic
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn last line: end it, keep the new record whole
            line = b"\n" + line
        try:
            written = 0
            while written < len(line):  # a regular file takes it in one call; a full disk writes part of it
                written += os.write(fd, line[written:])
            os.fsync(fd)
        except OSError as exc:  # a full disk or a file-size limit: take the part back, the file is as it was
            os.ftruncate(fd, size)
            raise ConfigError(f"cannot write a record to {path}: {exc.strerror or exc} (the file is as it was); "
                              "free space there or choose another --out, and rerun") from None
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


def check_writable(path: str | os.PathLike, flag: str = "--out") -> None:
    """ConfigError unless a file can be written at `path` (appended to, or replaced through its folder).

    Commands call this before any work, so a result is never computed only to be lost to a read-only filesystem,
    a parent path that is a file, or an output path that is a folder. Creates missing parent folders."""
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "it is a folder")
        blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise NotADirectoryError(errno.ENOTDIR, f"{blocking} is a file, not a folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, "the file is not writable")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"cannot write {flag} {path}: {reason}; choose a writable file path") from None


def read_records(path: str | os.PathLike, *, skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """The records of one JSONL file, in file order.

    A line that is not a JSON record is a ConfigError naming file and line, unless `skipped` is given: then the
    line is left out and described in `skipped` ("<file>:<line>: <why>")."""
    records = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    if not isinstance(record, dict):
                        raise ValueError(f"a JSON {type(record).__name__}, not an object")
                except ValueError as exc:  # JSONDecodeError is a ValueError
                    problem = f"{path}:{number}: not a JSON record ({getattr(exc, 'msg', exc)})"
                    if skipped is None:
                        raise ConfigError(f"{problem}; repair or delete that line, or skip bad lines "
                                          "(--skip-bad-lines)") from None
                    skipped.append(problem)
                    continue
                records.append(record)
    except OSError as exc:
        raise ConfigError(f"cannot read records file {path}: {exc.strerror or exc}") from None
    return records


def load_records(paths: str | os.PathLike | Iterable[str | os.PathLike], *,
                 skip_bad_lines: bool = False) -> pd.DataFrame:
    """All records of one or more JSONL files as one DataFrame.

    Nested dicts are flattened with dots (`iter_time_s.median`, `versions.torch`, `config.data.pad_fraction`,
    `extra.<metric>`); lists (`peak_mem_by_rank`, `iter_time_s.samples`) stay lists in one cell. A `source`
    column names the file each row came from. Missing files are an error: a typo must not look like no data.
    A line that is not a record is an error too, unless `skip_bad_lines`: then it is left out and listed in
    `df.attrs["skipped_lines"]`.
    """
    import pandas as pd  # here, not at the top: every rank imports this module, and pandas costs a second

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for path in paths:
        for record in read_records(path, skipped=skipped if skip_bad_lines else None):
            record["source"] = str(path)
            rows.append(record)
    df = pd.json_normalize(rows, sep=".") if rows else pd.DataFrame(columns=[*FIELDS, "source"])
    df.attrs["skipped_lines"] = skipped
    return df
