"""Helpers for tests that must show no process is left behind: every process a test starts carries a marker in
its environment (inherited by ranks and their children), and the tests look for it in /proc."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from autosp.harness.supervisor import WARM_RANK_NAME

ROOT = Path(__file__).resolve().parents[2]
MARK = "AUTOSP_TEST_MARK"


def new_mark() -> str:
    return uuid.uuid4().hex


def marked_processes(mark: str, *, ranks_only: bool = False) -> list[int]:
    """Live (non-zombie) processes other than this one whose environment carries `mark`."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        if pid == os.getpid():
            continue
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if ranks_only and b"autosp.harness.supervisor" not in (proc / "cmdline").read_bytes() \
                    and (proc / "comm").read_bytes().strip() != WARM_RANK_NAME:
                continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append(pid)
    return found


def start_cli(args: list[str], mark: str, cwd: Path, own_group: bool = False) -> subprocess.Popen:
    """`python -m autosp ARGS` with the marker in its environment (`own_group`: as the leader of a new process
    group, as a scheduler starts a job)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), MARK: mark}
    return subprocess.Popen([sys.executable, "-m", "autosp", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0 if own_group else None)


def interrupt_once_ranks_run(proc: subprocess.Popen, mark: str, sig: signal.Signals,
                             wait_s: float = 120.0, group: bool = False) -> tuple[str, str, float]:
    """Wait until the command's ranks exist, send `sig` to the command (`group`: to its whole process group, as
    snakemake, SLURM and `timeout` do), wait for it to end.
    Returns (stdout, stderr, seconds from the signal to the command's exit)."""
    deadline = time.monotonic() + wait_s
    while not marked_processes(mark, ranks_only=True):
        assert proc.poll() is None, f"the command ended before starting ranks: {proc.communicate()}"
        assert time.monotonic() < deadline, "no rank started"
        time.sleep(0.1)
    sent = time.monotonic()
    os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    out, err = proc.communicate(timeout=wait_s)
    return out, err, time.monotonic() - sent
