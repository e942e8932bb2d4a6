"""Mamba2's selective scan (SSD) along the sharded sequence: each rank scans its shard from a zero state, the ranks
pass the states along (`states`), and each corrects its outputs with the state entering its shard. Exact.

Per head the state update h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T is affine in the state with a scalar decay, so
a shard maps its incoming state h_in to a h_in + U, where a = exp(sum over the shard of dt_t A) and U is the shard's
final state from a zero state, and the output at t gains C_t . (exp(sum of dt_s A for s <= t in the shard) h_in).
dt here is the kernel's own (dt + dt_bias, softplus, clamped to the layer's limits), recomputed from the op's inputs.
Cost per rank: the scan as single-process runs it on the shard, P-1 exchanges of a [B, H, P, N] fp32 state and the
correction (an einsum over the shard); backward is autograd through the same ops.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.comm.library import op
from autosp.compiler.sp.recurrence.states import incoming_state
from autosp.compiler.sp.spec import SPContext, canonical_spec, node_label
from autosp.errors import SequenceParallelError


def is_ssd_scan(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (op("ssd_scan").default, op("ssd_scan"))


def rewrite(ctx: SPContext, node: fx.Node) -> None:
    """Replace `node` (the `ssd_scan` op on this rank's shard) with the scan, exchange and correction."""
    x, dt, A, B, C, D, dt_bias, chunk_size, softplus, dt_min, dt_max, module = node.args
    spec = ctx.specs.get(x)
    expected = None if spec is None else canonical_spec(1, spec.global_len, ctx.sp_rank, ctx.sp_size)
    sharded_along_1 = all(ctx.specs.get(t) == expected for t in (x, dt, B, C)) and expected is not None
    if not sharded_along_1 or any(ctx.is_local(t) for t in (A, D, dt_bias) if t is not None):
        raise SequenceParallelError(
            f"{node_label(node)}: the SSD scan's inputs are not sharded along the sequence (dim 1 of x, dt, B, C) in "
            "rank order with A, D, dt_bias per head; train this model without sequence parallelism")
    heads, groups = ctx.current[x].shape[2], ctx.current[B].shape[2]
    emit = ctx.emit
    scan = emit(node, op("ssd_scan_with_state").default, node.args)
    out = emit(node, operator.getitem, (scan, 0), spec=spec)
    own = emit(node, operator.getitem, (scan, 1))
    # the kernel's step sizes and each position's decay since the shard's start, log exp(sum dt_s A)
    step = emit(node, "float", (dt,))
    if dt_bias is not None:
        step = emit(node, torch.add, (step, emit(node, "float", (dt_bias,))))
    if softplus:
        step = emit(node, F.softplus, (step,))
    step = emit(node, torch.clamp, (step, dt_min, dt_max))
    log_decay = emit(node, torch.cumsum, (emit(node, torch.mul, (step, emit(node, "float", (A,)))), 1))
    decay = emit(node, torch.exp, (log_decay,))  # [B, L, H]
    shard_decay = emit(node, "unsqueeze", (emit(node, "unsqueeze", (emit(node, "select", (decay, 1, -1)), -1)), -1))
    incoming = incoming_state(ctx, node, own, lambda state: emit(node, torch.mul, (shard_decay, state)))
    readout = emit(node, "float", (C,))
    if heads != groups:
        readout = emit(node, "repeat_interleave", (readout, heads // groups), {"dim": 2, "output_size": heads})
    correction = emit(node, torch.einsum, ("blh,blhn,bhpn->blhp", decay, readout, incoming))
    result = emit(node, torch.add, (out, emit(node, "to", (correction, ctx.current[out].dtype))), spec=spec)
    node.replace_all_uses_with(result)
    ctx.graph.erase_node(node)  # the walk is at this node: it never visits it again
