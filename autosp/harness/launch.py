"""Run one function on P ranks and bring back each rank's result, or an honest failure status.

Two ways to get ranks:
- local: spawn P fresh processes (gloo on 127.0.0.1, the launcher serving the rendezvous; nccl on CUDA, which is RCCL on
  ROCm builds of torch), one GPU per rank - or, with `AUTOSP_SHARE_GPUS=1`, P ranks round-robin on fewer GPUs
  over gloo (NCCL refuses two ranks on one GPU): the multi-rank CUDA code paths and each rank's own memory peak on
  a one-GPU machine; step times mean nothing there (the ranks share one GPU and talk through host memory);
- join: the current process already is one rank of a torchrun or SLURM job (env:// variables, or
  SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID with MASTER_ADDR / MASTER_PORT); the function runs here and the
  results are gathered over the process group.

Locally the parent owns the outcome (`autosp.harness.supervisor`): every rank is the leader of its own process
group from the moment it exists, so a crashed, killed, hung or timed-out run - or SIGTERM/SIGINT to the parent,
recorded as `interrupted` - is ended by killing those groups (compile workers and other descendants included) and
reaping them. The run never hangs past its timeout and leaves no process behind.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import re
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autosp.harness.config import ConfigError
from autosp.harness.host_allocator import keep_freed_memory
from autosp.harness.supervisor import RankProcesses, read_report, stop_requested, trap_signals, write_report

#: how long a rank that already failed gives the others to report, so the first failure's message wins
_GRACE_S = 1.0
_POLL_S = 0.05
#: how long ranks that all reported success get to exit normally before their process groups are killed
_EXIT_GRACE_S = 30.0
#: what a warm CPU rank's fork server imports once (`supervisor.warm_ranks`): most of a short rank's start-up cost
WARM_RANK_PRELOAD = ("torch", "torch._dynamo", "torch._functorch.aot_autograd", "autosp.harness.runner", "autosp.api",
                     "transformers.models.llama.modeling_llama")
#: what a compiling rank imports at its first compile, also under aot_eager (AOT autograd's min-cut partitioner
#: imports Inductor's pattern matcher for its CSE): about 1 CPU-s a rank, imported once by the server instead
COMPILER_PRELOAD = ("torch._inductor.pattern_matcher",)
#: the built-in methods whose ranks compile
COMPILING_METHODS = ("autosp", "ds-autosp", "ulysses-compile")


def warm_preload(method_specs: str) -> tuple[str, ...]:
    """What the warm-rank server of a command running `method_specs` ("autosp", "ulysses[ac=layer],zero3") imports
    once: the common start-up modules, the compiler's where a method compiles, and each built-in method's own module
    (DeepSpeed's for zero3, alst, ...)."""
    from autosp.harness.strategy import BUILTIN_MODULES

    names = [n.strip() for n in re.sub(r"\[[^\]]*\]", "", method_specs).split(",")]
    compiler = COMPILER_PRELOAD if any(n in COMPILING_METHODS for n in names) else ()
    return WARM_RANK_PRELOAD + compiler + tuple(dict.fromkeys(BUILTIN_MODULES[n] for n in names
                                                              if n in BUILTIN_MODULES))


#: set to 1 to run several local ranks on one GPU over gloo (see the module docstring)
SHARE_GPUS_ENV = "AUTOSP_SHARE_GPUS"
#: resident memory of one idle CPU rank before any model (Python, torch, gloo, the harness): 343 MiB measured on
#: the 2-core development machine, in line with 64 ranks taking ~22 GB there
CPU_RANK_BYTES = 350 * 2**20


@dataclass
class LaunchResult:
    """What came back from a launch. `results[r]` is rank r's return value (None if it never returned)."""

    status: str  # ok | oom | error | timeout | interrupted
    results: list[Any]
    error: str | None = None  # one line: which rank failed and how
    failed_rank: int | None = None
    traceback: str | None = None  # the failing rank's full traceback, when there is one
    elapsed_s: float = 0.0
    rank_errors: dict[int, str] = field(default_factory=dict)
    output_tail: str = ""  # the last lines the ranks printed, kept when the run did not succeed


@dataclass(frozen=True)
class JobEnv:
    """The rank layout of an already running distributed job (torchrun or SLURM)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm"


def existing_job() -> JobEnv | None:
    """The surrounding multi-process job, if this process is one rank of one; None for a plain process.

    A single-task SLURM allocation (salloc, sbatch with one task) is not a job to join: local ranks are spawned.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and int(env["WORLD_SIZE"]) > 1:
        if "MASTER_ADDR" not in env:
            raise ConfigError("RANK/WORLD_SIZE are set but MASTER_ADDR is not; launch with torchrun or export it")
        return JobEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                      env["MASTER_ADDR"], int(env.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        if "MASTER_ADDR" not in env:
            raise ConfigError(
                "SLURM job with several tasks but MASTER_ADDR is unset; in the batch script run "
                "`export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)`"
            )
        return JobEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                      env["MASTER_ADDR"], int(env.get("MASTER_PORT", 29500)), "slurm")
    return None


def check_device(device: str, world_size: int) -> None:
    """ConfigError when the requested device cannot host `world_size` local ranks (before anything starts)."""
    if world_size < 1:
        raise ConfigError(f"--world-size must be a positive integer, got {world_size}")
    if device == "cpu":
        return
    if device != "cuda":
        raise ConfigError(f"unknown --device {device!r}; use cpu or cuda (ROCm builds of torch also use cuda)")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"--device cuda needs a GPU but torch {torch.__version__} sees none "
            "(CPU build or no visible device); use --device cpu"
        )
    job = existing_job()
    per_node = torch.cuda.device_count()
    if job is None and world_size > per_node and not ranks_share_gpus():
        raise ConfigError(f"--world-size {world_size} needs {world_size} GPUs but only {per_node} are visible; "
                          f"use --world-size <= {per_node}, launch with torchrun/SLURM across nodes, or set "
                          f"{SHARE_GPUS_ENV}=1 to test on shared GPUs (gloo; memory per rank is real, times are not)")
    if job is not None and job.local_rank >= per_node and not ranks_share_gpus():
        raise ConfigError(f"local rank {job.local_rank} has no GPU: only {per_node} are visible on this node")


def check_host_memory(world_size: int) -> None:
    """ConfigError when this machine cannot hold `world_size` idle CPU ranks (checked before spawning any)."""
    available = _available_host_memory()
    if available is not None and world_size * CPU_RANK_BYTES > available:
        most = available // CPU_RANK_BYTES
        raise ConfigError(
            f"--world-size {world_size} needs about {world_size * CPU_RANK_BYTES / 2**30:.1f} GiB of host memory for "
            f"its CPU ranks before any model ({CPU_RANK_BYTES >> 20} MiB each), but {available / 2**30:.1f} GiB is "
            f"available; use --world-size {most} or less")


def _available_host_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def ranks_share_gpus() -> bool:
    """Whether local ranks may share GPUs (AUTOSP_SHARE_GPUS=1): then they talk over gloo, which stages CUDA
    tensors through host memory, because NCCL refuses a communicator with two ranks on one GPU."""
    return os.environ.get(SHARE_GPUS_ENV, "") == "1"


def backend_for(device: str) -> str:
    """gloo on CPU and on shared GPUs; nccl on CUDA, which ROCm builds of torch route to RCCL."""
    return "gloo" if device == "cpu" or ranks_share_gpus() else "nccl"


def current_device(device: str) -> torch.device:
    """This rank's device: the GPU the launcher bound it to, or the CPU."""
    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the rendezvous binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_store(timeout_s: float) -> dist.TCPStore:
    """A local launch's rendezvous, served by the launcher for the whole run on a port the OS picks while binding
    it. (A port found free and bound later by rank 0, seconds later under load, could be taken meanwhile by any
    connection's ephemeral port: EADDRINUSE in a rank, a multi-rank flake.) The ranks join it as clients."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))


def _classify(exc: BaseException) -> str:
    return "oom" if isinstance(exc, torch.OutOfMemoryError) else "error"


def _one_line(exc: BaseException) -> str:
    """`Type: first line` of an error and of its root cause: a first line that only introduces what follows
    ("backend='backend_fn' raised:") takes the next line with it, and an explicit cause (`raise ... from e`) is
    named after `<-`, so the record's one-line error says what went wrong, not only where it surfaced."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    for line in lines[1:]:
        if not text.endswith(":"):
            break
        text = f"{text} {line}"
    message = f"{type(exc).__name__}: {text}".rstrip(": ")
    if exc.__cause__ is not None and exc.__cause__ is not exc:
        cause = _one_line(exc.__cause__)
        if cause.split(": ", 1)[-1] not in message:
            message = f"{message} <- {cause}"
    return message


def _bind_rank(device: str, rank: int, world_size: int, local_rank: int) -> None:
    if device == "cpu":
        torch.set_num_threads(1)  # P ranks share the machine's cores
        keep_freed_memory()  # step times without re-faulting freed memory, as on a device (host_allocator)
    else:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())  # one GPU per rank unless they share


def _init_group(device: str, rank: int, world_size: int, timeout_s: float, port: int | None = None) -> None:
    """Join the default group: through the local launcher's store on `port`, or a job's env:// rendezvous."""
    timeout = datetime.timedelta(seconds=max(timeout_s, 1.0))
    store = None if port is None else dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend_for(device), init_method=None if store else "env://", store=store,
        rank=rank, world_size=world_size, timeout=timeout,
        device_id=torch.device("cuda", torch.cuda.current_device()) if backend_for(device) == "nccl" else None,
    )


def _worker(rank: int, world_size: int, port: int, device: str, timeout_s: float,
            fn: Callable[..., Any], args: tuple, report_path: str) -> None:
    """Body of a spawned rank: bind device, join the group, run, report through its file, leave."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    try:
        _bind_rank(device, rank, world_size, rank)
        _init_group(device, rank, world_size, timeout_s, port)
        # Plain pickle copies tensor data into the report (no file descriptors shared with a dying process).
        report = (rank, "ok", pickle.dumps(fn(*args)), None, None)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent, with its kind
        report = (rank, _classify(exc), None, f"rank {rank}: {_one_line(exc)}", traceback.format_exc())
    write_report(report_path, report)
    if report[1] == "ok" and dist.is_initialized():
        dist.destroy_process_group()


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        hint = " (killed; out of host memory?)" if -code == signal.SIGKILL else ""
        return f"died from signal {name}{hint}"
    return f"exited with code {code} without reporting"


def interruptible() -> contextlib.AbstractContextManager:
    """SIGTERM/SIGINT end local launches as `interrupted` (see `supervisor.trap_signals`). Inside a torchrun/SLURM
    job the signals keep their default meaning: the job's launcher owns the ranks."""
    return trap_signals() if existing_job() is None else contextlib.nullcontext()


def launch_local(fn: Callable[..., Any], args: tuple = (), *, world_size: int, device: str = "cpu",
                 timeout_s: float = 600.0) -> LaunchResult:
    """Spawn `world_size` ranks on this machine and run `fn(*args)` on each.

    `fn` and `args` are pickled by reference: `fn` must be a module-level function of an importable module.
    Whatever happens - success, a crash, a hang past `timeout_s`, SIGTERM/SIGINT to this process - every rank and
    everything it started has ended when this returns.
    """
    check_device(device, world_size)
    if device == "cpu":
        check_host_memory(world_size)
    start = time.monotonic()
    with trap_signals(), tempfile.TemporaryDirectory(prefix="autosp-ranks-") as tmp:
        if stop_requested():
            return _interrupted([None] * world_size, start, "")
        workdir = Path(tmp)
        store = rendezvous_store(timeout_s)  # held until every rank has ended
        port = store.port
        reports = [str(workdir / f"rank{r}.out") for r in range(world_size)]
        try:
            ranks = RankProcesses(workdir, _worker, [(r, world_size, port, device, timeout_s, fn, args, reports[r])
                                                     for r in range(world_size)], warm=device == "cpu")
        except Exception:
            if not stop_requested():
                raise
            # a signal to the whole process group also ends the fork server while it starts a rank
            return _interrupted([None] * world_size, start, "")
        try:
            values, failures, complete = _supervise(ranks, reports, start + timeout_s, timeout_s)
            if complete and not failures:  # let finished ranks exit by themselves first
                ranks.wait_all(min(_EXIT_GRACE_S, max(0.0, start + timeout_s - time.monotonic())), stop_requested)
        finally:
            ranks.end()
        tail = ranks.output_tail() if failures or not complete else ""
        if not complete and not failures:  # stopped by a signal; an outcome the ranks already decided is kept
            return _interrupted(values, start, tail)
    elapsed = time.monotonic() - start
    if not failures:
        return LaunchResult("ok", values, elapsed_s=elapsed)
    result = _failed(failures, values, elapsed)
    result.output_tail = tail
    return result


def _supervise(ranks: RankProcesses, reports: list[str], deadline: float,
               timeout_s: float) -> tuple[list[Any], list[tuple[int, str, str, str | None]], bool]:
    """Poll the ranks' report files until all reported, one failed (plus a grace for the others), the deadline
    passed or a stop signal came. Returns (values by rank, failures as (rank, kind, message, traceback), whether
    every rank reported)."""
    world_size = len(reports)
    values: list[Any] = [None] * world_size
    reported: set[int] = set()
    failures: list[tuple[int, str, str, str | None]] = []
    fail_deadline = None
    while len(reported) < world_size and not stop_requested():
        now = time.monotonic()
        if fail_deadline is not None and now >= fail_deadline:
            break
        if now >= deadline:
            missing = sorted(set(range(world_size)) - reported)
            failures.append((missing[0], "timeout",
                             f"rank(s) {missing} did not finish within the {timeout_s:g} s timeout", None))
            break
        for r in sorted(set(range(world_size)) - reported):
            exit_code = ranks.exit_code(r)  # read before the report: a rank that exited has written it, if ever
            report = read_report(reports[r])
            if report is not None:
                reported.add(r)
                _, kind, value, message, tb = report
                if kind == "ok":
                    values[r] = pickle.loads(value)
                else:
                    failures.append((r, kind, message, tb))
            elif exit_code is not None:
                reported.add(r)
                failures.append((r, "error", f"rank {r} {_exit_description(exit_code)}", None))
        if failures and fail_deadline is None:
            fail_deadline = time.monotonic() + _GRACE_S
        time.sleep(_POLL_S)
    return values, failures, len(reported) == world_size


def _interrupted(values: list[Any], start: float, tail: str) -> LaunchResult:
    elapsed = time.monotonic() - start
    return LaunchResult("interrupted", values, error=f"interrupted by {stop_requested()} after {elapsed:.1f} s; "
                        "every rank was ended", elapsed_s=elapsed, output_tail=tail)


def _failed(failures: list[tuple[int, str, str, str | None]], values: list[Any], elapsed: float) -> LaunchResult:
    first = _first_cause(failures)
    return LaunchResult(first[1], values, error=first[2], failed_rank=first[0], traceback=first[3],
                        elapsed_s=elapsed, rank_errors={r: m for r, _, m, _ in failures})


#: words in a rank's error that say it only saw a peer go away (a consequence, not the cause)
_PEER_SYMPTOMS = ("by peer", "remote worker", "communicator was aborted", "Socket Timeout")


def _first_cause(failures: list[tuple[int, str, str, str | None]]) -> tuple[int, str, str, str | None]:
    """The root failure: an OOM first, then a rank's own error or death, and only then a peer's lost connection."""
    def rank_of(f: tuple[int, str, str, str | None]) -> int:
        if f[1] == "oom":
            return 0
        return 2 if any(s in (f[2] or "") for s in _PEER_SYMPTOMS) else 1
    return min(failures, key=rank_of)  # stable: among equals the first reported wins


def launch_in_job(fn: Callable[..., Any], args: tuple = (), *, job: JobEnv, device: str = "cpu",
                  timeout_s: float = 600.0) -> LaunchResult:
    """Run `fn(*args)` as this rank of an existing torchrun/SLURM job; every rank gets everyone's results.

    A local failure is shared with the peers through the final gather. A hung peer is ended by the process
    group timeout (collectives raise after `timeout_s`) and, as a last resort, a watchdog that exits this
    process 30 s later so the job scheduler tears the job down.
    """
    check_device(device, job.world_size)
    os.environ.setdefault("RANK", str(job.rank))
    os.environ.setdefault("WORLD_SIZE", str(job.world_size))
    os.environ.setdefault("LOCAL_RANK", str(job.local_rank))
    os.environ.setdefault("MASTER_ADDR", job.master_addr)
    os.environ.setdefault("MASTER_PORT", str(job.master_port))
    watchdog = threading.Timer(timeout_s + 30.0, lambda: os._exit(124))
    watchdog.daemon = True
    watchdog.start()
    start = time.monotonic()
    try:
        _bind_rank(device, job.rank, job.world_size, job.local_rank)
        if not dist.is_initialized():
            _init_group(device, job.rank, job.world_size, timeout_s)
        try:
            mine = (job.rank, "ok", fn(*args), None, None)
        except BaseException as exc:  # noqa: BLE001
            kind = "timeout" if isinstance(exc, dist.DistBackendError) and "timed out" in str(exc) else _classify(exc)
            mine = (job.rank, kind, None, f"rank {job.rank}: {_one_line(exc)}", traceback.format_exc())
        everyone: list[Any] = [None] * job.world_size
        dist.all_gather_object(everyone, mine)
    finally:
        watchdog.cancel()
    values = [e[2] for e in everyone]
    failures = [(r, k, m, tb) for r, k, _, m, tb in everyone if k != "ok"]
    elapsed = time.monotonic() - start
    if not failures:
        return LaunchResult("ok", values, elapsed_s=elapsed)
    return _failed(failures, values, elapsed)


def launch(fn: Callable[..., Any], args: tuple = (), *, world_size: int, device: str = "cpu",
           timeout_s: float = 600.0) -> LaunchResult:
    """Run `fn(*args)` on `world_size` ranks: join the surrounding torchrun/SLURM job if there is one, else spawn."""
    job = existing_job()
    if job is None:
        return launch_local(fn, args, world_size=world_size, device=device, timeout_s=timeout_s)
    if job.world_size != world_size:
        raise ConfigError(f"--world-size {world_size} does not match the surrounding {job.source} job's "
                          f"{job.world_size} ranks; pass --world-size {job.world_size}")
    return launch_in_job(fn, args, job=job, device=device, timeout_s=timeout_s)
