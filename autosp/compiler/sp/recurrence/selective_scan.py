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

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.comm.library import op
from autosp.compiler.sp.recurrence.states import incoming_state
from autosp.compiler.sp.spec import SPContext, canonical_spec, node_label
from autosp.errors import SequenceParallelError


def is_selective_scan(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (op("selective_scan").default, op("selective_scan"))


def rewrite(ctx: SPContext, node: fx.Node) -> None:
    """Replace `node` (the `selective_scan` op on this rank's shard) with the scan, exchange and correction."""
    x, dt, A, B, C, D, z, delta_bias, softplus, _, _, _ = node.args
    spec = ctx.specs.get(x)
    expected = None if spec is None else canonical_spec(2, spec.global_len, ctx.sp_rank, ctx.sp_size)
    sequences = [t for t in (x, dt, B, C, z) if t is not None]
    if expected is None or any(ctx.specs.get(t) != expected for t in sequences) or \
            any(ctx.is_local(t) for t in (A, D, delta_bias) if t is not None):
        raise SequenceParallelError(
            f"{node_label(node)}: the selective scan's inputs are not sharded along the sequence (dim 2 of x, dt, B, "
            "C, z) in rank order with A, D, delta_bias per channel; train this model without sequence parallelism")
    emit = ctx.emit
    scan = emit(node, op("selective_scan_with_state").default, node.args)
    out = emit(node, operator.getitem, (scan, 0), spec=spec)
    own = emit(node, operator.getitem, (scan, 1))
    step = emit(node, "float", (dt,))
    if delta_bias is not None:
        step = emit(node, torch.add, (step, emit(node, "unsqueeze", (emit(node, "float", (delta_bias,)), -1))))
    if softplus:
        step = emit(node, F.softplus, (step,))
    elapsed = emit(node, "unsqueeze", (emit(node, torch.cumsum, (step, 2)), 2))  # [B, D, 1, L]
    rates = emit(node, "unsqueeze", (emit(node, "float", (A,)), -1))  # [D, N, 1]
    decay = emit(node, torch.exp, (emit(node, torch.mul, (rates, elapsed)),))  # [B, D, N, L]
    shard_decay = emit(node, "select", (decay, 3, -1))
    incoming = incoming_state(ctx, node, own, lambda state: emit(node, torch.mul, (shard_decay, state)))
    correction = emit(node, torch.einsum, ("bdnl,bnl,bdn->bdl", decay, emit(node, "float", (C,)), incoming))
    if z is not None:
        correction = emit(node, torch.mul, (correction, emit(node, F.silu, (emit(node, "float", (z,)),))))
    result = emit(node, torch.add, (out, emit(node, "to", (correction, ctx.current[out].dtype))), spec=spec)
    node.replace_all_uses_with(result)
    ctx.graph.erase_node(node)  # the walk is at this node: it never visits it again
