"""`StepClock`: each op the tracker sees in the measured step, recorded for the time model (`autosp.timing`) in an
`OpTrace` that any device's rates price (`OpTrace.time`).

An executed aten (or autosp_sp::, c10d) op is one of:

- a matmul (mm, addmm, bmm, baddbmm, _scaled_mm): 2·m·k·n FLOPs of its local operands at the matmul rate;
- attention (an SDPA/flash/efficient kernel, forward or backward; autosp_sp::ring_attention): 4·B·H·Sq·Sk·D FLOPs
  forward (QK^T and PV), half the key pairs under a causal mask, 2.5x that for a backward kernel (FlashAttention-2's
  five matmuls to the forward's two), at the attention rate of its key length (`DeviceRates.attention_seconds`); the
  ring's K/V passes run beside it;
- a collective (autosp_sp::all_to_all & co., _c10d_functional, c10d, DeepSpeed's Ulysses all-to-all
  deepspeed::dim_zero_all_to_all): its ring volume over the group at the link the group spans
  (`DeviceRates.collective_seconds`), on the communication stream, plus the wait for the slower rank, which grows
  with the rank's work since its previous collective (`DeviceRates.rank_wait_seconds`; 0 on the GPU rows);
- an exchange with the neighbouring rank (autosp_sp::from_previous_rank / to_previous_rank: a causal convolution's
  halo, a recurrence's state passed along the ranks): an all-gather of every rank's tensor, as it is implemented;
- an opaque kernel that declares its cost (`autosp.comm.costs`: a recurrence's chunked scan): the FLOPs at the matmul
  rate, or the bytes at the HBM rate, it declares;
- a host copy: an op between device and host storages (the tracker's host set: autosp_sp::offload, the reloads,
  DeepSpeed's and autosp's host optimizer buffers) costs its bytes at the host link, on the copy stream;
- host work: an op on host storages only (the host optimizer step) costs its bytes at the host's memory rate;
- a call of DeepSpeed ZeRO-3's parameter coordinator (`zero3_hooks`, told by the simulator's DeepSpeed adapter: a
  module's hook fetching or releasing its parameters, in forward and backward): its host work costs the rates'
  ZeRO-3 hook seconds; the gathers it starts are collectives as above;
- everything else is memory-bound: the bytes it reads and writes at the HBM rate. Views and empty allocations are
  free, and so is an op that makes and writes no tensor (prim.device); an op whose outputs are its inputs' storages
  and that writes nothing in place (aten._unsafe_view, a view its schema does not mark) costs its overhead only; a
  wait (autosp_sp::wait, wait_tensor) costs nothing but makes the compute stream wait for its value.

Element-wise ops are costed one by one (no fusion: aot_eager's graphs, as the memory model runs them).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from autosp.comm.costs import declared_cost
from autosp.compiler.fx import unwrap_rng
from autosp.timing import DeviceRates, StepTime, Timeline

MATMULS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2), "_scaled_mm": (0, 1)}
#: attention kernels whose q/k are [B, S, H, D] (the others' are [B, H, S, D])
SEQUENCE_MAJOR = ("_flash_attention", "_efficient_attention")
ATTENTION_MARKS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
#: a backward attention kernel's FLOPs per forward FLOP (FlashAttention-2: dQ, dK, dV, dP and the recomputed P)
ATTENTION_BACKWARD_FACTOR = 2.5
COLLECTIVE_KINDS = (("all_to_all", "all_to_all"), ("alltoall", "all_to_all"), ("reduce_scatter", "reduce_scatter"),
                    ("gather", "all_gather"), ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
                    ("broadcast", "broadcast"))
WAITS = ("wait_tensor", "autosp_sp::wait")
NEIGHBOUR_EXCHANGES = ("autosp_sp::from_previous_rank", "autosp_sp::to_previous_rank")
FREE = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "barrier")


@dataclass
class OpTrace:
    """The measured step's ops as the time model needs them, device-independent (FLOPs, bytes, collectives, the
    values read and written): priced on any device's rates by `time`, so a simulated length serves every device
    type that shares its memory program (`extrapolate.predict_peak`'s cache)."""

    # (op class, quantity, collective kind, group, reads, writes, an attention kernel's key length)
    events: list[tuple] = field(default_factory=list)

    def add(self, op_class: str, quantity: float, reads: Any = (), writes: Any = (), kind: str = "",
            group: int = 1, keys: int = 0) -> None:
        self.events.append((op_class, quantity, kind, group, tuple(reads), tuple(writes), keys))

    def time(self, rates: DeviceRates, gpus_per_node: int) -> StepTime:
        """The step on `rates`' device (`Timeline`)."""
        timeline = Timeline(rates.streams)
        work = 0.0  # this rank's seconds of work since its previous collective (`DeviceRates.rank_wait_seconds`)
        price = {"matmul": rates.matmul_seconds, "memory": rates.memory_seconds,
                 "copy": rates.copy_seconds, "host": rates.host_seconds,
                 "zero3_hooks": rates.zero3_hook_seconds}
        for op_class, quantity, kind, group, reads, writes, keys in self.events:
            if op_class == "collective":
                seconds = rates.collective_seconds(kind, quantity, group, gpus_per_node)
                if group > 1:  # the collective waits for the slower rank's share of the work before it
                    seconds, work = seconds + rates.rank_wait_seconds(work), 0.0
            elif op_class == "attention":
                seconds = rates.attention_seconds(quantity, keys)
            else:
                seconds = price[op_class](quantity)
            overhead = 0.0 if op_class == "zero3_hooks" else rates.op_overhead_s  # no op (its gathers are ops)
            timeline.run(op_class, seconds + overhead, reads, writes,
                         quantity if op_class in ("matmul", "attention") else 0.0)
            if op_class != "collective":
                work += seconds + overhead
        return timeline.finish()


@dataclass
class LinedTrace:
    """A step at `more` layers past `high`'s depth, `low` one layer fewer than `high` (`StepTime.line`)."""

    low: OpTrace | LinedTrace
    high: OpTrace | LinedTrace
    more: int

    def time(self, rates: DeviceRates, gpus_per_node: int) -> StepTime:
        return self.low.time(rates, gpus_per_node).line(self.high.time(rates, gpus_per_node), self.more)


class StepClock:
    """Records each op of the measured step into an `OpTrace` (module docstring says how each is counted)."""

    def __init__(self) -> None:
        self.trace = OpTrace()

    def op(self, func: Any, args: tuple, kwargs: dict, out: Any, serial: Any, host: set[int]) -> None:
        """Record one executed op; `serial(t)` is a tensor's storage id, `host` the ids of host storages."""
        func, args = unwrap_rng(func, args)  # a recomputed attention runs inside one: priced as attention
        name = _name(func)
        if name.split("::")[-1].split(".")[0] in FREE or getattr(func, "is_view", False):
            return
        ins = list(_tensors((args, kwargs)))
        outs = list(_tensors(out))
        reads = {serial(t) for t in ins}
        mutated = {serial(t) for t in _mutated(func, args, kwargs)}
        writes = {serial(t) for t in outs} | mutated
        trace = self.trace
        if any(mark in name for mark in WAITS):
            trace.add("memory", 0.0, reads, writes)
            return
        if name in NEIGHBOUR_EXCHANGES:  # every rank's tensor gathered (autosp.comm.neighbours)
            group = _group_size(func, args, kwargs)
            trace.add("collective", group * sum(map(_nbytes, ins)), reads, writes | reads, "all_gather", group)
            return
        if kind := _collective_kind(name):
            nbytes = max([sum(_nbytes(t) for t in _tensors(a)) for a in args] + [sum(map(_nbytes, outs))])
            trace.add("collective", nbytes, reads, writes | reads, kind, _group_size(func, args, kwargs))
            return
        if not writes:  # metadata (prim.device, a scalar read): nothing made, nothing written
            return
        if "ring_attention" in name:
            self._ring_attention(func, args, kwargs, reads, writes)
            return
        if attention := _attention_flops(func, name, args, kwargs):
            trace.add("attention", attention[0], reads, writes, keys=attention[1])
            return
        if cost := declared_cost(func, args, kwargs):
            trace.add(cost[0], cost[1], reads, writes)
            return
        if (operands := MATMULS.get(name.split("::")[-1].split(".")[0])) and len(ins) > max(operands):
            a, b = (t for i, t in enumerate(_positional_tensors(args)) if i in operands)
            trace.add("matmul", 2.0 * a.numel() * b.shape[-1], reads, writes)
            return
        in_host = reads & host
        out_host = writes & host
        device_in = sum(_nbytes(t) for t in ins if serial(t) not in host)
        if out_host and device_in:  # device -> host
            trace.add("copy", device_in, reads, writes)
        elif in_host and not out_host:  # host -> device
            trace.add("copy", sum(_nbytes(t) for t in ins if serial(t) in host), reads, writes)
        else:
            fresh = [t for t in outs if serial(t) not in reads]
            if not fresh and not mutated:  # every output is an input's storage (aten._unsafe_view): no bytes move
                trace.add("memory", 0.0, reads, writes)
                return
            nbytes = sum(map(_nbytes, ins)) + sum(map(_nbytes, fresh))
            trace.add("host" if out_host else "memory", nbytes, reads, writes)

    def zero3_hooks(self, calls: int) -> None:
        """DeepSpeed ZeRO-3's parameter coordinator was called `calls` times (the gathers it starts are recorded as
        ops)."""
        self.trace.add("zero3_hooks", calls)

    def _ring_attention(self, func: Any, args: tuple, kwargs: dict, reads: set, writes: set) -> None:
        """Attention over the whole ring's keys, the K/V blocks passed around it beside the compute: each rank
        receives the other ranks' K/V (a broadcast's volume of (group - 1) blocks)."""
        named = _bound(func, args, kwargs)
        q, k, v = named["q"], named["k"], named["v"]
        group = _group_size(func, args, kwargs)
        pairs = q.shape[-2] * k.shape[-2] * group * (0.5 if named.get("causal") else 1.0)
        flops = 4.0 * q.shape[0] * q.shape[1] * pairs * q.shape[-1]
        if "backward" in _name(func):
            flops *= ATTENTION_BACKWARD_FACTOR
        token = ("ring", len(self.trace.events))
        self.trace.add("collective", (_nbytes(k) + _nbytes(v)) * (group - 1), reads, {token}, "broadcast", group)
        self.trace.add("attention", flops, reads, (), keys=k.shape[-2] * group)
        self.trace.add("memory", 0.0, {token}, writes)


def _name(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else str(func)


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    for value in tree_flatten(tree)[0]:
        if isinstance(value, torch.Tensor):
            yield getattr(value, "_local_tensor", value)  # a DTensor's local shard is what this rank moves


def _positional_tensors(args: tuple) -> list[torch.Tensor]:
    return [getattr(a, "_local_tensor", a) for a in args if isinstance(a, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes an op moves for `t`: its elements, at most its storage (an expanded view reads its storage once)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _bound(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _mutated(func: Any, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors an in-place op writes (its schema's `Tensor(a!)` arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return
    named = _bound(func, args, kwargs)
    for argument in schema.arguments:
        if argument.alias_info is not None and argument.alias_info.is_write:
            yield from _tensors(named.get(argument.name))


def _collective_kind(name: str) -> str | None:
    if not name.startswith(("c10d::", "_c10d_functional::", "autosp_sp::", "deepspeed::")):
        return None
    op = name.split("::")[1]
    return next((kind for mark, kind in COLLECTIVE_KINDS if mark in op), None)


def _group_size(func: Any, args: tuple, kwargs: dict) -> int:
    """The collective's group: its `group_size` argument, its process group object, or its group's name."""
    named = _bound(func, args, kwargs)
    if isinstance(named.get("group_size"), int):
        return named["group_size"]
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.ScriptObject) and hasattr(value, "size"):
            return value.size()
    name = named.get("group_name")
    if isinstance(name, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name).size()
    return dist.get_world_size()


def _attention_flops(func: Any, name: str, args: tuple, kwargs: dict) -> tuple[float, int] | None:
    """FLOPs of an attention kernel (module docstring) and its key length; None for any other op."""
    if not any(mark in name for mark in ATTENTION_MARKS):
        return None
    named = _bound(func, args, kwargs)
    q, k = named.get("query", named.get("q")), named.get("key", named.get("k"))
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return None
    keys = k.shape[1] if name.split("::")[-1].startswith(SEQUENCE_MAJOR) else k.shape[-2]
    queries = q.shape[1] if name.split("::")[-1].startswith(SEQUENCE_MAJOR) else q.shape[-2]
    causal = bool(named.get("is_causal", named.get("causal", False)))
    pairs = queries * keys * ((keys + 1) / (2 * keys) if causal and queries == keys else 1.0)
    flops = 4.0 * q.numel() / queries * pairs
    return flops * (ATTENTION_BACKWARD_FACTOR if "backward" in name else 1.0), keys
