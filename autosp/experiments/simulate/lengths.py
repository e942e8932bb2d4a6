"""A simulated run's record (`simulate`) and the search for the longest length that fits a device
(`simulated_search`, started from the peak-vs-length line of earlier probes: `curve_hint`)."""
from __future__ import annotations

import time
import uuid
from typing import Any

from autosp.comm.host_optimizer import HostMemoryError
from autosp.experiments.simulate.config import (
    COMPONENTS,
    DIRECT_INDUCTOR_BACKEND,
    EXACT_LAYERS,
    SIMULATED_BACKEND,
    SimulationError,
)
from autosp.experiments.simulate.devices import DeviceModel
from autosp.experiments.simulate.elsewhere import ProbeElsewhere
from autosp.experiments.simulate.extrapolate import (
    LAST_RUNG_SAC,
    model_state_at_depth,
    planned_by_device,
    predict_peak,
)
from autosp.experiments.simulate.programs import cpu_elsewhere, deeper_programs_elsewhere, shared_rank_programs
from autosp.experiments.simulate.speed import time_record
from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.measure import format_size, host_over_budget_error, node_host_bytes
from autosp.timing import DeviceRates


def simulate(cfg: RunConfig, device: DeviceModel) -> dict[str, Any]:
    """A `mode: simulated` record of `cfg` on `device`: predicted per-rank peak, status ok/oom/error."""
    from autosp.harness.records import new_record
    from autosp.harness.runner import validate

    strategy, sp_size = validate(cfg.replace(device="cpu"))
    record = new_record(cfg, sp_size=sp_size, mode="simulated", zero=strategy.zero_stage(cfg))
    record.update(device=device.name, device_name=f"simulated {device.name}", memory_budget=device.usable_bytes)
    started = (time.monotonic(), time.process_time() + cpu_elsewhere())

    def clock() -> dict[str, float]:  # this simulation's wall and CPU seconds (this process's and its depth process's)
        return {"wall_s": round(time.monotonic() - started[0], 3),
                "cpu_s": round(time.process_time() + cpu_elsewhere() - started[1], 3)}

    try:
        peak, how = predict_peak(cfg, device)
    except SimulationError as exc:
        record.update(status="error", error=str(exc))
        record["extra"].update(clock())
        return record
    except HostMemoryError as exc:  # offload=optimizer: the state alone is over the rank's share of the host budget
        record.update(status="oom", error=str(exc))
        record["extra"].update(oom_in="host", **clock())
        return record
    total = peak.peak_bytes + device.fixed_bytes
    host_budget, node_host = _host_budget(cfg, device), node_host_bytes(peak.host_offloaded_bytes,
                                                                         device.ranks_per_node(cfg.world_size))
    record.update(status="ok" if total <= device.usable_bytes else "oom", peak_mem_bytes=total,
                  peak_mem_by_rank=[total])
    if record["status"] == "oom":
        record["error"] = (f"predicted peak {format_size(total)} exceeds {device.name}'s "
                           f"{format_size(device.usable_bytes)}")
    elif host_budget is not None and node_host > host_budget[0]:
        record.update(status="oom", error=host_over_budget_error(node_host, *host_budget))
        record["extra"]["oom_in"] = "host"
    record["extra"].update(
        simulated=True, simulated_rank=0, **clock(),
        executed_backend=DIRECT_INDUCTOR_BACKEND if cfg.method == "ds-autosp" else SIMULATED_BACKEND,
        assumed_healthy_reads=peak.assumed_healthy_reads,
        fusion="none: every intermediate of the partitioned graphs is materialised (as aot_eager runs them)",
        breakdown={**{name: getattr(peak, name) for name in COMPONENTS},
                   "live_tensor_bytes": peak.live_tensor_bytes, "allocator_blocks_bytes": peak.peak_bytes,
                   "context_bytes": device.context_bytes, "workspace_bytes": device.workspace_bytes,
                   "peak_op": peak.peak_op, "peak_phase": peak.peak_phase,
                   "host_offloaded_bytes": peak.host_offloaded_bytes},
        node_host_bytes=node_host, host_budget_bytes=host_budget and host_budget[0], **how)
    if peak.recompute_flops is not None:  # per rank and step: the planner's, or the method's own count
        record["extra"]["recompute_flops"] = peak.recompute_flops
    if peak.trace is not None and (rates := _rates(device)) is not None:
        record["extra"]["time"] = time_record(peak.trace.time(rates, device.gpus_per_node), cfg, rates,
                                              record["dp_size"])
    if peak.plans and not how.get("extrapolated"):  # the planner's choice at this depth and length, as measured runs
        record["extra"]["sac_auto"] = peak.plans
    return record


def _rates(device: DeviceModel) -> DeviceRates | None:
    """The device's rates, or None where it has none (the cpu row before `autosp calibrate`): the record then
    carries no time, never a guessed one."""
    from autosp.timing.rates import RatesError, device_rates

    try:
        return device_rates(device.name)
    except RatesError:
        return None


def _host_budget(cfg: RunConfig, device: DeviceModel) -> tuple[int, str] | None:
    """The host memory a node may hold and where the bound comes from: --host-memory-budget, else the catalogue's
    node (`devices.py`), else none."""
    if cfg.host_memory_budget is not None:
        return cfg.host_memory_budget, "--host-memory-budget"
    if device.host_bytes_per_node is not None:
        return device.host_bytes_per_node, f"a {device.name} node's host memory"
    return None


def curve_hint(curve: dict[int, int], tensor_budget: int, granularity: int) -> int | None:
    """Where the line through the two simulated lengths whose peaks lie nearest `tensor_budget` crosses it.

    `curve`: length -> allocator-charged tensor peak (no context) of earlier probes of the same configuration,
    e.g. a search for another device type. Only a first length to probe: the statuses of the probes decide.
    The second point lies at least an eighth of the length away when there is one: the slope between two
    lengths one granularity step apart is dominated by allocator rounding (seen: 0.21 vs 0.31 GiB per 1K)."""
    if len(curve) < 2:
        return None
    distance = lambda n: (abs(curve[n] - tensor_budget), n)  # noqa: E731
    first = min(curve, key=distance)
    far = [n for n in curve if abs(n - first) >= max(granularity, first // 8)]
    second = min(far or [n for n in curve if n != first], key=distance)
    (s1, p1), (s2, p2) = sorted((n, curve[n]) for n in (first, second))
    if p2 <= p1:
        return None
    return max(granularity, int((s1 + (tensor_budget - p1) * (s2 - s1) / (p2 - p1)) // granularity) * granularity)


def simulated_search(cfg: RunConfig, device: DeviceModel, *, granularity: int | None = None,
                     min_len: int | None = None, max_len: int = 1 << 20,
                     curve: dict[int, int] | None = None, jobs: int = 1) -> dict[str, Any]:
    """Longest trainable length on `device` by `autosp search`'s own search, each probe a simulation.

    The search starts where `curve` (the peaks simulated so far for this configuration, extended by this
    search's probes) says the device's budget is reached, else at the analytic floor's limit: with peaks
    close to linear in the length, a search for a second device type needs about two probes (the answer and
    one granularity step above), and every probe already simulated at a length is reused (`predict_peak`).

    The memory planner (`--sac auto`) deeper than `EXACT_LAYERS` is simulated whole, ~10x a 2- and 3-layer pair
    at 8B: its search runs on the planner's last rung instead (`LAST_RUNG_SAC`, extrapolated), whose longest
    length is the planner's where the device binds — a length its last rung cannot train, no rung can (each
    earlier rung keeps more on the device) — and then simulates the planner itself, whole, at that length and one
    granule above (`_planner_around`): the answer is the planner's own. Where the planner fails there (its
    estimate chose a rung that does not fit) its search goes on below; where it fits one granule above (host
    memory bound the last rung, which moves every saved value; the planner keeps some on the device) it goes on
    above, each probe the planner whole. `jobs` >= 2 (`elsewhere`): each extrapolated pair's deeper program runs in a
    second process beside the shallower one here, and the planner's probe one granule above runs in a second process
    while this one probes the answer (its record kept only where the sequential search makes it). The row's `cpu_s`
    counts this process and the depth process."""
    from autosp.experiments.search import (
        FOUND,
        NO_OOM_UP_TO_MAX,
        OOM_AT_MIN,
        default_granularity,
        line_point,
        memory_that_binds,
        search_max_length,
    )

    granularity = granularity or default_granularity(cfg.world_size)
    curve = {} if curve is None else curve
    probes: list[dict[str, Any]] = []
    started, cpu_started = time.monotonic(), time.process_time()
    limit, floor = _floor_limit(cfg, device.usable_bytes - device.fixed_bytes, granularity)
    last_rung = _last_rung(cfg, device)

    def probe_of(run_cfg: RunConfig, on_curve: bool):
        def probe(seq_len: int, made: dict[str, Any] | None = None) -> tuple[str, int | None, int | None]:
            record = made if made is not None else simulate(run_cfg.replace(seq_len=seq_len), device)
            probes.append(record)
            if record["status"] not in ("ok", "oom"):
                return record["status"], None, None
            if "breakdown" not in record["extra"]:  # oom before any peak: the optimizer state alone over the host's
                return record["status"], None, None
            breakdown = record["extra"]["breakdown"]
            if on_curve:
                curve[seq_len] = breakdown["allocator_blocks_bytes"]
            # model state at the peak is what was resident at the step's start: the line's value at length 0
            resident = breakdown["model_state_bytes"] + device.fixed_bytes
            return (record["status"], *line_point(record, device.usable_bytes, resident))
        return probe

    start = curve_hint(curve, device.usable_bytes - device.fixed_bytes, granularity) or limit
    search = dict(granularity=granularity, min_len=min_len or granularity, budget=device.usable_bytes)
    with shared_rank_programs():
        with deeper_programs_elsewhere(jobs):  # an extrapolated pair's deeper program in a second process
            outcome = search_max_length(probe_of(last_rung or cfg, True), max_len=max_len, start_len=start,
                                        **search)
            depth_cpu_s = cpu_elsewhere()
        confirmed = None
        if last_rung is not None and outcome.max_seq_len:
            built_at = outcome.max_seq_len  # the planner's program is set up at its first probe, the answer
            ahead = (lambda n: ProbeElsewhere(cfg.replace(seq_len=n), device, built_at)) if jobs >= 2 else None
            outcome, confirmed = _planner_around(outcome, probe_of(cfg, False), granularity, max_len, search, ahead)
    best = next((r for r in reversed(probes) if r["seq_len"] == outcome.max_seq_len
                 and (last_rung is None or r["config"]["sac"] == cfg.sac)), None)
    best = best or next((r for r in reversed(probes) if r["seq_len"] == outcome.max_seq_len), None)
    row = dict(best if best is not None else probes[-1])
    row.update(kind="search", seq_len=outcome.max_seq_len or 0, status=outcome.status,
               max_seq_len=outcome.max_seq_len, first_oom_seq_len=outcome.first_oom_seq_len,
               granularity=granularity, num_probes=len(outcome.probes),
               probes=[_probe_summary(r, with_sac=last_rung is not None) for r in probes],
               wall_s=round(time.monotonic() - started, 3),
               cpu_s=round(time.process_time() - cpu_started + depth_cpu_s, 3))
    row.update(floor_limit_seq_len=limit, floor=floor,
               achieved_over_limit=(outcome.max_seq_len / limit) if (limit and outcome.max_seq_len) else None)
    above = next((r for r in reversed(probes) if r["seq_len"] == outcome.first_oom_seq_len
                  and (last_rung is None or r["config"]["sac"] == cfg.sac)), None)
    row["extra"] = {**row["extra"], "binds": memory_that_binds(above)}
    if last_rung is not None:
        row["extra"]["searched_on"] = {"sac": last_rung.sac, "planner_confirmed": confirmed}
    if outcome.status in (FOUND, NO_OOM_UP_TO_MAX, OOM_AT_MIN):
        row["error"] = None
    else:
        row["error"] = probes[-1]["error"]
    row["run_id"] = row["search_id"] = uuid.uuid4().hex
    return row


def _probe_summary(record: dict[str, Any], *, with_sac: bool) -> dict[str, Any]:
    """A probe as the search's row lists it: its length, status and peak, its wall and CPU seconds, and where the
    planner was simulated whole, the min-cut partitions it made (what a search's time goes to, probe by probe)."""
    extra = record.get("extra") or {}
    plans = extra.get("sac_auto") or []
    return {"seq_len": record["seq_len"], "status": record["status"], "peak_mem_bytes": record["peak_mem_bytes"],
            **({"sac": record["config"]["sac"]} if with_sac else {}),
            "wall_s": extra.get("wall_s"), "cpu_s": extra.get("cpu_s"),
            "partitions": sum(plan["partitions_tried"] for plan in plans) if plans else None}


def _planner_around(rung: Any, planner: Any, granularity: int, max_len: int, search: dict[str, Any],
                    ahead: Any = None) -> tuple[Any, bool]:
    """The planner's own answer from its last rung's (`simulated_search`): the planner simulated whole at the
    rung's longest length and one granule above; where it fits at the first and not the second, that is the
    answer; else its search goes on from those two probes, below (a rung the planner's estimate chose that does
    not fit) or above (host memory bound the last rung, which moves every saved value; the planner keeps some on
    the device). So the answer is always the planner's, simulated whole there and one granule above (unless that
    is past `max_len`). Returns (the outcome, whether the planner fits at the rung's answer). `ahead(length)`: a
    `ProbeElsewhere` of the planner at that length, started before the answer is probed here; its record is used
    where the sequential search would probe that length, and the process ended where it would not."""
    from autosp.experiments.search import search_max_length

    answer = rung.max_seq_len
    above = answer + granularity
    elsewhere = ahead(above) if ahead is not None and above <= max_len else None
    try:
        measured = [(answer, planner(answer))]
        confirmed = measured[0][1][0] == "ok"
        if confirmed and above <= max_len:
            measured.append((above, planner(above, elsewhere.result() if elsewhere else None)))
            elsewhere = None
    finally:
        if elsewhere is not None:
            elsewhere.cancel()
    outcome = search_max_length(planner, max_len=max_len if confirmed else answer, measured=measured, **search)
    outcome.probes = rung.probes + outcome.probes
    return outcome, confirmed


def _last_rung(cfg: RunConfig, device: DeviceModel) -> RunConfig | None:
    """The planner's last rung, where a search runs on it (see `simulated_search`), with the model state where the
    whole-depth planner keeps it (`model_state_at_depth`); None where it does not."""
    from autosp.models import get_preset

    if planned_by_device(cfg) and get_preset(cfg.model).num_layers > EXACT_LAYERS:
        return model_state_at_depth(cfg.replace(sac=LAST_RUNG_SAC), device)
    return None


def _floor_limit(cfg: RunConfig, budget: int, granularity: int) -> tuple[int | None, dict | None]:
    """The analytic memory floor's longest length for the tensor budget (as `autosp search` reports it)."""
    from autosp.experiments.floor import run_floor

    try:
        floor = run_floor(cfg)
    except ConfigError:
        return None, None
    return floor.max_seq_len(budget, granularity), floor.to_dict()


def summary_line(record: dict[str, Any]) -> str:
    head = f"{record['method']} {record['model']} P={record['world_size']} on {record['device']} (simulated)"
    if record["status"] == "error" or (record.get("peak_mem_bytes") is None and record.get("error")):
        return f"{head}: {record['status']}: {record['error']}"
    b = record["extra"].get("breakdown", {})
    parts = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {format_size(b[k])}" for k in COMPONENTS if k in b)
    detail = (f"peak {format_size(record['peak_mem_bytes'])} of {format_size(record['memory_budget'])} "
              f"[{parts}; at {b.get('peak_op')} in {b.get('peak_phase')}]")
    if record.get("kind") == "search":
        binds = record["extra"].get("binds")
        return f"{head}: {record['status']}, max_seq_len={record['max_seq_len']} ({record['num_probes']} probes, " \
               f"{record['wall_s']:.0f} s); at that length {detail}" + \
               (f"; one granule above, {binds} memory runs out" if binds else "")
    time = record["extra"].get("time")
    if time:
        detail += (f"; predicted step {time['iteration_s']:.3g} s, {time['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                   + (f"MFU {time['mfu']:.0%}, " if time["mfu"] is not None else "") +
                   f"exposed collectives {time['exposed_collective_s']:.3g} s, "
                   f"copies {time['exposed_copy_s']:.3g} s")
    return f"{head} seq {record['seq_len']}: {record['status']}: {detail} ({record['extra']['wall_s']:.1f} s)"
