"""The peak at the model's full depth: simulated whole, or at 2 and 3 (or 3 and 4) layers and extrapolated phase
by phase along the line of one op (the package docstring says when that is exact)."""
from __future__ import annotations

from typing import Any

from autosp.comm.host_optimizer import HostMemoryError
from autosp.errors import AutoSPError
from autosp.experiments.simulate.clock import LinedTrace
from autosp.experiments.simulate.config import EXACT_LAYERS, SimulationError, simulate_config
from autosp.experiments.simulate.devices import DeviceModel
from autosp.experiments.simulate.programs import rank_peak, rank_peaks
from autosp.experiments.simulate.tracker import LINEAR_TERMS, PhasePeak, RankPeak
from autosp.harness.config import RunConfig

#: predictions made in this process, by (configuration, allocator blocks): devices that round alike share them
_PREDICTIONS: dict[tuple[str, int, int], tuple[RankPeak, dict[str, Any]]] = {}


def predict_peak(cfg: RunConfig, device: DeviceModel) -> tuple[RankPeak, dict[str, Any]]:
    """Rank 0's peak at the model's full depth: simulated whole, or at 2 and 3 layers and extrapolated."""
    key = (cfg.config_hash(), device.small_block_bytes, device.large_block_bytes)
    if planned_by_device(cfg):  # the planner's choices depend on the device's and its node's memory
        key += (device.usable_bytes, device.fixed_bytes, device.host_bytes_per_node,
                device.ranks_per_node(cfg.world_size))
    if key not in _PREDICTIONS:
        _PREDICTIONS[key] = _predict_peak(cfg, device)
    return _PREDICTIONS[key]


def _predict_peak(cfg: RunConfig, device: DeviceModel) -> tuple[RankPeak, dict[str, Any]]:
    from autosp.models import get_preset

    run_cfg = simulate_config(cfg)
    depth = get_preset(cfg.model).num_layers
    try:
        if depth <= EXACT_LAYERS:
            return rank_peak(run_cfg, device), {"layers_simulated": [depth], "extrapolated": False}
        whole = NOT_LINEAR_IN_DEPTH.get(cfg.method) or planned_by_device(cfg)
        if whole:
            return rank_peak(run_cfg, device), {"layers_simulated": [depth], "extrapolated": False,
                                                 "note": f"{whole}: simulated whole"}
        pair = SECOND_PAIR if _layers_reach_their_neighbours(cfg) else (2, 3)
        runs = rank_peaks(run_cfg, device, pair)
        peak, note = extrapolate_peak(*runs, depth)
        if peak is None and pair != SECOND_PAIR and depth > SECOND_PAIR[1]:
            runs.append(rank_peak(run_cfg, device, SECOND_PAIR[1]))
            peak, later = extrapolate_peak(*runs[-2:], depth)
            note = f"{note}; extrapolated from 3 and 4 layers" if peak is not None else f"{note}; {later}"
        if peak is None:
            return rank_peak(run_cfg, device), {"layers_simulated": [depth], "extrapolated": False,
                                                 "note": f"{note}: simulated whole"}
    except (SimulationError, HostMemoryError):  # the latter: over the host budget, as a measured run is (oom)
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the method on fake tensors is reported, not guessed
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        # the method's own refusal (it would refuse the real run alike) vs a failure of the simulation itself
        what = "refuses this configuration" if isinstance(exc, AutoSPError) else "cannot run on fake tensors"
        raise SimulationError(f"--method {cfg.method} {what}: {type(exc).__name__}: {first}") from exc
    low, high = runs[-2:]
    how = {"layers_simulated": [run.num_layers for run in runs], "extrapolated": True,
           "extrapolated_from": [low.num_layers, high.num_layers],
           "per_layer_peak_bytes": high.phases[peak.peak_phase].peak_bytes - low.phases[peak.peak_phase].peak_bytes}
    if peak.peak_phase != high.peak_phase:
        note = f"{note}; " if note else ""
        note += f"at {depth} layers the {peak.peak_phase} peak overtakes the {high.peak_phase} one"
    return peak, {**how, "note": note} if note else how


#: methods whose peak is not linear in the depth, simulated whole. DeepSpeed's ZeRO-3 gathers, prefetches and
#: releases parameters in buckets of elements, not by layer (and caps its buckets at the model's parameter count):
#: llama-3.2-3b at 12K on an a100-80gb, 2 and 3 layers extrapolated to 74.5 GiB at the same op, 28 layers simulated
#: 70.5 GiB (saved activations 54.2 vs 50.1 GiB; per-layer peak steps of 1.90-1.93, then 1.76 GiB from 6 to 7 layers)
#: alst (ZeRO-3 too) is extrapolated: each checkpointed layer leaves only its input on the device (offloaded to
#: host) and its optimizer state on the host, so a layer adds its parameter partition and nothing bucket-sized (its
#: 2-3 line hit 32 layers simulated whole to the byte, llama-3.1-8b at 65,536 tokens on 8 ranks; hf:tiny at 6
#: layers in tests/experiments/test_simulate.py); where the line breaks, `extrapolate_peak` says so and it runs whole
NOT_LINEAR_IN_DEPTH = {"zero3": "DeepSpeed ZeRO-3's peak is not linear in the depth (element-sized buckets)"}
#: the depths extrapolated from when 2 and 3 layers peak at different ops: a 2-layer model has no inner layer
SECOND_PAIR = (3, 4)
#: the baselines sharded by FSDP2 (`baselines.fsdp_sharding`), by the ZeRO stages at which they are
FSDP2_SHARDED = {"fsdp": (3,), "ulysses": (3,), "ring": (3,)}


#: `--sac` for the memory planner's last rung: a byte budget no plan fits, so every layer, at any depth, takes the
#: ladder's last rung (recomputed whole from its input, its all-to-alls re-run, its saved values in host memory):
#: a fixed policy, linear in the depth like `sac` or `full`. Where a full depth's saved values would not fit the
#: host budget the real planner keeps some on the device; the line moves them all, and the record says `oom` in
#: host memory (`lengths.simulate`), so the line never claims a length the planner could not reach
LAST_RUNG_SAC = "budget=1B"


def planned_by_device(cfg: RunConfig) -> str | None:
    """Why autosp's memory planner (`--sac auto`) is not linear in depth: it plans each layer against the whole
    device, so 2 and 3 layers keep what 32 would recompute or move. Its last rung (`LAST_RUNG_SAC`) is."""
    from autosp.compiler.memory import SacPolicy, parse_policy

    policy = parse_policy(cfg.sac)
    if cfg.method == "autosp" and policy.kind == SacPolicy.AUTO and policy != parse_policy(LAST_RUNG_SAC):
        return "the memory planner's choices depend on the depth"
    return None


def model_state_at_depth(cfg: RunConfig, device: DeviceModel) -> RunConfig:
    """`cfg` with autosp's `offload` for the optimizer state and the parameters decided (`autosp.api.state_offload`)
    for the model at its full depth on `device`, as its whole-depth program decides them: a program of fewer
    layers, extrapolated, decides for its own few (Llama-3.1-8B on an h100-80gb: 2 layers' state fits, 32 layers'
    does not). Unchanged where nothing is left to decide."""
    from autosp.api import state_offload
    from autosp.compiler.memory import OffloadPlan
    from autosp.experiments.simulate.adapters import optimizer_implementation_of
    from autosp.harness.runner import DTYPES
    from autosp.harness.strategy import get_strategy
    from autosp.models import build_model
    from baselines.autosp_method import compile_options

    if cfg.method != "autosp" or "auto" not in (OffloadPlan.parse(cfg.offload).optimizer,
                                                  OffloadPlan.parse(cfg.offload).params):
        return cfg
    zero = get_strategy(cfg.method).zero_stage(cfg)
    model = build_model(cfg.model, dtype=DTYPES[cfg.dtype], device="meta")
    budget = device.usable_bytes - device.fixed_bytes if cfg.memory_budget is None else cfg.memory_budget
    with optimizer_implementation_of(device):  # as the program's setup decides it (`RankProgram`)
        plan = state_offload(compile_options(cfg, zero), model, zero=zero, group_size=cfg.world_size,
                             device_bytes=budget)
    return cfg.replace(offload=str(plan))


def _layers_reach_their_neighbours(cfg: RunConfig) -> bool:
    """Whether a layer's program reaches into the next layers' (FSDP2 prefetches the next layer's parameters in
    forward and backward and reduce-scatters the previous one's gradients), so that a 2-layer model, all boundary,
    is off the line even where it peaks at the op of the same name (fsdp on a 6-layer wide `tiny-mha`, mi250-gcd,
    128 tokens: the 2-3 line said 17,460,224 B, 6 layers simulated 17,368,064, the 3-4 line exact; ring ZeRO-3 on
    llama-2-13b at 18K, mi250-gcd: an `empty_like` at 2, 3 and 4 layers, the 2-3 line 66.8 GiB at 40 layers, the
    3-4 line 43.4): such programs start from 3 and 4."""
    from autosp.harness.strategy import get_strategy

    return get_strategy(cfg.method).zero_stage(cfg) in FSDP2_SHARDED.get(cfg.method, ())


def extrapolate_peak(low: RankPeak, high: RankPeak, depth: int) -> tuple[RankPeak | None, str | None]:
    """The peak at `depth` layers from two runs one layer apart, phase by phase, or why that cannot be done.

    Layers are identical, so at an op at a fixed place relative to the layers (e.g. the last layer's backward)
    every term - model state, gradients, saved activations, the transient working set - grows by the same bytes
    per layer. Each phase's peak and terms are extrapolated along their own line, and the highest phase at
    `depth` wins: with depth, the optimizer step (state, gradients and AdamW's multi-tensor temporary) can
    overtake a backward peak that short models reach in the logits' or the embedding's gradient. The line is
    that of one op only if the winning phase peaks at the same op in both runs (and no term of it goes negative:
    seen for DeepSpeed's ZeRO-3, `NOT_LINEAR_IN_DEPTH`); if not, None."""
    if list(low.phases) != list(high.phases):
        return None, f"the phases differ at {low.num_layers} and {high.num_layers} layers"
    more = depth - high.num_layers

    def line(name: str, term: str) -> int:
        later = getattr(high.phases[name], term)
        return later + more * (later - getattr(low.phases[name], term))

    phases = {name: PhasePeak(**{term: line(name, term) for term in LINEAR_TERMS}, peak_op=phase.peak_op)
              for name, phase in high.phases.items()}
    winner = max(phases, key=lambda name: phases[name].peak_bytes)  # a tie: the earlier phase, as the tracker
    ops = (low.phases[winner].peak_op, high.phases[winner].peak_op)
    if ops[0] != ops[1]:
        return None, f"{winner} peak op differs at {low.num_layers} and {high.num_layers} layers ({ops[0]} / {ops[1]})"
    if negative := [term for term in LINEAR_TERMS if getattr(phases[winner], term) < 0]:  # no line, then
        return None, (f"{winner} {negative[0]} extrapolates below zero from {low.num_layers} and "
                      f"{high.num_layers} layers")
    return RankPeak(**vars(phases[winner]), peak_phase=winner, num_layers=depth,
                    ops=high.ops + more * (high.ops - low.ops),
                    host_offloaded_bytes=high.host_offloaded_bytes + more * (high.host_offloaded_bytes
                                                                             - low.host_offloaded_bytes),
                    assumed_healthy_reads=high.assumed_healthy_reads, phases=phases,
                    recompute_flops=None if None in (low.recompute_flops, high.recompute_flops)
                    else high.recompute_flops + more * (high.recompute_flops - low.recompute_flops),
                    trace=None if None in (low.trace, high.trace) else LinedTrace(low.trace, high.trace, more)), None
