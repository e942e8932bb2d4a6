"""Rank processes the parent can always end, and SIGTERM/SIGINT turned into an orderly stop.

Why each piece is the way it is:
- Every rank is started by `subprocess.Popen(process_group=0)`: the child joins a new process group (its own pid)
  between fork and exec, and Popen returns only after the exec, so from the first moment the parent can see the
  rank, one `killpg` ends it and everything it started (compile workers, ...), even while it still imports torch.
- A rank reports through its own file, written to a temporary name and renamed: no pipe for a rank to block on
  when nobody reads it, and a report is either whole or absent.
- Rank output (library banners, profiler lines, prints) goes to one log file, not to the terminal; the launcher
  keeps its tail for a failed run's record.
- `trap_signals()` turns SIGTERM (snakemake, `timeout`, SLURM) and SIGINT (Ctrl-C) into a flag the supervisor
  polls, so the parent ends and reaps the ranks, records the run as `interrupted` and exits normally, instead of
  dying mid-write with its ranks orphaned. Each rank also asks the kernel to kill it if the parent dies without
  cleaning up (SIGKILL of the parent: nothing else can run then).
- Warm ranks (`warm_ranks`, CPU only, opt-in): instead of a fresh interpreter per rank, a fork server that imported
  the heavy modules once (torch, Dynamo, the runner: most of a short CPU rank's cost) forks each rank. The rank
  takes the launcher's environment, working directory and sys.path, makes itself a process-group leader before
  anything else, and dies with the fork server, which dies with the launcher. A SIGTERM to the launcher's whole
  process group (a scheduler's) kills the server and so its ranks, but the launcher's trap has already noted the
  stop, so the run is still `interrupted`. The test suite and the CLI's CPU commands use it.
This module knows nothing of torch; `autosp.harness.launch` builds the rank protocol on it.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: the signals that stop a launch in an orderly way
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: exit code of a command stopped by one of them (128 + SIGINT, the shell's convention for Ctrl-C)
INTERRUPTED_EXIT_CODE = 130
#: how long killed process groups get to disappear (SIGKILL is not ignorable: this is only scheduling delay)
_REAP_S = 10.0
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
#: the process name (/proc/PID/comm) of a warm rank; a fresh rank's command line names this module instead
WARM_RANK_NAME = b"autosp-rank"

_caught: list[str] = []  # names of the stop signals received while trapped, first first
#: modules the fork server of warm ranks imports once (None: every rank is a fresh interpreter)
_warm_preload: tuple[str, ...] | None = None
_warm_depth = 0  # nested `warm_ranks` uses; the outermost one stops the server


def _note(signum: int, frame: object) -> None:
    _caught.append(signal.Signals(signum).name)


def stop_requested() -> str | None:
    """The first stop signal received under `trap_signals` ('SIGTERM', 'SIGINT'), or None."""
    return _caught[0] if _caught else None


@contextlib.contextmanager
def trap_signals() -> Iterator[None]:
    """While active, SIGTERM and SIGINT only set `stop_requested()`; nested uses share the outermost trap.

    Outside the main thread (where Python cannot install handlers) this does nothing."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is _note:
        yield
        return
    previous = {s: signal.signal(s, _note) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _caught.clear()


_BOOTSTRAP = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
              "from autosp.harness.supervisor import rank_entry; rank_entry(sys.argv[2], int(sys.argv[3]))")


def rank_entry(payload: str, parent: int) -> None:
    """Body of a rank process: die with the parent, then run the pickled `target(*args)`."""
    with contextlib.suppress(OSError, AttributeError):  # Linux only; elsewhere the parent's killpg still works
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request above took effect
        os._exit(1)
    with open(payload, "rb") as f:
        target, args = pickle.load(f)
    target(*args)


@contextlib.contextmanager
def warm_ranks(preload: tuple[str, ...] | None) -> Iterator[None]:
    """While active, `RankProcesses(warm=True)` forks ranks from one server that imported `preload` once per
    launcher process (None turns warm ranks off). The server starts at the first warm launch; the outermost use
    stops it and reaps it on leaving, so the launcher's own CPU accounting (`time`, rusage) includes its ranks."""
    global _warm_preload, _warm_depth
    previous, _warm_preload = _warm_preload, preload
    _warm_depth += 1
    try:
        yield
    finally:
        _warm_preload = previous
        _warm_depth -= 1
        if _warm_depth == 0:
            from multiprocessing import forkserver
            forkserver._forkserver._stop()


def warm_rank_cpu_seconds() -> float:
    """CPU-seconds of the warm ranks that ended so far (the fork server's reaped children; 0 without a server)."""
    from multiprocessing import forkserver
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    fields = None if pid is None else _proc_stat(Path(f"/proc/{pid}/stat"))
    if fields is None:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime + cstime


def _forked_rank_entry(payload: str, log_path: str, env: dict[str, str], cwd: str, path: list[str]) -> None:
    """Body of a warm rank, forked by the server: become a group leader, take the launcher's context, run."""
    os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):  # `ps` and /proc/PID/comm show the rank, not the server's name
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, WARM_RANK_NAME)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    rank_entry(payload, os.getppid())


class _ForkedRank:
    """A warm rank seen through the part of `subprocess.Popen` the supervisor uses (pid, poll, wait)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        """The exit code as soon as the rank has died: the fork server (its parent) reports it once it has reaped
        the rank, which on a loaded machine can come seconds later; until then the kernel has it in the zombie."""
        code = self.process.exitcode
        return _zombie_exit_code(self.pid) if code is None else code

    def wait(self) -> int | None:
        self.process.join()
        return self.process.exitcode


def _zombie_exit_code(pid: int) -> int | None:
    """The exit code (negative: the signal) of process `pid` if it is a zombie, else None (running, or reaped)."""
    fields = _proc_stat(Path(f"/proc/{pid}/stat"))
    if fields is None or fields[0] != "Z" or len(fields) < 50:  # field 52 of stat, the wait status, since Linux 3.5
        return None
    status = int(fields[49])
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def write_report(path: str | os.PathLike, report: Any) -> None:
    """Publish a rank's report atomically: the parent sees the whole pickle or no file."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(report, f)
    os.replace(tmp, path)


def read_report(path: str | os.PathLike) -> Any | None:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


class RankProcesses:
    """P rank processes, each the leader of its own process group; `end()` kills and reaps all of them."""

    def __init__(self, workdir: Path, target: Callable[..., None], args_per_rank: list[tuple],
                 warm: bool = False) -> None:
        """`warm`: fork the ranks from the warm-rank server where `warm_ranks` is active (else fresh processes)."""
        self.workdir = workdir
        self.log_path = workdir / "ranks.log"
        self.procs: list[subprocess.Popen | _ForkedRank] = []
        start = self._fork if warm and _warm_preload is not None else self._spawn
        try:
            for rank, args in enumerate(args_per_rank):
                payload = workdir / f"rank{rank}.in"
                payload.write_bytes(pickle.dumps((target, args)))
                self.procs.append(start(str(payload)))
        except BaseException:
            self.end()
            raise

    def _spawn(self, payload: str) -> subprocess.Popen:
        with open(self.log_path, "ab") as log:
            command = [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), payload, str(os.getpid())]
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    process_group=0)

    def _fork(self, payload: str) -> _ForkedRank:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(_warm_preload or ()))
        process = context.Process(target=_forked_rank_entry, name=f"autosp-rank:{payload}", args=(
            payload, str(self.log_path), dict(os.environ), os.getcwd(), list(sys.path)))
        process.start()
        return _ForkedRank(process)

    def exit_code(self, rank: int) -> int | None:
        return self.procs[rank].poll()

    def wait_all(self, seconds: float, stop: Callable[[], bool]) -> None:
        """Give the ranks up to `seconds` to exit by themselves (their atexit clean-up runs); stop early on `stop()`."""
        deadline = time.monotonic() + seconds
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline and not stop():
            time.sleep(0.05)

    def end(self) -> None:
        """SIGKILL every rank's process group and wait until the ranks are reaped and the groups are empty."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            # forked before it could make its own group: not reached by killpg
            if isinstance(p, _ForkedRank) and p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()
        deadline = time.monotonic() + _REAP_S
        for p in self.procs:  # descendants were re-parented; wait until the kernel has removed them too
            while _group_alive(p.pid) and time.monotonic() < deadline:
                time.sleep(0.02)

    def output_tail(self, lines: int = 40) -> str:
        """The last lines the ranks printed (for a failed run's record)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is still running (zombies waiting for their new parent count as gone)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _proc_stat(stat)
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return not Path("/proc/self").exists()  # no /proc to tell zombies apart: trust killpg


def _proc_stat(path: Path) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None if the process is gone."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
