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

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler.sp.recurrence.shards import replace_corrected, shard_spec, step_sizes, zero_state_scan
from autosp.compiler.sp.recurrence.states import incoming_state
from autosp.compiler.sp.spec import SPContext


def is_ssd_scan(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (op("ssd_scan").default, op("ssd_scan"))


def rewrite(ctx: SPContext, node: fx.Node) -> None:
    """Replace `node` (the `ssd_scan` op on this rank's shard) with the scan, exchange and correction."""
    x, dt, A, B, C, D, dt_bias, _, softplus, dt_min, dt_max, _, _ = node.args
    spec = shard_spec(ctx, node, 1, (x, dt, B, C), (A, D, dt_bias),
                      "the SSD scan's inputs are not sharded along the sequence (dim 1 of x, dt, B, C) in rank order "
                      "with A, D, dt_bias per head")
    heads, groups = ctx.current[x].shape[2], ctx.current[B].shape[2]
    emit = ctx.emit
    out, own = zero_state_scan(ctx, node, "ssd_scan_with_state", spec)
    # the kernel's step sizes and each position's decay since the shard's start, log exp(sum dt_s A)
    step = emit(node, torch.clamp, (step_sizes(ctx, node, dt, dt_bias, softplus, channel_dim=2), dt_min, dt_max))
    log_decay = emit(node, torch.cumsum, (emit(node, torch.mul, (step, emit(node, "float", (A,)))), 1))
    decay = emit(node, torch.exp, (log_decay,))  # [B, L, H]
    shard_decay = emit(node, "unsqueeze", (emit(node, "unsqueeze", (emit(node, "select", (decay, 1, -1)), -1)), -1))
    incoming = incoming_state(ctx, node, own, lambda state: emit(node, torch.mul, (shard_decay, state)))
    readout = emit(node, "float", (C,))
    if heads != groups:
        readout = emit(node, "repeat_interleave", (readout, heads // groups), {"dim": 2, "output_size": heads})
    replace_corrected(ctx, node, out, emit(node, torch.einsum, ("blh,blhn,bhpn->blhp", decay, readout, incoming)),
                      spec)
