"""`autosp calibrate`: the `cpu` row of the time model's rates (`autosp/reference/device_rates.csv`), measured once on
this machine as the ranks of a CPU run see it: P gloo ranks, one thread each (as `autosp run` binds them), all
measuring at once so that they share the cores and the memory bus as a run's ranks do.

Per rank, each the median of `repeats` timings after one untimed call (float32, the CPU runs' dtype): matmul FLOP/s
(a linear layer's three matmuls, forward [2048, 128] x [128, 512] and backward's input and weight gradients, as
every projection of a step runs them: a CPU preset's projection at a few thousand local tokens), attention FLOP/s
(causal SDPA forward + backward, [1, 4, S, `CPU_HEAD_DIM`], the CPU presets' head size: forward 4·H·D·S(S+1)/2,
backward 2.5x that, as the simulator counts it; at S = 2048, the row's attention fraction, and at each of
`ATTENTION_KEYS`, its `attention_by_keys`: a CPU flash kernel's rate grows with the keys and with the head size),
memory bytes/s (an add of two 32 MiB tensors: read 2, write 1), copy bytes/s (a clone of 32 MiB: the offload's copy
on a CPU), per-op overhead (an add of one-element tensors), gloo's bandwidth (an all-gather of 32 MiB: (P-1)/P of
it sent per rank), each kind of collective at four sizes in a tight loop (`_collectives_by_bytes`, the row's
`collective_by_bytes`), a one-element all-reduce's latency and the wait for the slower rank at it, fitted together
(`fit_latency_and_wait`: its extra time in a tight loop and after three stretches of work, the ranks' mean, as the
faster rank waits and the slower not), and, where DeepSpeed is installed, the host work of one call of ZeRO-3's
parameter coordinator (a module's hook fetching its parameters before it runs or releasing them after): a forward
and backward through a ZeRO-3 engine of `HOOK_LAYERS` linear layers ([128, 448] and [448, 128], a CPU preset's MLP
weights, every one partitioned), less the same layers' unsharded step, over the coordinator's calls in that step
(counted as the simulator counts them), in this thread's CPU seconds outside the collectives (the time model prices
those apart; wall time also held the other rank's jitter). The slowest rank's figure is written (latency
and wait excepted): a step ends when its slowest rank does."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from autosp.harness.config import ConfigError

MIB = 1 << 20
#: layers of the ZeRO-3 hook measurement, and their weights' shape
HOOK_LAYERS = 16
HOOK_SHAPE = (448, 128)
#: `deepspeed.comm`'s collectives a ZeRO-3 engine calls (`_clock_outside_collectives` stands still inside them)
COLLECTIVES = ("allgather_fn", "all_gather_into_tensor", "all_gather", "reduce_scatter_fn", "reduce_scatter_tensor",
               "reduce_scatter", "all_reduce", "broadcast", "all_to_all_single")
#: the stretches of work (128x128 matmuls: about 0.7, 3 and 12 ms here) a collective waits after
#: (`_collective_after_work`)
WAIT_MATMULS = (16, 64, 256)
#: the floats a rank holds at which each kind of collective is timed (`_collectives_by_bytes`: 4 B, 32 KiB, 512 KiB,
#: 8 MiB, the span of a CPU preset's parameter shards, activations and gradient buckets)
COLLECTIVE_FLOATS = (1, 8192, 131072, 2097152)
#: key lengths the attention rate is measured at (the cpu row's `attention_by_keys`; 2048 is its attention fraction)
ATTENTION_KEYS = (512, 1024, 2048, 4096)
#: the head size attention is measured at: every CPU preset's (hidden / heads; a flash kernel's rate per FLOP falls
#: with it: docs/measurements/2026-12-07-time-by-op.md)
CPU_HEAD_DIM = 16


def _seconds(fn: Callable[[], object], repeats: int, inner: int = 1,
             clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of one call of `fn` (each timing `inner` calls) by `clock`, after one untimed call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = clock()
        for _ in range(inner):
            fn()
        samples.append((clock() - start) / inner)
    return statistics.median(samples)


def measure_rank(repeats: int) -> dict[str, float]:
    """This rank's rates (the module docstring says what each times)."""
    torch.manual_seed(0)
    a, w, g = torch.randn(2048, 128), torch.randn(128, 512), torch.randn(2048, 512)  # input, weight, output's grad
    matmul = 3 * 2 * 2048 * 128 * 512 / _seconds(lambda: (a @ w, g @ w.t(), a.t() @ g), repeats, 5)
    x, y = torch.randn(8 * MIB), torch.randn(8 * MIB)  # 32 MiB each
    memory = 3 * x.nbytes / _seconds(lambda: x + y, repeats)
    copy = x.nbytes / _seconds(x.clone, repeats)
    one = torch.ones(1)
    overhead = _seconds(lambda: one + one, repeats, 2000)
    world = dist.get_world_size()
    latency = _seconds(lambda: dist.all_reduce(one), repeats, 20)
    gathered = torch.empty(world * x.numel())
    gather = _seconds(lambda: dist.all_gather_into_tensor(gathered, x), repeats)
    peer = (world - 1) / world * gathered.nbytes / max(gather - latency, 1e-9)
    by_keys = {keys: _attention_rate(keys, repeats) for keys in ATTENTION_KEYS}
    return {"matmul": matmul, "attention": by_keys[2048], "by_keys": by_keys, "memory": memory,
            "copy": copy, "overhead": overhead, "peer": peer, "collectives": _collectives_by_bytes(repeats),
            "collective_points": [(0.0, latency), *_collective_after_work(one, repeats)],
            "zero3_hook": _zero3_hook(repeats)}


def _collective_after_work(one: torch.Tensor, repeats: int,
                           clock: Callable[[], float] = time.perf_counter) -> list[tuple[float, float]]:
    """(seconds of work, seconds a one-element all-reduce adds after it) at `WAIT_MATMULS` matmuls of this rank's own
    work: each stretch with and without the all-reduce timed in turn by `clock` (a barrier before each timing),
    medians."""
    a = torch.randn(128, 128)
    points = []
    for matmuls in WAIT_MATMULS:
        def work(matmuls: int = matmuls) -> None:
            _matmuls(a, matmuls)

        def work_then_collective(work: Callable[[], None] = work) -> None:
            work()
            dist.all_reduce(one)

        alone, after = [], []
        for _ in range(repeats):
            dist.barrier()
            alone.append(_seconds(work, 1, 5, clock))
            dist.barrier()
            after.append(_seconds(work_then_collective, 1, 5, clock))
        stretch = statistics.median(alone)
        points.append((stretch, statistics.median(after) - stretch))
    return points


def _collectives_by_bytes(repeats: int) -> dict[tuple[str, float], float]:
    """{(kind, bytes one rank sends): seconds} of each `MEASURED_COLLECTIVES` kind in a tight loop, with each rank
    holding `COLLECTIVE_FLOATS` floats (a shard: the whole tensor is P of them)."""
    from autosp.timing.rates import MEASURED_COLLECTIVES, collective_bytes

    world = dist.get_world_size()
    measured = {}
    for floats in COLLECTIVE_FLOATS:
        # zeros: the all-reduce sums into `whole` on every call
        shard, whole, other = torch.randn(floats), torch.zeros(world * floats), torch.empty(world * floats)
        calls = {"all_gather": functools.partial(dist.all_gather_into_tensor, whole, shard),
                 "reduce_scatter": functools.partial(dist.reduce_scatter_tensor, shard, whole),
                 "all_reduce": functools.partial(dist.all_reduce, whole),
                 "all_to_all": functools.partial(dist.all_to_all_single, other, whole)}
        for kind in MEASURED_COLLECTIVES:
            dist.barrier()
            inner = 20 if floats <= 8192 else 5
            measured[kind, collective_bytes(kind, whole.nbytes, world)] = _seconds(calls[kind], repeats, inner)
    return measured


def _matmuls(a: torch.Tensor, count: int) -> None:
    """A stretch of this rank's own work: `count` products of `a` with itself."""
    for _ in range(count):
        a @ a


def fit_latency_and_wait(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency, wait) in seconds: the least-squares line through (sqrt(work / `WAIT_STRETCH_S`), a collective's time
    after that work) - the time model's `latency + wait x sqrt(work / WAIT_STRETCH_S)`
    (`DeviceRates.rank_wait_seconds`); neither below 0 (a negative slope: no wait, the mean as latency; a negative
    intercept: no latency, the line through the origin)."""
    from autosp.timing.rates import WAIT_STRETCH_S

    x = [math.sqrt(work / WAIT_STRETCH_S) for work, _ in points]
    y = [seconds for _, seconds in points]
    wait, latency = statistics.linear_regression(x, y)
    if wait < 0:
        return max(0.0, statistics.mean(y)), 0.0
    if latency < 0:
        return 0.0, max(0.0, statistics.linear_regression(x, y, proportional=True).slope)
    return latency, wait


def _attention_rate(length: int, repeats: int) -> float:
    """FLOP/s of a causal SDPA forward + backward over `length` tokens (4 heads of `CPU_HEAD_DIM`), as the clock
    counts it."""
    heads, dim = 4, CPU_HEAD_DIM
    q = torch.randn(1, heads, length, dim, requires_grad=True)

    def attention() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    return 4 * heads * dim * length * (length + 1) / 2 * (1 + 2.5) / _seconds(attention, repeats)


def _zero3_hook(repeats: int) -> float | None:
    """This thread's CPU seconds per call of DeepSpeed ZeRO-3's parameter coordinator in a forward and backward
    through a ZeRO-3 engine, beyond the same layers' unsharded step and outside the collectives; None without
    DeepSpeed."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return None
    from baselines.deepspeed_env import import_deepspeed

    deepspeed = import_deepspeed("zero3")

    def layers() -> torch.nn.Sequential:
        out, into = HOOK_SHAPE
        return torch.nn.Sequential(*(torch.nn.Linear(into, out, bias=False) if i % 2 == 0 else
                                     torch.nn.Linear(out, into, bias=False) for i in range(HOOK_LAYERS)))

    plain, sharded = layers(), layers()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "steps_per_print": 2**31 - 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": False}}
    engine, *_ = deepspeed.initialize(model=sharded, optimizer=torch.optim.SGD(sharded.parameters(), lr=0.0),
                                      config=config)
    x = torch.randn(64, HOOK_SHAPE[1])

    def sharded_step() -> None:
        engine.backward(engine(x).sum())

    def plain_step() -> None:
        plain(x).sum().backward()

    with _clock_outside_collectives() as host_clock:
        extra = _seconds(sharded_step, repeats, clock=host_clock) - _seconds(plain_step, repeats, clock=host_clock)
    return extra / _coordinator_calls(sharded_step)


def _coordinator_calls(step: Callable[[], object]) -> int:
    """Calls of DeepSpeed's parameter coordinator in one `step`, counted as the simulator counts them."""
    from types import SimpleNamespace

    from autosp.experiments.simulate.adapters import deepspeed_hooks_clocked

    calls = SimpleNamespace(n=0)
    counter = SimpleNamespace(clock=SimpleNamespace(zero3_hooks=lambda n: setattr(calls, "n", calls.n + n)))
    with deepspeed_hooks_clocked(counter):
        step()
    return calls.n


@contextlib.contextmanager
def _clock_outside_collectives() -> Iterator[Callable[[], float]]:
    """A clock of this thread's CPU seconds that stands still inside DeepSpeed's collectives (`deepspeed.comm`'s,
    wrapped while open; an outer call's time is counted once): the time model prices those apart, and waiting on the
    other rank is not this thread's work."""
    import deepspeed.comm
    import deepspeed.comm.comm

    inside, depth = [0.0], [0]

    def timed(collective: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(collective)
        def call(*args: Any, **kwargs: Any) -> Any:
            start, depth[0] = time.thread_time(), depth[0] + 1
            try:
                return collective(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    inside[0] += time.thread_time() - start
        return call

    with contextlib.ExitStack() as stack:
        for name in COLLECTIVES:
            wrapped = timed(getattr(deepspeed.comm.comm, name))
            for module in (deepspeed.comm, deepspeed.comm.comm):
                stack.enter_context(mock.patch.object(module, name, wrapped))
        yield lambda: time.thread_time() - inside[0]


def calibrate(world_size: int, repeats: int) -> dict[str, str]:
    """The cpu row, from `world_size` ranks measuring at once (the slowest rank's rates)."""
    from autosp.harness.launch import launch_local

    if world_size < 2:
        raise ConfigError(f"--world-size {world_size}: gloo's collectives need at least 2 ranks")
    result = launch_local(measure_rank, (repeats,), world_size=world_size, device="cpu", timeout_s=600)
    if result.status != "ok":
        raise ConfigError(f"calibration ranks failed ({result.status}): {result.error}")
    worst = {k: min(r[k] for r in result.results) for k in ("matmul", "attention", "memory", "copy", "peer")}
    worst["overhead"] = max(r["overhead"] for r in result.results)
    # the faster rank waits, the slower not: the ranks' mean at each point
    points = [(statistics.mean(work for work, _ in at), statistics.mean(seconds for _, seconds in at))
              for at in zip(*(r["collective_points"] for r in result.results), strict=True)]
    latency, wait = fit_latency_and_wait(points)
    collectives = " ".join(f"{kind}:{sent:.0f}:{max(r['collectives'][kind, sent] for r in result.results) * 1e6:.4g}"
                           for kind, sent in result.results[0]["collectives"])
    by_keys = " ".join(f"{keys}:{min(r['by_keys'][keys] for r in result.results) / worst['matmul']:.4g}"
                       for keys in ATTENTION_KEYS)
    hooks = [r["zero3_hook"] for r in result.results if r["zero3_hook"] is not None]
    hook = f"{max(0.0, *hooks) * 1e6:.4g}" if hooks else "0"
    g = 1e9
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    return {
        "device": "cpu", "peak_tflops": f"{worst['matmul'] / 1e12:.6g}", "matmul_fraction": "1",
        "attention_fraction": f"{worst['attention'] / worst['matmul']:.4g}", "attention_by_keys": by_keys,
        "hbm_gb_s": f"{worst['memory'] / g:.4g}",
        "hbm_fraction": "1", "peer_gb_s": f"{worst['peer'] / g:.4g}", "node_gb_s": f"{worst['peer'] / g:.4g}",
        "host_link_gb_s": f"{worst['copy'] / g:.4g}", "host_memory_gb_s": f"{worst['memory'] / g:.4g}",
        "collective_latency_us": f"{latency * 1e6:.4g}",
        "collective_wait_us": f"{wait * 1e6:.4g}", "collective_by_bytes": collectives,
        "op_overhead_us": f"{worst['overhead'] * 1e6:.4g}",
        "zero3_hook_us": hook, "streams": "0",
        "source": (f"measured by `autosp calibrate --world-size {world_size}` on {when}, {platform.node()} "
                   f"({platform.processor() or platform.machine()}): {world_size} gloo ranks x 1 thread at once, "
                   "float32, the slowest rank's medians (latency and wait: one fit to the ranks' mean); MFU on cpu "
                   "is against the measured matmul rate"),
    }


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from autosp.timing.rates import write_cpu_rates

    row = calibrate(args.world_size, args.repeats)
    path = write_cpu_rates(row, Path(args.out) if args.out else None)
    print("\n".join(f"{k}: {v}" for k, v in row.items()))
    print(f"-> {path}")
    return 0


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp calibrate [--world-size P]`: measure the cpu row of the time model's rates."""
    p = subparsers.add_parser("calibrate", help="measure this CPU's rates for the time model (the cpu row)")
    p.add_argument("--world-size", type=int, default=2, help="ranks measuring at once, as a CPU run's (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timings per figure (the median is kept)")
    p.add_argument("--out", default=None, help="rates file to rewrite (default: the package's device_rates.csv)")
    p.set_defaults(func=_cmd_calibrate)
