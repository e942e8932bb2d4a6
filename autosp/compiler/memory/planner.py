"""The memory planner (``--sac auto`` / ``budget=<bytes>``, the compiler's default): per compiled graph, the least
added step time that fits the device's byte budget.

Each value backward needs is kept on the device, moved to host memory, or recomputed. The planner walks a ladder of
plans ordered by recompute cost and takes the first whose estimated peak fits: keep everything; recompute the
token-wise ops of the first k layers; also their attention; also their all-to-alls (the whole layer, as per-layer
checkpointing does). On a rung that does not fit as it is, saved values move to host memory first (``offload=auto``,
within the host budget; reloaded a layer ahead, or late where that is what still does not fit): host memory is
spent before recompute — unless the device's rates are known (`time_rank`), where a plan that moves saved values is
priced against the ladder's plan without host memory and the one with the fewer predicted seconds is taken. The
smallest fitting k is found by regula falsi on the rungs' peaks, safeguarded by bisection (`smallest_fitting_rung`).
The peak is estimated from the graph alone, by a liveness replay of the partitioned graphs (`live_at_peak`) with the
scratch bytes opaque ops declare; the cost is the recomputed FLOPs (`recompute_flops`) and the bytes moved. The
ladder, the cost model and how the replay was checked against measured peaks:
docs/measurements/2026-12-02-planner.md ("How the planner decides").
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.utils.checkpoint import CheckpointPolicy

from autosp.comm.host_params import GRADIENT_TO_HOST_OP
from autosp.comm.transients import nbytes, transient_bytes
from autosp.compiler.fx import (
    assign_layers,
    copy_graph,
    forward_nodes,
    is_attention_value,
    is_collective_value,
    is_pinned_value,
    is_view,
    node_nbytes,
)
from autosp.compiler.memory.flops import node_flops, recompute_flops
from autosp.compiler.memory.offload import (
    OFFLOAD_OP,
    OFFLOAD_SCOPES,
    RELOAD_OP,
    OffloadReport,
    offload_boundaries,
)
from autosp.compiler.memory.records import saved_storages, saved_values, view_owner
from autosp.compiler.memory.retile import KeepLargerTiles, TileFirst, TileSmaller
from autosp.compiler.memory.rungs import smallest_fitting_rung
from autosp.compiler.memory.tags import tag_layers, tag_node, tag_parameter_regathers


@dataclass(frozen=True)
class Plan:
    """What the planner chose for one graph and what it costs per step (the record's ``extra.sac_auto`` entries)."""

    budget_bytes: int | None
    host_budget_bytes: int | None
    estimated_peak_bytes: int
    saved_activation_bytes: int  # on the device, from forward to backward
    layers: int
    tokenwise_recompute_layers: int  # layers whose token-wise ops are recomputed
    attention_recompute_layers: int  # of those, layers whose attention is recomputed too
    collective_recompute_layers: int  # of those, layers whose all-to-alls are re-run too (the whole layer)
    recompute_flops: int
    offloaded_bytes: int  # saved values moved to host memory in forward and back in backward (each way, per step)
    offload_scope: str | None  # `offload.OFFLOAD_SCOPES`: the boundaries only, or every saved value of a layer
    reload: str | None  # `offload.RELOAD_TIMES`: the offloaded values brought back a layer ahead, or late
    fits: bool
    partitions_tried: int

    @property
    def recomputes_attention(self) -> bool:
        return self.attention_recompute_layers > 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recomputes_attention": self.recomputes_attention,
                "recomputes_collectives": self.collective_recompute_layers > 0, "offloads": self.offloaded_bytes > 0}


def default_budget(joint_inputs: Sequence[Any]) -> int | None:
    """Free memory of the device the graph runs on, at compile time (model state already resident); None on CPU."""
    devices = {t.device for t in _flat_tensors(joint_inputs)}
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return None
    free, _total = torch.cuda.mem_get_info(cuda[0])
    return int(free)


def _flat_tensors(values: Any) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _flat_tensors(v)]
    return []


# --------------------------------------------------------------------------------------------- the ladder


def layer_order(joint_gm: fx.GraphModule) -> list[str]:
    """The decoder layers of a joint graph in forward order."""
    layers = assign_layers(joint_gm.graph, forward_nodes(joint_gm.graph))
    return list(dict.fromkeys(layer for layer in layers.values() if layer is not None))


def tag_rung(joint_gm: fx.GraphModule, tokenwise: Sequence[str], attention: Sequence[str],
             collectives: Sequence[str] = ()) -> None:
    """Tag one rung: opaque kernels always pinned, collectives pinned outside `collectives`, attention pinned
    outside `attention`, the token-wise ops of the layers in `tokenwise` (attention too in `attention`, and its
    all-to-alls in `collectives`: the whole layer, as per-layer checkpointing re-runs it) recomputed, layer outputs
    pinned when any layer is."""
    graph = joint_gm.graph
    forward = forward_nodes(graph)
    layers = assign_layers(graph, forward)
    for node in graph.nodes:
        if node not in forward:
            continue
        rerun_collective = is_collective_value(node) and layers.get(node) in collectives
        if (is_pinned_value(node) and not rerun_collective) or (
                is_attention_value(node) and layers.get(node) not in attention):
            tag_node(node, CheckpointPolicy.MUST_SAVE)
    tag_parameter_regathers(graph, forward)
    if tokenwise:
        tag_layers(graph, forward, recompute_attention=set(attention), recompute=set(tokenwise))


@dataclass
class _Trial:
    tokenwise: int
    attention: int
    collectives: int
    fw_module: fx.GraphModule
    bw_module: fx.GraphModule
    peak: int
    saved: int
    offload: OffloadReport | None
    scope: str | None
    reload: str | None


def plan_partition(
    joint_gm: fx.GraphModule, joint_inputs: Sequence[Any], budget_bytes: int | None, *, num_fwd_outputs: int,
    offload: str = "auto", host_budget_bytes: int | None = None, tile_first: bool = False,
    smaller_tiles_below: int | None = None, larger_tiles_peak: int | None = None, last_rung_first: bool = False,
    no_rung_fits: bool = False, **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule, dict[str, Any], OffloadReport | None]:
    """Partition `joint_gm` with the cheapest rung whose estimated peak fits `budget_bytes` (see the module doc);
    `offload` (`autosp.compiler.memory.offload.offload_mode`): `auto` moves saved values to host memory where a rung
    does not fit without it and its host bytes fit `host_budget_bytes` (None: no limit) — the layer boundaries
    first, then every saved value of a layer; `activations` the boundaries on every rung, `off` never. Returns
    (forward, backward, the plan as a dict, what was offloaded or None). Nothing fits: the last rung (every layer
    recomputed whole, collectives included). `tile_first`: raise `TileFirst` instead of recomputing or moving
    anything where the first rung does not fit as it is (tiling comes before the other levers). `smaller_tiles_below`
    (a tiled graph whose tiles can still be halved): raise `TileSmaller` where no rung fits the device budget and
    the ladder's plan peaks below it (the lever of the last resort: the recomputed layers' token-wise working set,
    when even the last rung does not fit); `larger_tiles_peak` (a retry after it): raise `KeepLargerTiles` where no
    rung fits and the peak is not below it. `last_rung_first` (such a retry): the last rung is partitioned first
    and, where it does not fit either, either raised at once (one partition, not the ladder's: its bisection
    already assumes no rung peaks below the last). `no_rung_fits` (the larger tiles lowered again after
    `KeepLargerTiles`: their last rung was found over the budget): the last rung is the plan, partitioned alone."""
    budget = budget_bytes if budget_bytes is not None else default_budget(joint_inputs)
    order = layer_order(joint_gm)
    trials: list[_Trial] = []
    partitions = 0
    # a rung's partition and each of its variants are the same whichever ladder asks (the time ranking re-walks
    # the ladder without host memory): made once per graph
    partitioned: dict[tuple[int, int, int], tuple[fx.GraphModule, fx.GraphModule]] = {}
    made: dict[tuple[tuple[int, int, int], str | None, str], _Trial] = {}

    def fits(t: _Trial) -> bool:
        host_ok = t.offload is None or host_budget_bytes is None or t.offload.nbytes <= host_budget_bytes
        return host_ok and (budget is None or t.peak <= budget)

    def variant(rung: tuple[int, int, int], fw: fx.GraphModule, bw: fx.GraphModule, scope: str | None,
                reload: str = "ahead") -> _Trial:
        """The rung with `scope`'s saved values in host memory (None: none), reloaded at `reload` (RELOAD_TIMES)."""
        if (rung, scope, reload) in made:
            trials.append(made[rung, scope, reload])
            return trials[-1]
        if scope is not None:
            fw, bw = copy_graph(fw), copy_graph(bw)  # the partition is reused by the next scope
        report = offload_boundaries(fw, bw, num_fwd_outputs, scope, reload) if scope else None
        peak, saved = estimated_peak(fw, bw, num_fwd_outputs)
        trials.append(_Trial(*rung, fw, bw, peak, saved, report, scope, reload if scope else None))
        made[rung, scope, reload] = trials[-1]
        return trials[-1]

    def reloaded_late(rung: tuple[int, int, int], fw: fx.GraphModule, bw: fx.GraphModule, t: _Trial) -> _Trial:
        """`t`, or where it moves saved values and does not fit, the same reloaded late if that peaks lower."""
        if fits(t) or t.scope is None:
            return t
        late = variant(rung, fw, bw, t.scope, "late")
        return late if late.peak < t.peak else t

    def trial(tokenwise: int, attention: int, collectives: int = 0, moves: str = offload) -> _Trial:
        """One rung: kept on the device, else (`moves` auto) its boundaries in host memory, else all its layers'
        saved values; the first that fits, or the last tried."""
        nonlocal partitions
        rung = (tokenwise, attention, collectives)
        if rung not in partitioned:
            gm = copy_graph(joint_gm)
            tag_rung(gm, order[:tokenwise], order[:attention], order[:collectives])
            with _use_lazy_graph_module(True):  # Python code made only for the graphs that run (the chosen rung's)
                partitioned[rung] = min_cut_rematerialization_partition(gm, joint_inputs,
                                                                        num_fwd_outputs=num_fwd_outputs, **kwargs)
            partitions += 1
        fw, bw = partitioned[rung]
        if moves == "activations":
            return reloaded_late(rung, fw, bw, variant(rung, fw, bw, "boundaries"))
        t = variant(rung, fw, bw, None)
        if moves != "auto":
            return t
        for scope in OFFLOAD_SCOPES:
            if fits(t):
                break
            moved = variant(rung, fw, bw, scope)
            if moved.offload.nbytes > (t.offload.nbytes if t.offload else 0):
                t = moved
        return reloaded_late(rung, fw, bw, t)

    def smallest_fitting(make: Any, count: int) -> _Trial | None:
        """The smallest k = 1..count whose make(k) fits (make(0), a rung already made, does not)."""
        return smallest_fitting_rung(make, count, fits, budget)

    n = len(order)
    forward = forward_nodes(joint_gm.graph)
    layers_of = assign_layers(joint_gm.graph, forward)
    # the last rungs re-run collectives: only where a layer has some (a single-process graph has none)
    c = n if any(is_collective_value(node) and layers_of.get(node) is not None for node in forward) else 0

    def halve_or_keep(peak: int) -> None:
        if budget is not None and budget < peak and larger_tiles_peak is not None and peak >= larger_tiles_peak:
            raise KeepLargerTiles(f"estimated peak {peak} bytes, the larger tiles' {larger_tiles_peak}")
        if smaller_tiles_below is not None and budget is not None and budget < peak < smaller_tiles_below:
            raise TileSmaller(peak, budget)

    if last_rung_first and n and (smaller_tiles_below is not None or larger_tiles_peak is not None):
        halve_or_keep(trial(n, n, c).peak)

    def ladder(moves: str) -> _Trial:
        """The first rung that fits (`moves`: the offload mode its rungs use), else the last."""
        if tile_first and (over := _over_any_budget(joint_gm, budget)) is not None:
            raise TileFirst(f"{over.name} alone is {node_nbytes(over)} bytes, over the budget of {budget}")
        chosen = trial(0, 0, moves=moves)
        if tile_first and not fits(trials[0]):
            raise TileFirst(f"estimated peak {trials[0].peak} bytes over the budget of {budget}")
        if not fits(chosen) and n:
            chosen = (smallest_fitting(lambda k: trial(k, 0, moves=moves), n)
                      or smallest_fitting(lambda k: trial(n, k, moves=moves), n)
                      or (smallest_fitting(lambda k: trial(n, n, k, moves=moves), c) if c else None)
                      or trial(n, n, c, moves=moves))
        return chosen

    chosen = trial(n, n, c) if no_rung_fits and n else ladder(offload)  # the ladder's plan where no rung fits
    halve_or_keep(chosen.peak)
    chosen, ranking = _ranked_by_time(chosen, lambda: ladder("off"), fits, joint_gm, joint_inputs, offload)
    plan = Plan(budget_bytes=budget, host_budget_bytes=host_budget_bytes, estimated_peak_bytes=chosen.peak,
                saved_activation_bytes=chosen.saved, layers=n, tokenwise_recompute_layers=chosen.tokenwise,
                attention_recompute_layers=chosen.attention, collective_recompute_layers=chosen.collectives,
                recompute_flops=recompute_flops(chosen.bw_module),
                offloaded_bytes=chosen.offload.nbytes if chosen.offload else 0, offload_scope=chosen.scope,
                reload=chosen.reload,
                fits=fits(chosen), partitions_tried=partitions)
    return chosen.fw_module, chosen.bw_module, {**plan.to_dict(), **ranking}, chosen.offload


def _over_any_budget(joint_gm: fx.GraphModule, budget: int | None) -> fx.Node | None:
    """A forward op whose output alone is over `budget`, or None: no partition of the graph fits then (the replay
    books every value a partition computes, in forward or recomputed in backward), so `tile_first` need not
    partition the untiled graph to know it does not fit."""
    if budget is None:
        return None
    return next((node for node in forward_nodes(joint_gm.graph) if node.op == "call_function" and not is_view(node)
                 and isinstance(node.meta.get("val"), torch.Tensor) and node_nbytes(node) > budget), None)


def _ranked_by_time(chosen: _Trial, recompute_only: Any, fits: Any, joint_gm: fx.GraphModule,
                    joint_inputs: Sequence[Any], offload: str) -> tuple[_Trial, dict[str, Any]]:
    """The ladder's plan, or the plan that recomputes instead of moving saved values to host memory where the time
    model (`time_rank`) predicts it faster; with the predicted added seconds of both for the record. Where the
    ladder's copies hide entirely, the recompute-only ladder is not walked (its partitions are a third of a long
    probe's planning: docs/measurements/2026-12-06-planning-time.md): it fits only on a later rung, which recomputes
    at least what the ladder's does, so it cannot be faster. Nor where the ladder's plan does not fit: a rung without
    host memory is the variant the ladder tried first at that rung, so none of them fits either."""
    from autosp.compiler.memory.time_rank import added_seconds, current_rates, exposed_copy_seconds

    rates = current_rates({t.device for t in _flat_tensors(joint_inputs)})
    if rates is None:
        return chosen, {"ranked_by": "ladder (no device rates)"}
    forward = sum(node_flops(node) for node in forward_nodes(joint_gm.graph) if node.op == "call_function")

    def cost(t: _Trial) -> float:
        return added_seconds(recompute_flops(t.bw_module), t.offload.nbytes if t.offload else 0, forward, rates)

    ladder = chosen
    if (offload == "auto" and fits(chosen) and chosen.offload is not None and chosen.offload.nbytes
            and exposed_copy_seconds(chosen.offload.nbytes, forward, rates) > 0):
        alternative = recompute_only()
        if fits(alternative) and cost(alternative) < cost(chosen):
            chosen = alternative
    return chosen, {"ranked_by": f"predicted time on {rates.name}", "predicted_added_s": cost(chosen),
                    "ladder_added_s": cost(ladder),
                    "ladder_plan": {"tokenwise": ladder.tokenwise, "attention": ladder.attention,
                                    "collectives": ladder.collectives,
                                    "offloaded_bytes": ladder.offload.nbytes if ladder.offload else 0}}


# ------------------------------------------------------------------------------------------- cost model


def live_at_peak(gm: fx.GraphModule, counted_inputs: set[str],
                 storages: dict[str, tuple[str, int]] | None = None) -> tuple[int, list[fx.Node]]:
    """(peak of the bytes alive while `gm` runs node by node, the values holding them at that moment; see the
    module doc): placeholders count only when named in `counted_inputs`; outputs are never freed. While a node
    runs, the scratch its op declares (``autosp.comm.transients``) and a multi-output op's outputs are alive
    too: the peak minus the values' bytes is those bytes (booked as the running op's). `storages` (backward's
    saved inputs, `saved_storages`): the placeholders of one storage are one value of its bytes, alive until the
    last of them dies (the first of them holds it)."""
    storages = storages or {}
    nodes = list(gm.graph.nodes)
    owners: dict[fx.Node, fx.Node] = {}
    holder: dict[str, fx.Node] = {}  # a storage's key -> the placeholder booked with it
    last_use: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        shared = node.op == "placeholder" and node.name in storages
        owners[node] = holder.setdefault(storages[node.name][0], node) if shared else view_owner(node, owners)
        for arg in node.all_input_nodes:
            last_use[owners[arg]] = len(nodes) if node.op == "output" else i
    frees: dict[int, list[fx.Node]] = {}
    for owner, i in last_use.items():
        frees.setdefault(i, []).append(owner)
    size = {n: held_bytes(n, storages) for n in nodes
            if owners[n] is n and not _on_host(n) and (n.op != "placeholder" or n.name in counted_inputs)}
    alive = {n for n in nodes if n.op == "placeholder" and size.get(n)}
    live = sum(size[n] for n in alive)
    peak, at_peak = live, set(alive)
    for i, node in enumerate(nodes):
        if node.op != "placeholder" and size.get(node):
            alive.add(node)
            live += size[node]
        if live + (scratch := _running_bytes(node)) > peak:
            peak, at_peak = live + scratch, set(alive)
        for owner in frees.get(i, ()):
            if owner in alive:
                alive.discard(owner)
                live -= size[owner]
    return peak, [n for n in nodes if n in at_peak]


def held_bytes(node: fx.Node, storages: dict[str, tuple[str, int]]) -> int:
    """Bytes `node` holds in the replay: a saved input of backward its storage's (`saved_storages`), else its own."""
    return storages[node.name][1] if node.op == "placeholder" and node.name in storages else node_nbytes(node)


def _running_bytes(node: fx.Node) -> int:
    """Bytes alive only while `node` runs: its op's declared scratch, and for a multi-output op all its outputs
    (allocated by the op; the replay books each again at the getitem that takes it, and frees unused ones)."""
    val = node.meta.get("val")
    allocates = isinstance(val, (tuple, list)) and not is_view(node)  # a split's pieces are views of its input
    outputs = sum(nbytes(v) for v in val if isinstance(v, torch.Tensor)) if allocates else 0
    return transient_bytes(node) + outputs


def estimated_peak(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> tuple[int, int]:
    """(estimated peak bytes of forward + backward beyond the graph inputs, saved activation bytes on the device,
    each storage once)."""
    storages = device_saved_storages(fw, num_fwd_outputs)
    saved = sum(dict(storages.values()).values())
    backward = live_at_peak(bw, backward_inputs(fw, bw, num_fwd_outputs), storages)[0]
    return max(live_at_peak(fw, set())[0], backward), saved


def device_saved_storages(fw: fx.GraphModule, num_fwd_outputs: int) -> dict[str, tuple[str, int]]:
    """`saved_storages` of the values forward computes and keeps on the device for backward."""
    return saved_storages(fw, [n for n in saved_values(fw, num_fwd_outputs) if n.op != "placeholder"
                               and not _on_host(n)])


def _on_host(node: fx.Node) -> bool:
    """A value in host memory: an offload's output (`autosp.compiler.memory.offload`), or backward's input of it; a
    gradient streamed to host memory (`autosp.comm.host_params`)."""
    return node.target in (OFFLOAD_OP, GRADIENT_TO_HOST_OP) or (
        node.op == "placeholder" and any(u.target is RELOAD_OP for u in node.users))


def backward_inputs(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> set[str]:
    """Names of the backward graph's inputs that are this step's device memory: saved activations (not those
    waiting in host memory) and tangents."""
    host = {n.name for n in bw.graph.nodes if _on_host(n)}
    activations = {n.name for n in saved_values(fw, num_fwd_outputs) if n.op != "placeholder"} - host
    return activations | {n.name for n in bw.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
