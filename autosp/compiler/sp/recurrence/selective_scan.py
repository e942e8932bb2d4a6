"""Mamba1's selective scan (Jamba, Mamba) along the sharded sequence: each rank scans its shard from a zero state, the
ranks pass the states along (`states`), and each corrects its outputs with the state entering its shard. Exact.

Per channel d and state entry n the update h_t = exp(dt_t A_dn) h_{t-1} + dt_t B_t x_t is affine in the state with a
scalar decay, so a shard maps its incoming state h_in [B, D, N] to a h_in + U, with a = exp(A_dn * sum over the shard
of dt) and U the shard's zero-state final state, and the output at t gains (sum_n C_tn exp(A_dn * sum of dt_s for
s <= t in the shard) h_in,dn) times the gate silu(z_t). dt is the kernel's own (dt + delta_bias, softplus),
recomputed from the op's inputs. The correction's decays are [B, D, N, L] per rank, the size of the kernel's own
discretised A; backward is autograd through the same ops.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.comm.library import op
from autosp.compiler.sp.recurrence.shards import replace_corrected, shard_spec, step_sizes, zero_state_scan
from autosp.compiler.sp.recurrence.states import incoming_state
from autosp.compiler.sp.spec import SPContext


def is_selective_scan(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (op("selective_scan").default, op("selective_scan"))


def rewrite(ctx: SPContext, node: fx.Node) -> None:
    """Replace `node` (the `selective_scan` op on this rank's shard) with the scan, exchange and correction."""
    x, dt, A, B, C, D, z, delta_bias, softplus, _, _, _ = node.args
    spec = shard_spec(ctx, node, 2, tuple(t for t in (x, dt, B, C, z) if t is not None), (A, D, delta_bias),
                      "the selective scan's inputs are not sharded along the sequence (dim 2 of x, dt, B, C, z) in "
                      "rank order with A, D, delta_bias per channel")
    emit = ctx.emit
    out, own = zero_state_scan(ctx, node, "selective_scan_with_state", spec)
    step = step_sizes(ctx, node, dt, delta_bias, softplus, channel_dim=1)  # [B, D, L]
    elapsed = emit(node, "unsqueeze", (emit(node, torch.cumsum, (step, 2)), 2))  # [B, D, 1, L]
    rates = emit(node, "unsqueeze", (emit(node, "float", (A,)), -1))  # [D, N, 1]
    decay = emit(node, torch.exp, (emit(node, torch.mul, (rates, elapsed)),))  # [B, D, N, L]
    shard_decay = emit(node, "select", (decay, 3, -1))
    incoming = incoming_state(ctx, node, own, lambda state: emit(node, torch.mul, (shard_decay, state)))
    correction = emit(node, torch.einsum, ("bdnl,bnl,bdn->bdl", decay, emit(node, "float", (C,)), incoming))
    if z is not None:
        correction = emit(node, torch.mul, (correction, emit(node, F.silu, (emit(node, "float", (z,)),))))
    replace_corrected(ctx, node, out, correction, spec)
