"""One measured training run: validate, launch ranks, train, measure, return the record.

Every rank builds the model from the same seed, hands it to the method (`Strategy.setup`) and trains on the same
global batch (dp_size * batch_size rows, full sequence; the method takes its own part). The same batch is used
at every step: synthetic tokens have no structure to learn, so fitting one batch is what makes a falling loss
show that the step trains. Order per rank: warm-up steps, one measured step (peak memory), timed steps.
"""
from __future__ import annotations

import importlib
import math
import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autosp.compiler.memory import parse_policy
from autosp.compiler.options import COMPILE_BACKENDS
from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.launch import check_device, current_device, existing_job, launch
from autosp.harness.measure import (
    apply_device_budget,
    format_sizes_apart,
    host_over_budget_error,
    memory_meter,
    node_host_bytes,
    ranks_on_this_node,
    summarize_times,
    timed,
)
from autosp.harness.parallel import build_context
from autosp.harness.precision import PRECISIONS, precision_of
from autosp.harness.records import append_record, check_writable, new_record
from autosp.harness.strategy import Strategy, TrainStep, get_strategy
from autosp.models import build_model, get_preset
from autosp.models.data import Batch, make_batch

#: `--dtype` -> the dtype the model is built in: its state (master parameters) dtype; a mixed precision's compute
#: dtype is applied by the method (`autosp.harness.precision`)
DTYPES = {name: p.state for name, p in PRECISIONS.items()}


def validate(cfg: RunConfig, extra_imports: Iterable[str] = ()) -> tuple[Strategy, int]:
    """ConfigError for anything that cannot run, before a rank starts; returns (strategy, SP degree)."""
    precision_of(cfg.dtype)
    if cfg.compile_backend not in COMPILE_BACKENDS:
        raise ConfigError(f"unknown --compile-backend {cfg.compile_backend!r}; choose one of: "
                          f"{', '.join(COMPILE_BACKENDS)}")
    parse_policy(cfg.sac)  # ConfigError naming the choices
    check_device(cfg.device, cfg.world_size)
    preset = get_preset(cfg.model)
    for module in extra_imports:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"--import {module}: {exc}; pass an importable module (is it on PYTHONPATH?)") from None
    strategy = get_strategy(cfg.method)
    strategy.validate(cfg, preset.num_attention_heads, preset.num_key_value_heads)
    sp_size = cfg.sp_size or strategy.default_sp_size(cfg.world_size)
    make_batch(cfg.data, batch_size=1, seq_len=cfg.seq_len, vocab_size=preset.vocab_size, seed=cfg.seed)
    return strategy, sp_size


def global_batch(cfg: RunConfig, sp_size: int, step: int = 0) -> Batch:
    """The global batch every rank receives: dp_size * batch_size rows, seeded by (seed, step)."""
    preset = get_preset(cfg.model)
    return make_batch(cfg.data, batch_size=(cfg.world_size // sp_size) * cfg.batch_size, seq_len=cfg.seq_len,
                      vocab_size=preset.vocab_size, seed=cfg.seed * 1_000_003 + step)


def build_train_step(cfg: RunConfig, strategy: Strategy, sp_size: int) -> tuple[TrainStep, torch.device]:
    """This rank's model, built from the seed, handed to the method: identical on every rank."""
    device = current_device(cfg.device)
    ctx = build_context(sp_size, device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, seed=cfg.seed, dtype=DTYPES[cfg.dtype], device=device)
    return strategy.setup(model, ctx, cfg), device


class DivergedError(RuntimeError):
    """A non-finite loss or gradient: the run is an `error`, never a measurement (a search must not call it a fit)."""


DIVERGED_HINT = "training diverged; use --dtype float32 or bfloat16, or a lower --lr"


def train_step(step: TrainStep, batch: Batch, number: int = 0) -> float:
    """One full step: forward, backward, AdamW. Returns the global loss; DivergedError if the loss or a gradient is
    not finite, raised on every rank together before AdamW would spread it into the parameters."""
    loss = float(step.forward_backward(batch))
    if not math.isfinite(loss):
        raise DivergedError(f"loss is {loss} at step {number}: {DIVERGED_HINT}")
    index, names = nonfinite_gradient(step)
    if index < len(names):
        raise DivergedError(f"gradient of {names[index]} is not finite at step {number}: {DIVERGED_HINT}")
    step.optimizer_step()
    return loss


def nonfinite_gradient(step: TrainStep) -> tuple[int, list[str]]:
    """The finite check every measured step runs before AdamW (the simulator runs it too, so that the time model
    prices it): the first parameter whose gradient is not finite on any rank (the parameter count when none is),
    agreed by all ranks so that every rank raises together; and the parameters' names."""
    index, names = step.first_nonfinite()
    return _reduce_over_ranks(index, dist.ReduceOp.MIN), names


def device_name(device: torch.device | str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _reduce_over_ranks(value: int, op: dist.ReduceOp.RedOpType = dist.ReduceOp.MAX) -> int:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return int(t.item())


def _node_host_bytes(rank_host_bytes: int, device: torch.device) -> int:
    """Host memory the ranks of one node hold (what `--host-memory-budget` bounds): the largest rank's offloaded
    bytes times the ranks per node (on CPU every rank is on this machine)."""
    if not dist.is_initialized():
        return rank_host_bytes
    return node_host_bytes(_reduce_over_ranks(rank_host_bytes), ranks_on_this_node(device))


def rank_main(cfg_dict: dict[str, Any], extra_imports: tuple[str, ...] = ()) -> dict[str, Any]:
    """Body of one rank (runs in the launched process): train, measure, return this rank's numbers."""
    cfg = RunConfig.from_dict(cfg_dict)
    strategy, sp_size = validate(cfg, extra_imports)
    device = current_device(cfg.device)
    apply_device_budget(device, cfg.memory_budget)
    meter = memory_meter(device)
    losses: list[float] = []
    with meter.session():
        step, device = build_train_step(cfg, strategy, sp_size)
        batch = global_batch(cfg, sp_size).to(device)
        for _ in range(cfg.warmup):
            losses.append(train_step(step, batch, len(losses)))
        with meter.measured_step():
            losses.append(train_step(step, batch, len(losses)))
    result: dict[str, Any] = {"implementation": step.implementation or cfg.method, "device_name": device_name(device),
                              "losses": losses, "samples": [], "status": "ok"}
    device_budget = cfg.memory_budget if device.type == "cpu" else None  # a GPU's allocator is capped instead
    if device_budget is not None or cfg.host_memory_budget is not None:
        # All ranks decide together (max over ranks) so none is left waiting in a collective.
        measured = meter.report()
        over = None
        if device_budget is not None and _reduce_over_ranks(measured.peak_bytes) > device_budget:
            over = "device"
        host = _node_host_bytes(measured.detail.get("host_offloaded_bytes", 0), device)
        if over is None and cfg.host_memory_budget is not None and host > cfg.host_memory_budget:
            over = "host"
        result["node_host"] = host
        if over is not None:  # the record keeps the plan that did not fit: what to look at first
            result.update(status="oom", oom_in=over, peak=measured.peak_bytes, memory=measured.detail,
                          metrics=_metrics(step))
            return result
    result["cpu_samples"] = []
    for _ in range(cfg.steps):
        cpu_start = time.process_time()
        loss, seconds = timed(lambda: train_step(step, batch, len(losses)), device)
        result["cpu_samples"].append(time.process_time() - cpu_start)
        losses.append(loss)
        result["samples"].append(seconds)
    report = meter.report()
    result.update(peak=report.peak_bytes, memory=report.detail, metrics=_metrics(step))
    return result


def _metrics(step: Any) -> dict[str, Any]:
    """What the method reports of its step (plans, saved bytes, offloads), or nothing."""
    metrics = getattr(step, "metrics", None)
    return metrics() if callable(metrics) else {}


def run(cfg: RunConfig, *, out: str | Path | None = None, extra_imports: Iterable[str] = ()) -> dict[str, Any]:
    """Run `cfg` on its ranks and return its record (appended to `out` when given).

    Bad configurations (and an unwritable `out`) raise ConfigError here, before any rank starts; everything that
    happens once ranks run comes back as the record's status: a crash or a non-finite loss (`error`), a hang past
    cfg.timeout_s (`timeout`), running out of memory or over cfg.memory_budget (`oom`), SIGTERM/SIGINT to this
    process (`interrupted`). `extra_imports` are modules imported in every rank first (out-of-tree methods
    register on import).
    """
    extra_imports = tuple(extra_imports)
    strategy, sp_size = validate(cfg, extra_imports)
    cfg = strategy.own_config(cfg)  # the ranks get (and the record names) only the options the method honours
    if out is not None:
        check_writable(out)
    record = new_record(cfg, sp_size=sp_size, zero=strategy.zero_stage(cfg))
    outcome = launch(rank_main, (cfg.to_dict(), extra_imports), world_size=cfg.world_size, device=cfg.device,
                     timeout_s=cfg.timeout_s)
    record["status"], record["error"] = outcome.status, outcome.error
    record["extra"]["wall_s"] = round(outcome.elapsed_s, 3)
    if outcome.traceback:
        record["extra"]["traceback"] = outcome.traceback
    if outcome.output_tail:
        record["extra"]["rank_output"] = outcome.output_tail
    if outcome.status == "ok":
        _fill_measurements(record, cfg, outcome.results)
    if record["device_name"] is None:
        record["device_name"] = device_name(cfg.device) if cfg.device == "cpu" else None
    job = existing_job()
    if out is not None and (job is None or job.rank == 0):  # in a torchrun/SLURM job every rank has the record
        append_record(out, record)
    return record


def _fill_measurements(record: dict[str, Any], cfg: RunConfig, results: list[dict[str, Any]]) -> None:
    first = results[0]
    peaks = [r["peak"] for r in results]
    worst_rank = max(range(len(peaks)), key=peaks.__getitem__)
    record.update(implementation=first["implementation"], device_name=first["device_name"],
                  peak_mem_bytes=max(peaks), peak_mem_by_rank=peaks, loss=first["losses"][-1])
    record["extra"].update(losses=first["losses"], memory=results[worst_rank]["memory"],
                           **first.get("metrics", {}))
    if cfg.host_memory_budget is not None:  # as a simulated record has them: a search follows the fuller memory
        record["extra"].update(node_host_bytes=first["node_host"], host_budget_bytes=cfg.host_memory_budget)
    if any(r["status"] == "oom" for r in results):
        record["status"] = "oom"
        record["extra"]["oom_in"] = first.get("oom_in", "device")
        if first.get("oom_in") == "host":
            record["error"] = host_over_budget_error(first["node_host"], cfg.host_memory_budget,
                                                    "--host-memory-budget")
        else:
            peak, budget = format_sizes_apart(max(peaks), cfg.memory_budget)
            record["error"] = f"rank {worst_rank}: peak {peak} exceeds the memory budget {budget}"
        record["iter_time_s"] = summarize_times([])
        return
    # A step ends when its slowest rank ends.
    per_step = [max(r["samples"][i] for r in results) for i in range(cfg.steps)]
    record["iter_time_s"] = summarize_times(per_step)
    if all("cpu_samples" in r for r in results):
        # CPU seconds the busiest rank's process spent per step (all its threads; a rank waiting in a collective
        # sleeps): unlike the wall time it hardly moves when other jobs share the cores
        record["extra"]["cpu_time_s"] = summarize_times([max(r["cpu_samples"][i] for r in results)
                                                         for i in range(cfg.steps)])
    if cfg.steps:
        tokens = record["dp_size"] * cfg.batch_size * cfg.seq_len
        record["tokens_per_s"] = tokens / record["iter_time_s"]["median"]
