"""Maximum trainable sequence length ("trainability"): the paper's headline metric, found by search.

The search is split in two so it can be tested without training anything:
- `search_max_length(probe, ...)`: pure logic over a `probe(seq_len) -> status` oracle;
- `run_search(cfg, ...)`: the oracle is a real measured run (`autosp.runner.run`: warm-up plus at least one
  full step with the optimizer, so AdamW's states exist at the peak), every probe record and one result
  row are appended to a JSONL file.

Algorithm: lengths are multiples of a granularity g. From a start length (default the minimum) the length
doubles until the first OOM (or halves until the first success if the start already OOMs), then the
bracket [last ok, first oom] is bisected down to g. That takes about 2*log2(max_len / g) probes and relies
on peak memory being monotone in the length, which holds for every method here. Only status ``oom``
means "too long": an ``error`` or ``timeout`` probe stops the search and becomes the search's status, so
a crash is never mistaken for a memory limit.

Default granularity 2·P·128: every SP method needs the length divisible by P (Ulysses, AutoSP), zig-zag
ring attention needs 2·P chunks, and 128 keeps each chunk a whole flash-attention block on GPUs.

Compiled-graph reuse: each probe runs in fresh rank processes (`autosp.runner.run`), which is also what a
real GPU OOM needs (the allocator state after an OOM is not trustworthy). What carries over between probes
is the on-disk inductor/AOTAutograd cache; a method that marks the sequence dimension dynamic
(`torch._dynamo.mark_dynamic(input_ids, 1)`) compiles one symbolic graph whose cache entry every later
probe hits, instead of one specialised compile per length.
"""
from __future__ import annotations

import argparse
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from autosp.config import ConfigError, RunConfig

#: probe statuses the runner reports; only OOM bounds the length
OK, OOM, ERROR, TIMEOUT = "ok", "oom", "error", "timeout"
#: search outcomes
FOUND = "found"  # bracketed: max_seq_len ok, max_seq_len + granularity oom
NO_OOM_UP_TO_MAX = "no_oom_up_to_max_len"  # max_len itself trains: the true limit is higher
OOM_AT_MIN = "oom_at_min_len"  # not even min_len trains


@dataclass
class SearchOutcome:
    status: str  # found | no_oom_up_to_max_len | oom_at_min_len | error | timeout
    max_seq_len: int | None  # longest length seen training (None if none did)
    first_oom_seq_len: int | None  # shortest length seen OOM (None if none did)
    probes: list[tuple[int, str]] = field(default_factory=list)  # (seq_len, status) in probe order


def default_granularity(world_size: int) -> int:
    """2·P·128: a length every method accepts on P ranks (see the module docstring)."""
    return 2 * world_size * 128


def search_max_length(
    probe: Callable[[int], str],
    *,
    granularity: int,
    min_len: int,
    max_len: int,
    start_len: int | None = None,
) -> SearchOutcome:
    """Longest multiple of `granularity` in [min_len, max_len] for which `probe` returns ``ok``."""
    if granularity < 1:
        raise ConfigError(f"--granularity must be positive, got {granularity}")
    lo_k = max(1, math.ceil(min_len / granularity))
    hi_k = max_len // granularity
    if lo_k > hi_k:
        raise ConfigError(
            f"no multiple of the granularity {granularity} lies in [--min-len {min_len}, --max-len {max_len}]; "
            "widen the range or lower --granularity"
        )
    k = lo_k if start_len is None else min(max(start_len // granularity, lo_k), hi_k)
    outcome = SearchOutcome(status=FOUND, max_seq_len=None, first_oom_seq_len=None)
    good: int | None = None  # largest k known ok
    bad: int | None = None  # smallest k known oom

    def ask(k: int) -> str | None:
        """Probe k; return a stopping status (error/timeout), else None after updating the bracket."""
        nonlocal good, bad
        status = probe(k * granularity)
        outcome.probes.append((k * granularity, status))
        if status == OK:
            good = k if good is None else max(good, k)
        elif status == OOM:
            bad = k if bad is None else min(bad, k)
        else:
            return status if status in (ERROR, TIMEOUT) else ERROR
        return None

    stop = ask(k)
    # Bracket: grow geometrically from an ok start, shrink geometrically from an oom start.
    while stop is None and bad is None and good < hi_k:
        stop = ask(min(2 * good, hi_k))
    while stop is None and good is None and bad > lo_k:
        stop = ask(max(bad // 2, lo_k))
    # Bisect the bracket down to one granule.
    while stop is None and good is not None and bad is not None and bad - good > 1:
        stop = ask((good + bad) // 2)

    outcome.max_seq_len = None if good is None else good * granularity
    outcome.first_oom_seq_len = None if bad is None else bad * granularity
    if stop is not None:
        outcome.status = stop
    elif bad is None:
        outcome.status = NO_OOM_UP_TO_MAX
    elif good is None:
        outcome.status = OOM_AT_MIN
    return outcome


def _budget_for_floor(cfg: RunConfig) -> int | None:
    """The per-rank bytes the search is bounded by: the emulated budget, else the GPU's memory."""
    if cfg.memory_budget is not None:
        return cfg.memory_budget
    if cfg.device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    return None


def run_search(
    cfg: RunConfig,
    *,
    out: str,
    granularity: int | None = None,
    min_len: int | None = None,
    max_len: int = 1 << 20,
    start_len: int | None = None,
    run: Callable[[RunConfig], dict] | None = None,
) -> dict:
    """Search `cfg.method`'s max trainable length; append every probe record and one result row to `out`.

    `cfg` fixes everything but the length (method, model, ranks, budget, ...); each probe runs it with
    `seq_len` set. `run` is `autosp.runner.run` unless a test passes another oracle. Returns the result row.
    """
    from autosp.floor import floor_for, sharding_of
    from autosp.records import append_record, new_record

    if run is None:
        from autosp.runner import run
    if cfg.device == "cpu" and cfg.memory_budget is None:
        raise ConfigError("a CPU search needs --memory-budget (e.g. 64MiB): without it nothing ever runs out of memory")
    granularity = granularity or default_granularity(cfg.world_size)
    min_len = min_len or granularity
    search_id = uuid.uuid4().hex
    started = time.monotonic()
    last_record: dict = {}
    peaks: dict[int, int | None] = {}

    def probe(seq_len: int) -> str:
        nonlocal last_record
        record = run(cfg.replace(seq_len=seq_len))
        record["search_id"] = search_id
        append_record(out, record)
        peaks[seq_len] = record.get("peak_mem_bytes")
        last_record = record
        status = record["status"]
        print(f"  probe {cfg.method} {cfg.model} S={seq_len}: {status}"
              + (f" ({record.get('error')})" if status not in (OK, OOM) and record.get("error") else ""), flush=True)
        return status

    outcome = search_max_length(probe, granularity=granularity, min_len=min_len, max_len=max_len, start_len=start_len)

    floor = floor_for(cfg.method, cfg.model, world_size=cfg.world_size, batch_size=cfg.batch_size, dtype=cfg.dtype)
    budget = _budget_for_floor(cfg)
    limit = floor.max_seq_len(budget, granularity) if budget is not None else None
    default_sp = cfg.world_size if sharding_of(cfg.method).splits_sequence else 1
    sp_size = last_record.get("sp_size") or cfg.sp_size or default_sp  # a probe's record knows best
    row = new_record(cfg.replace(seq_len=outcome.max_seq_len or 0), sp_size=sp_size)
    for inherited in ("device_name", "implementation"):  # what only a probe knows
        row[inherited] = last_record.get(inherited, row[inherited])
    row.update(
        kind="search",
        search_id=search_id,
        run_id=search_id,
        status=outcome.status,
        error=last_record.get("error") if outcome.status in (ERROR, TIMEOUT) else None,
        max_seq_len=outcome.max_seq_len,
        first_oom_seq_len=outcome.first_oom_seq_len,
        peak_mem_bytes=peaks.get(outcome.max_seq_len) if outcome.max_seq_len else None,
        granularity=granularity,
        min_len=min_len,
        max_len=max_len,
        start_len=start_len,
        probes=[{"seq_len": n, "status": s, "peak_mem_bytes": peaks.get(n)} for n, s in outcome.probes],
        num_probes=len(outcome.probes),
        floor_limit_seq_len=limit,
        achieved_over_limit=(outcome.max_seq_len / limit) if (limit and outcome.max_seq_len) else None,
        floor=floor.to_dict(),
        wall_s=round(time.monotonic() - started, 3),
    )
    append_record(out, row)
    return row
