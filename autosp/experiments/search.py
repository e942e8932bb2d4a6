"""Maximum trainable sequence length ("trainability"): the paper's headline metric, found by search.

The search is split in two so it can be tested without training anything:
- `search_max_length(probe, ...)`: pure logic over a `probe(seq_len) -> status` oracle;
- `run_search(cfg, ...)`: the oracle is a real measured run (`autosp.harness.runner.run`: warm-up plus at least one
  full step with the optimizer, so AdamW's states exist at the peak), every probe record and one result
  row are appended to a JSONL file.

Algorithm: lengths are multiples of a granularity g. From a start length (default the minimum) the length
doubles until the first OOM (or halves until the first success if the start already OOMs), then the
bracket [last ok, first oom] is bisected down to g: about 2*log2(max_len / g) probes. When probes report
their peak memory, the next length is instead guessed where the line through the nearest probes meets the
budget (peak memory is close to linear in the length); the first probe alone already guides when it also
reports the bytes resident at the start of its step (the length-independent model state: the line's
intercept), so a search is typically one short probe, one jump just below the limit, the answer and one
granularity step above it (3-4 probes, each a fresh compile of a compiled method); a safeguard falls back
to doubling/bisection when guesses do not pay off. The answer relies on peak memory
being monotone in the length, which holds for every method here. Only status ``oom`` means "too long":
an ``error`` or ``timeout`` probe stops the search and becomes the search's status, so a crash is never
mistaken for a memory limit.

Guided search (`guided_search_max_length`, `autosp search`'s default `--guide simulate`): a predictor (the
simulator, `autosp.experiments.guided`) names the answer first; the predicted maximum and one granularity step
above it are measured, and the search ends there when both statuses are as predicted (two probes). The first
status that disagrees is recorded in the result row (`guide_disagreements`, beside `predicted_max_seq_len`, so a
drifting simulator shows in the tables and the history) and the bracketing search above takes over from the
probes made (their statuses and peaks), never probing a length twice: the answer is always the measured one.

Default granularity 2·P·128: every SP method needs the length divisible by P (Ulysses, AutoSP), zig-zag
ring attention needs 2·P chunks, and 128 keeps each chunk a whole flash-attention block on GPUs.

Compiled-graph reuse: each probe runs in fresh rank processes (`autosp.harness.runner.run`), which is also what a
real GPU OOM needs (the allocator state after an OOM is not trustworthy). What carries over between probes
is the on-disk inductor/AOTAutograd cache; a method that marks the sequence dimension dynamic
(`torch._dynamo.mark_dynamic(input_ids, 1)`) compiles one symbolic graph whose cache entry every later
probe hits, instead of one specialised compile per length.
"""
from __future__ import annotations

import argparse
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.records import RunStatus
from autosp.harness.supervisor import INTERRUPTED_EXIT_CODE

#: probe statuses the runner reports (`RunStatus`); only OOM bounds the length, the others after OK stop the search
OK, OOM, ERROR, TIMEOUT, INTERRUPTED = (RunStatus.OK, RunStatus.OOM, RunStatus.ERROR, RunStatus.TIMEOUT,
                                        RunStatus.INTERRUPTED)
STOPPING = (ERROR, TIMEOUT, INTERRUPTED)
#: how far past the longest ok length a search jumps while its peaks are flat (length-independent work, e.g. an
#: optimizer step, hides the length's share): doubling would take a probe per factor 2
FLAT_PEAK_JUMP = 32
#: search outcomes
FOUND = "found"  # bracketed: max_seq_len ok, max_seq_len + granularity oom
NO_OOM_UP_TO_MAX = "no_oom_up_to_max_len"  # max_len itself trains: the true limit is higher
OOM_AT_MIN = "oom_at_min_len"  # not even min_len trains


@dataclass
class SearchOutcome:
    status: str  # found | no_oom_up_to_max_len | oom_at_min_len | error | timeout | interrupted
    max_seq_len: int | None  # longest length seen training (None if none did)
    first_oom_seq_len: int | None  # shortest length seen OOM (None if none did)
    probes: list[tuple[int, str]] = field(default_factory=list)  # (seq_len, status) in probe order
    predicted_max_seq_len: int | None = None  # a guided search's prediction (0: predicted not to train at all)
    #: a guided search's probes whose status the prediction got wrong: {"seq_len", "predicted", "measured"}
    disagreements: list[dict] = field(default_factory=list)


def default_granularity(world_size: int) -> int:
    """2·P·128: a length every method accepts on P ranks (see the module docstring)."""
    return 2 * world_size * 128


def search_max_length(
    probe: Callable[[int], str | tuple[str, int | None] | tuple[str, int | None, int | None]],
    *,
    granularity: int,
    min_len: int,
    max_len: int,
    start_len: int | None = None,
    budget: int | None = None,
    measured: Sequence[tuple[int, str | tuple]] = (),
) -> SearchOutcome:
    """Longest multiple of `granularity` in [min_len, max_len] for which `probe` returns ``ok``.

    `measured`: (length, what `probe` returned) of probes already made (a guided search's), taken as if just
    probed, in order; the search goes on from them (no start length is probed then).

    `start_len` is a length expected near the answer: it is probed first, then its neighbour, unless the line
    below puts the boundary further than one step from it (a start far off): then the line's guess.
    `probe` returns a status, or (status, peak bytes), or (status, peak bytes, resident bytes at the start
    of the step). Given the peaks and the `budget` they are compared with, the next length is guessed where
    a line crosses the budget (memory is close to linear in the length at long lengths): the line through the
    two shortest out-of-memory probes once there are two (at long lengths the activations' line, while ok
    probes can sit on a length-independent peak such as an optimizer step, flat and silent on the slope), else
    through the shortest out-of-memory probe and its resident bytes (the value at length 0: a line at least as
    steep as the activations', so its guess lies at or above the limit), else through the two probes nearest
    the boundary; with a single ok peak, its resident bytes stand in for length 0 (that slope is steep, its
    guess falls short of the limit: a safe jump). While the ok peaks are flat the search jumps
    `FLAT_PEAK_JUMP` times past them. An out-of-memory probe whose peak lies within the budget ran out of something
    else (host memory): no line is drawn while it bounds the bracket. Guesses only choose what to probe; statuses
    alone decide the answer, and after two guesses that did not pay off one geometric/bisection step follows, so the
    probe count stays within a small multiple of plain bisection whatever the peaks look like.
    """
    if granularity < 1:
        raise ConfigError(f"--granularity must be positive, got {granularity}")
    lo_k = max(1, math.ceil(min_len / granularity))
    hi_k = max_len // granularity
    if lo_k > hi_k:
        raise ConfigError(
            f"no multiple of the granularity {granularity} lies in [--min-len {min_len}, --max-len {max_len}]; "
            "widen the range or lower --granularity"
        )
    outcome = SearchOutcome(status=FOUND, max_seq_len=None, first_oom_seq_len=None)
    good: int | None = None  # largest k (length / granularity) known ok
    bad: int | None = None  # smallest k known oom
    peaks: dict[int, int] = {}
    resident: dict[int, int] = {}  # k -> bytes resident at step start (the line's intercept, from one probe)

    def ask(k: int) -> str | None:
        """Probe k; return a stopping status (error/timeout), else None after updating the bracket."""
        return note(k, probe(k * granularity))

    def note(k: int, result: str | tuple) -> str | None:
        nonlocal good, bad
        status, peak, base = (tuple(result) + (None, None))[:3] if isinstance(result, tuple) else (result, None, None)
        outcome.probes.append((k * granularity, status))
        if status not in (OK, OOM):
            return status if status in STOPPING else ERROR
        if peak is not None:
            peaks[k] = peak
            if base is not None and 0 <= base < peak:
                resident[k] = base
        if status == OK:
            good = k if good is None else max(good, k)
        else:
            bad = k if bad is None else min(bad, k)
        return None

    def settled() -> bool:
        if good is not None and bad is not None:
            return bad - good <= 1
        return good >= hi_k if bad is None else bad <= lo_k

    def geometric_step() -> int:
        """Double from an ok length, halve from an oom one, bisect a bracket."""
        if bad is None:
            return min(2 * good, hi_k)
        if good is None:
            return max(bad // 2, lo_k)
        return (good + bad) // 2

    def linear_guess() -> int | None:
        """Where the line through the two probes nearest the boundary reaches the budget, inside the bracket."""
        if budget is None:
            return None
        if bad is not None and peaks.get(bad, budget + 1) <= budget:
            # out of memory with its peak inside the budget: something the peaks do not measure bound it (host
            # memory): their line does not lead to the boundary (it crept down a granule a probe), so bisect
            return None
        above = sorted(k for k in peaks if bad is not None and k >= bad)[:2]
        if len(above) == 2:
            # the two shortest out-of-memory probes: at long lengths the peak is the activations' line, while the
            # ok side can sit on a length-independent peak (an optimizer step) that says nothing of the slope
            near = above
        elif bad in resident:
            near = [bad]  # with its resident bytes: a line at least as steep as the activations' (see above)
        elif good in peaks and bad in peaks:
            near = [good, bad]
        else:
            anchor = good if good is not None else bad
            near = sorted(peaks, key=lambda k: (abs(k - anchor), k))[:2]
        points = {k: peaks[k] for k in near}
        if len(points) == 1 and near[0] in resident:  # one probe: its resident bytes are the value at length 0
            points[0] = resident[near[0]]
        if len(points) < 2:
            return None
        (k1, p1), (k2, p2) = sorted(points.items())
        if p2 <= p1:  # flat: the length's share still hides under a length-independent peak; go well past it
            return min(hi_k, FLAT_PEAK_JUMP * good) if bad is None and good is not None else None
        k = math.floor(k1 + (budget - p1) * (k2 - k1) / (p2 - p1))
        lowest = good + 1 if good is not None else lo_k
        highest = bad - 1 if bad is not None else hi_k
        return min(max(k, lowest), highest)

    stop = None
    for seq_len, result in measured:
        stop = stop or note(seq_len // granularity, result)
    # with results measured already the search goes on from them; else it starts at the lowest length, or at a hint
    # near the answer (e.g. a previous one): probe it, then its neighbour on the open side, unless its peak says the
    # boundary is further away (a hint far off, e.g. a memory floor's optimistic limit)
    if not measured and start_len is None:
        stop = ask(lo_k)
    elif not measured:
        stop = ask(min(max(start_len // granularity, lo_k), hi_k))
        neighbour = None if good is None and bad is None else (good + 1 if bad is None else bad - 1)
        guess = linear_guess() if stop is None and not settled() else None
        if stop is None and not settled() and (guess is None or abs(guess - neighbour) <= 1):
            stop = ask(neighbour)
    misses = 0  # consecutive guesses that did no better than a geometric step (found/halved a bracket, doubled)
    while stop is None and not settled():
        guess = linear_guess() if misses < 2 else None
        width = bad - good if good is not None and bad is not None else None
        good_before = good
        stop = ask(geometric_step() if guess is None else guess)
        if guess is None:
            misses = 0
        elif good is not None and bad is not None and (width is None or 2 * (bad - good) <= width):
            misses = 0
        elif bad is None and good is not None and good_before is not None and good >= 2 * good_before:
            misses = 0
        else:
            misses += 1

    outcome.max_seq_len = None if good is None else good * granularity
    outcome.first_oom_seq_len = None if bad is None else bad * granularity
    if stop is not None:
        outcome.status = stop
    elif bad is None:
        outcome.status = NO_OOM_UP_TO_MAX
    elif good is None:
        outcome.status = OOM_AT_MIN
    return outcome


def binding_peak(record: dict, budget: int | None) -> int | None:
    """The peak a search draws its line through: the record's device peak, or where the node's host memory is the
    fuller of the two (the record's `extra.node_host_bytes` of `extra.host_budget_bytes`), the host bytes in the
    device's scale: their share of the host budget times `budget`, so the line follows whichever memory binds and
    crosses `budget` where that one runs out."""
    peak, extra = record.get("peak_mem_bytes"), record.get("extra") or {}
    host, host_budget = extra.get("node_host_bytes"), extra.get("host_budget_bytes")
    if peak is None or budget is None or not host or not host_budget:
        return peak
    return max(peak, -(-host * budget // host_budget))  # rounded up: within `budget` exactly when the host fits


def line_point(record: dict, budget: int | None, resident: int | None) -> tuple[int | None, int | None]:
    """What a probe gives the search's line: its `binding_peak`, and `resident` (the bytes at the step's start, the
    device's line at length 0) only where that peak is the device's, not the host's."""
    peak = binding_peak(record, budget)
    return peak, resident if peak == record.get("peak_mem_bytes") else None


def memory_that_binds(record: dict | None) -> str | None:
    """Which memory ran out in an out-of-memory record (one granule above a search's answer: what binds there),
    ``host`` or ``device``; None for a record that is not out of memory."""
    if record is None or record.get("status") != OOM:
        return None
    return (record.get("extra") or {}).get("oom_in", "device")


#: `predict(cfg, granularity=g, min_len=a, max_len=b)`: the longest multiple of g in [a, b] predicted to train (0:
#: not even the shortest); raises ConfigError when it cannot predict (e.g. `autosp.experiments.guided.simulated`)
Predictor = Callable[..., int]


def guided_search_max_length(
    probe: Callable[[int], str | tuple],
    *,
    predicted: int,
    granularity: int,
    min_len: int,
    max_len: int,
    budget: int | None = None,
) -> SearchOutcome:
    """`search_max_length`'s answer, measuring first only where a prediction puts the boundary.

    The predicted maximum must train and one granularity step above it must run out of memory (at the range's
    ends only the one probe inside it is asked). When every status is as predicted the search ends there:
    two probes. The first status that disagrees is recorded in `disagreements` and the bracketing search
    takes over from the probes made, their statuses and peaks, never probing a length again: the answer is
    always the measured one, whatever the prediction said."""
    measured: dict[int, str | tuple] = {}

    def once(seq_len: int) -> str | tuple:
        if seq_len not in measured:
            measured[seq_len] = probe(seq_len)
        return measured[seq_len]

    def status_of(result: str | tuple) -> str:
        return result[0] if isinstance(result, tuple) else result

    lo_k = max(1, math.ceil(min_len / granularity))
    hi_k = max_len // granularity
    k = predicted // granularity
    expected = [(n, status) for n, status in ((k, OK), (k + 1, OOM)) if lo_k <= n <= hi_k]
    if not expected:  # predicted outside the range: the range's end nearest the prediction
        expected = [(lo_k, OOM)] if k < lo_k else [(hi_k, OK)]
    disagreements: list[dict] = []
    stop = None
    for n, status in expected:
        got = status_of(once(n * granularity))
        if got not in (OK, OOM):  # a failed probe ends the search, as in the bracketing search
            stop = got if got in STOPPING else ERROR
            break
        if got != status:
            disagreements.append({"seq_len": n * granularity, "predicted": status, "measured": got})
            break
    if not disagreements:  # every probe as predicted (or a failure): the statuses measured are the answer
        good = max((n for n, result in measured.items() if status_of(result) == OK), default=None)
        bad = min((n for n, result in measured.items() if status_of(result) == OOM), default=None)
        status = stop or (FOUND if good is not None and bad is not None
                          else NO_OOM_UP_TO_MAX if bad is None else OOM_AT_MIN)
        outcome = SearchOutcome(status=status, max_seq_len=good, first_oom_seq_len=bad)
    else:  # the prediction is off: bracket from what was measured (its peaks give the line to the boundary)
        outcome = search_max_length(once, granularity=granularity, min_len=min_len, max_len=max_len,
                                    budget=budget, measured=list(measured.items()))
    outcome.probes = [(n, status_of(result)) for n, result in measured.items()]
    outcome.predicted_max_seq_len = predicted
    outcome.disagreements = disagreements
    return outcome


def _search_budget(cfg: RunConfig) -> int | None:
    """The per-rank bytes the search is bounded by: the emulated budget, else the GPU's memory."""
    if cfg.memory_budget is not None:
        return cfg.memory_budget
    if cfg.device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    return None


def search_key(cfg: RunConfig, granularity: int) -> str:
    """Identifies searches that must give the same answer: the run configuration without its length."""
    return f"{cfg.replace(seq_len=1).config_hash()}-g{granularity}"


def previous_answer(out: str, key: str) -> int | None:
    """max_seq_len of the latest search with this key in `out` (None if there is none); lines that are not
    records are reported and skipped (a resume needs only the last answer)."""
    from autosp.harness.records import read_records

    if not os.path.exists(out):
        return None
    skipped: list[str] = []
    answers = [r["max_seq_len"] for r in read_records(out, skipped=skipped)
               if r.get("kind") == "search" and r.get("search_key") == key and r.get("max_seq_len")]
    for problem in skipped:
        print(f"  skipped {problem}", flush=True)
    return answers[-1] if answers else None


def run_search(
    cfg: RunConfig,
    *,
    out: str,
    granularity: int | None = None,
    min_len: int | None = None,
    max_len: int = 1 << 20,
    start_len: int | None = None,
    resume: bool = False,
    run: Callable[[RunConfig], dict] | None = None,
    predict: Predictor | None = None,
) -> dict:
    """Search `cfg.method`'s max trainable length; append every probe record and one result row to `out`.

    `cfg` fixes everything but the length (method, model, ranks, budget, ...); each probe runs it with
    `seq_len` set. With `resume`, the search starts from the answer of the latest identical search in `out`
    (two probes re-confirm an unchanged answer). `run` is `autosp.harness.runner.run` unless a test passes another
    oracle. With `predict` and no start length, the search is guided (`guided_search_max_length`): the row
    records the prediction, its cost and the probes it got wrong. Returns the result row.
    """
    from autosp.experiments.floor import run_floor
    from autosp.experiments.progress import progress
    from autosp.harness.records import append_record, check_writable, new_record

    if cfg.device == "cpu" and cfg.memory_budget is None:
        raise ConfigError("a CPU search needs --memory-budget (e.g. 64MiB): without it nothing ever runs out of memory")
    granularity = default_granularity(cfg.world_size) if granularity is None else granularity
    min_len = granularity if min_len is None else min_len
    for flag, value in (("--granularity", granularity), ("--min-len", min_len), ("--max-len", max_len),
                        ("--start-len", start_len)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be positive, got {value}")
    if run is None:
        from autosp.harness.runner import run, validate

        validate(cfg.replace(seq_len=default_granularity(cfg.world_size)))  # a refused model or method, as it is
        try:  # every probe length is a multiple of the granularity: a length the method refuses is bad input
            validate(cfg.replace(seq_len=granularity))
        except ConfigError as exc:
            raise ConfigError(f"--granularity {granularity} makes probe lengths the method refuses ({exc}); use a "
                              f"multiple of {default_granularity(cfg.world_size)}") from None
    check_writable(out)
    key = search_key(cfg, granularity)
    if resume and start_len is None:
        start_len = previous_answer(out, key)
        if start_len:
            print(f"  resuming from the previous answer {start_len}", flush=True)
    try:
        floor = run_floor(cfg)
    except ConfigError as exc:  # an out-of-tree method can still be searched, just not judged against a floor
        print(f"  note: {exc}; achieved/limit will not be reported", flush=True)
        floor = None
    search_id = uuid.uuid4().hex
    started = time.monotonic()
    last_record: dict = {}
    peaks: dict[int, int | None] = {}
    records: dict[int, dict] = {}

    def probe(seq_len: int) -> tuple[str, int | None, int | None]:
        nonlocal last_record
        record = run(cfg.replace(seq_len=seq_len))
        record["search_id"] = search_id
        append_record(out, record)
        peaks[seq_len] = record.get("peak_mem_bytes")
        last_record = records[seq_len] = record
        status = record["status"]
        print(f"  [{time.monotonic() - started:6.0f} s] probe {cfg.method} {cfg.model} S={seq_len}: {status}"
              + (f" ({record.get('error')})" if status not in (OK, OOM) and record.get("error") else ""), flush=True)
        resident = ((record.get("extra") or {}).get("memory") or {}).get("resident_at_step_start_bytes")
        return (status, *line_point(record, budget, resident))

    def probe_with_progress(seq_len: int) -> tuple[str, int | None, int | None]:
        bar.set_postfix_str(f"probing S={seq_len}")
        result = probe(seq_len)
        bar.update(1)
        return result

    budget = _search_budget(cfg)
    predicted, guide = None, "off" if predict is None else "off: a start length was given"
    predict_s = None
    if predict is not None and start_len is None:
        predicted, guide, predict_s = _predict(predict, cfg, granularity=granularity, min_len=min_len,
                                               max_len=max_len)
    with progress(desc=f"search {cfg.method} {cfg.model}", unit="probe") as bar:
        if predicted is None:
            outcome = search_max_length(probe_with_progress, granularity=granularity, min_len=min_len,
                                        max_len=max_len, start_len=start_len, budget=budget)
        else:
            outcome = guided_search_max_length(probe_with_progress, predicted=predicted, granularity=granularity,
                                               min_len=min_len, max_len=max_len, budget=budget)
    for miss in outcome.disagreements:
        print(f"  the prediction was wrong at S={miss['seq_len']}: predicted {miss['predicted']}, measured "
              f"{miss['measured']}; bracketed from there", flush=True)

    limit = floor.max_seq_len(budget, granularity) if floor is not None and budget is not None else None
    sp_size = last_record.get("sp_size") or cfg.sp_size or 1  # the probes' records know the method's default
    row = new_record(cfg.replace(seq_len=outcome.max_seq_len or granularity), sp_size=sp_size)
    for inherited in ("device_name", "implementation"):  # what only a probe knows
        row[inherited] = last_record.get(inherited, row[inherited])
    row.update(
        kind="search",
        search_id=search_id,
        search_key=key,
        run_id=search_id,
        status=outcome.status,
        error=last_record.get("error") if outcome.status in STOPPING else None,
        seq_len=outcome.max_seq_len or 0,
        max_seq_len=outcome.max_seq_len,
        first_oom_seq_len=outcome.first_oom_seq_len,
        peak_mem_bytes=peaks.get(outcome.max_seq_len) if outcome.max_seq_len else None,
        granularity=granularity,
        min_len=min_len,
        max_len=max_len,
        start_len=start_len,
        probes=[{"seq_len": n, "status": s, "peak_mem_bytes": peaks.get(n)} for n, s in outcome.probes],
        num_probes=len(outcome.probes),
        guide=guide,
        predicted_max_seq_len=outcome.predicted_max_seq_len,
        predict_wall_s=predict_s,
        guide_disagreements=outcome.disagreements,
        floor_limit_seq_len=limit,
        achieved_over_limit=(outcome.max_seq_len / limit) if (limit and outcome.max_seq_len) else None,
        floor=floor.to_dict() if floor is not None else None,
        wall_s=round(time.monotonic() - started, 3),
    )
    row["extra"]["binds"] = memory_that_binds(records.get(outcome.first_oom_seq_len))
    append_record(out, row)
    return row


def _predict(predict: Predictor, cfg: RunConfig, **search_range: int) -> tuple[int | None, str, float]:
    """(the predicted answer or None, the row's `guide` entry, seconds the prediction took)."""
    started = time.monotonic()
    try:
        predicted = predict(cfg, **search_range)
    except ConfigError as exc:
        print(f"  no prediction ({exc}): the plain search", flush=True)
        return None, f"off: no prediction ({exc})", round(time.monotonic() - started, 3)
    seconds = round(time.monotonic() - started, 3)
    print(f"  predicted max_seq_len {predicted} in {seconds:.0f} s: probing it and one step above", flush=True)
    return predicted, getattr(predict, "guide_name", "predicted"), seconds


def record_failed_search(cfg: RunConfig, *, out: str, reason: str) -> dict:
    """Append a search result row with status ``error`` and `reason`, probing nothing: what a workflow
    writes for a cell whose search process itself died, so the cell is reported (and drawn) as failed."""
    from autosp.harness.records import append_record, new_record
    from autosp.harness.runner import device_name

    search_id = uuid.uuid4().hex
    row = new_record(cfg, sp_size=cfg.sp_size or 1)
    try:  # the same device name as the cell's probes would report, so the cell lands in its device's panel
        row["device_name"] = device_name(cfg.device)
    except (RuntimeError, AssertionError):  # no such device here: the row still names the device asked for
        pass
    row.update(kind="search", search_id=search_id, run_id=search_id, status=ERROR, error=reason, seq_len=0,
               max_seq_len=None,
               first_oom_seq_len=None, floor_limit_seq_len=None, achieved_over_limit=None, probes=[], num_probes=0)
    append_record(out, row)
    return row


def _cmd_search(args: argparse.Namespace) -> int:
    from autosp.harness.flags import run_config_from_args
    from autosp.harness.measure import format_size

    cfg = run_config_from_args(args, seq_len=1)
    if args.record_failure:
        record_failed_search(cfg, out=args.out, reason=args.record_failure)
        print(f"recorded {cfg.method} {cfg.model} as failed: {args.record_failure} -> {args.out}")
        return 0
    predict = None
    if args.guide == "simulate":
        from autosp.experiments.guided import simulated as predict
    row = run_search(cfg, out=args.out, granularity=args.granularity, min_len=args.min_len, max_len=args.max_len,
                     start_len=args.start_len, resume=args.resume, predict=predict)
    ratio = row["achieved_over_limit"]
    print(f"{cfg.method} {cfg.model} P={cfg.world_size} budget {format_size(cfg.memory_budget)}: "
          f"{row['status']}, max_seq_len={row['max_seq_len']}, first_oom={row['first_oom_seq_len']}, "
          f"floor limit={row['floor_limit_seq_len']}"
          + (f" (achieved {ratio:.0%} of it)" if ratio else "")
          + f", {row['num_probes']} probes in {row['wall_s']:.0f} s"
          + (f"; one granule above, {row['extra']['binds']} memory runs out" if row["extra"]["binds"] else "")
          + (f" (predicted {row['predicted_max_seq_len']}"
             + (f", wrong at {len(row['guide_disagreements'])} probe(s))" if row["guide_disagreements"] else ")")
             if row["predicted_max_seq_len"] is not None else "")
          + f" -> {args.out}")
    if row["status"] == INTERRUPTED:
        print(f"search stopped: {row['error']}")
        return INTERRUPTED_EXIT_CODE
    if row["status"] in STOPPING:
        print(f"search stopped by a failed probe: {row['error']}")
        return 1 if args.fail_on_error else 0
    return 0


def add_search_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp search --method M --model X --world-size P [--memory-budget B] ... --out FILE`."""
    from autosp.harness.flags import add_run_config_arguments

    p = subparsers.add_parser("search", help="maximum trainable sequence length of one method (OOM search)")
    add_run_config_arguments(p, varied=("seq_len",))
    p.set_defaults(steps=0)  # a probe needs its peak (the warm-up and the measured step), not a timed step
    p.add_argument("--granularity", type=int, default=None, help="length step (default 2*P*128)")
    p.add_argument("--min-len", type=int, default=None, help="shortest length tried (default: the granularity)")
    p.add_argument("--max-len", type=int, default=1 << 20, help="longest length tried")
    p.add_argument("--start-len", type=int, default=None,
                   help="first length probed (e.g. a previous answer: then two probes confirm it)")
    p.add_argument("--guide", choices=("simulate", "off"), default="simulate",
                   help="simulate (default): predict the answer with `autosp simulate --search` first, then measure "
                        "the prediction and one step above it (bracketing only where a probe disagrees); off: the "
                        "plain bracketing search. A --start-len (or --resume) hint replaces the prediction")
    p.add_argument("--resume", action="store_true",
                   help="start from the answer of the latest identical search in --out (re-checks it in ~2 probes)")
    p.add_argument("--fail-on-error", action=argparse.BooleanOptionalAction, default=True,
                   help=f"exit 1 when a probe ends in error/timeout (the result row is written either way); "
                        f"SIGTERM/SIGINT end the search as interrupted, exit {INTERRUPTED_EXIT_CODE}")
    p.add_argument("--out", default="results/trainability.jsonl", help="JSONL file for probe records and the result")
    p.add_argument("--record-failure", metavar="REASON", default=None,
                   help="probe nothing: append a failed result row with this reason (a workflow's fallback)")
    p.set_defaults(func=_cmd_search, starts_ranks=True)
