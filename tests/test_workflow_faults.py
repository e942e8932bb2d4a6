"""Faults at the workflow's scale, with a stand-in `autosp` (a script that writes its record after a pause, so a
fault can land while a cell runs): a cell's search SIGKILLed mid-run is recorded as that cell's error (one row
naming the exit status; the other cells untouched, a rerun redoes nothing finished); a second workflow run on the
same results directory while one runs is refused with a clear message and the first is not disturbed."""
from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_workflow import ROOT, snakemake

FINISHED, KILLED = "results/trainability/cpu/P2/tiny/autosp.jsonl", "results/trainability/cpu/P2/tiny/ulysses.jsonl"


def _slow_autosp(tmp_path: Path, seconds: float) -> Path:
    """A stand-in for `autosp search`: writes a started marker, sleeps, then one `ok` record to its --out (the
    workflow's `--record-failure` call writes an `error` row at once, as the real one does)."""
    fake = tmp_path / f"autosp-slow{seconds}"
    fake.write_text("#!/bin/sh\n"
                    'case "$*" in *--record-failure*) row=\'{"status": "error"}\';; *) row=\'{"status": "ok"}\';\n'
                    f'  touch "{tmp_path}/started.$$"; sleep {seconds};; esac\n'
                    'while [ $# -gt 0 ]; do [ "$1" = --out ] && echo "$row" >> "$2"\n'
                    f'  [ "$1" = --record-failure ] && echo "$2" > "{tmp_path}/reason"; shift; done\n')
    fake.chmod(0o755)
    return fake


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the workflow"
        time.sleep(0.2)


def _background(tmp_path: Path, fake: Path, *targets: str) -> subprocess.Popen:
    return subprocess.Popen(["snakemake", "--directory", str(tmp_path), *targets, "--cores", "1",
                             "--config", f"autosp={fake}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_cell_killed_mid_run_is_recorded_as_its_error_and_nothing_finished_is_redone(tmp_path: Path) -> None:
    fake = _slow_autosp(tmp_path, 0)
    done = snakemake(tmp_path, FINISHED, "--cores", "1", "--config", f"autosp={fake}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for marker in tmp_path.glob("started.*"):
        marker.unlink()
    slow = _slow_autosp(tmp_path, 30)
    run = _background(tmp_path, slow, FINISHED, KILLED)
    _wait_for(lambda: any(tmp_path.glob("started.*")))
    pid = int(next(tmp_path.glob("started.*")).suffix[1:])
    os.kill(pid, signal.SIGKILL)  # the cell's process, as the OOM killer or a node failure would end it
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 0, out[-2000:]
    assert (tmp_path / KILLED).read_text() == '{"status": "error"}\n'  # one row: not lost, not half-written
    assert "search exited with status 137" in (tmp_path / "reason").read_text()  # the reason the row is given
    assert (tmp_path / FINISHED).read_text() == '{"status": "ok"}\n'
    proc = snakemake(tmp_path, FINISHED, KILLED, "-n", "--config", f"autosp={slow}")
    assert proc.returncode == 0 and "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout


def test_a_second_run_on_the_same_results_is_refused_while_one_runs(tmp_path: Path) -> None:
    slow = _slow_autosp(tmp_path, 45)  # longer than a snakemake start on a loaded machine
    first = _background(tmp_path, slow, FINISHED)
    _wait_for(lambda: any(tmp_path.glob("started.*")))
    # snakemake locks the outputs a run will write: a run sharing any of them (here the running cell) is refused
    second = snakemake(tmp_path, FINISHED, KILLED, "--cores", "1", "--config", f"autosp={slow}")
    assert second.returncode != 0 and "cannot be locked" in second.stdout + second.stderr, second.stderr[-2000:]
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out[-2000:]  # the first run is not disturbed
    assert (tmp_path / FINISHED).read_text() == '{"status": "ok"}\n' and not (tmp_path / KILLED).exists()


PAGE = 4096
#: a cell's record file before the run: one whole record line, ending 64 bytes short of a page boundary
BEFORE = (json.dumps({"schema_version": 1, "run_id": "earlier", "status": "ok", "pad": ""})[:-2] +
          "x" * (PAGE - 64 - 60) + '"}\n').encode()


@contextlib.contextmanager
def _full_disk(tmp_path: Path):
    """A 64 KiB tmpfs holding BEFORE as cell.jsonl and a filler taking every other page: the next append finds
    64 bytes of room (the rest of cell.jsonl's page) and then ENOSPC."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the file-size-limit case still runs")
    try:
        (disk / "cell.jsonl").write_bytes(BEFORE)
        with contextlib.suppress(OSError), open(disk / "filler", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * PAGE)
        yield disk / "cell.jsonl", None
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@contextlib.contextmanager
def _file_size_limit(tmp_path: Path):
    """RLIMIT_FSIZE 64 bytes past BEFORE: the next append writes 64 bytes and then fails with EFBIG (Python
    ignores SIGXFSZ), as a full disk fails with ENOSPC."""
    out = tmp_path / "cell.jsonl"
    out.write_bytes(BEFORE)
    limit = len(BEFORE) + 64
    yield out, lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


@pytest.mark.parametrize("full", [_full_disk, _file_size_limit], ids=["tmpfs-enospc", "rlimit-efbig"])
def test_a_record_written_to_a_full_disk_is_not_half_written_and_the_error_is_one_line(tmp_path: Path, full) -> None:
    with full(tmp_path) as (out, limit):
        proc = subprocess.run([sys.executable, "-m", "autosp.cli", "run", "--method", "single", "--model", "tiny",
                               "--seq-len", "16", "--steps", "0", "--warmup", "0", "--out", str(out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, preexec_fn=limit)
        after = out.read_bytes()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert after == BEFORE  # the part of the record that fitted was taken back: no half line
    error = proc.stderr.strip()
    assert "\n" not in error and f"cannot write a record to {out}" in error, error
    assert ("No space left on device" if limit is None else "File too large") in error, error


#: the workflow at its smallest with the real `autosp`: two eager cells on tiny, one probe each (128 tokens)
SETTINGS = """
models: [tiny]
all_models: []
methods: [ulysses, ring]
peer: {method: ds-autosp, models: [], compare: [], check: [], check_seq_len: 256}
search_guide: {default: "off"}
granularity: 128
min_len: 128
max_len: 128
probe_timeout_s: 240
"""
CELLS = [f"results/trainability/cpu/P2/tiny/{method}.jsonl" for method in ("ulysses", "ring")]


def _processes_in(folder: Path) -> dict[int, tuple[int, str]]:
    """Live processes working in `folder` (the workflow's jobs, their ranks and fork servers): pid -> (ppid,
    cmdline)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if os.readlink(proc / "cwd") == str(folder) and stat[0] != "Z":
                found[int(proc.name)] = (int(stat[1]), (proc / "cmdline").read_text())
    return found


def _ranks_in(folder: Path) -> list[int]:
    """Rank processes working in `folder`: fresh interpreters (`rank_entry`) or children of a warm-rank fork server."""
    procs = _processes_in(folder)
    server = "multiprocessing.forkserver"
    return [pid for pid, (ppid, cmd) in procs.items()
            if "rank_entry" in cmd or (server in cmd and server in procs.get(ppid, (0, ""))[1])]


def test_a_rank_killed_mid_run_is_its_cells_error_with_no_orphan_and_nothing_finished_redone(tmp_path: Path) -> None:
    settings = tmp_path / "faults.yaml"
    settings.write_text(SETTINGS)
    config = ("--configfile", str(settings))
    run = subprocess.Popen(["snakemake", "--directory", str(tmp_path), *CELLS, "--cores", "2", *config], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: _ranks_in(tmp_path), timeout_s=300)  # the first cell's first rank is up
    victim = _ranks_in(tmp_path)[0]
    os.kill(victim, signal.SIGKILL)  # one rank, as the OOM killer or a failing node would end it
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out[-3000:]
    assert not _processes_in(tmp_path), "processes outlived the workflow run"  # no orphan rank or job
    rows = {cell: [json.loads(line) for line in (tmp_path / cell).read_text().splitlines()] for cell in CELLS}
    killed = [cell for cell in CELLS if rows[cell][-1]["status"] == "error"]
    assert len(killed) == 1, {cell: [r["status"] for r in rows[cell]] for cell in CELLS}
    probe, result = rows[killed[0]]
    # the probe is that cell's error, naming the killed rank, within seconds (not the probe timeout)
    assert probe["status"] == "error" and "SIGKILL" in probe["error"] and "\n" not in probe["error"], probe["error"]
    assert probe["extra"]["wall_s"] < 120, probe["extra"]["wall_s"]
    assert result["kind"] == "search" and result["error"] == probe["error"]
    finished, = set(CELLS) - set(killed)
    assert [r["status"] for r in rows[finished]] == ["ok", "no_oom_up_to_max_len"]  # the other cell measured
    again = snakemake(tmp_path, *CELLS, "-n", *config)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, again.stdout
