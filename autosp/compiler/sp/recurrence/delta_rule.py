"""The gated delta rule along the sharded sequence: each rank scans its shard, the ranks exchange one
(transition, final state) pair each, and each corrects its outputs with the state entering its shard. Exact.

The rule's state update is affine in the state: S_t = A_t S_{t-1} + k_t (beta_t v_t)^T with A_t = e^{g_t}
(I - beta_t k_t k_t^T) acting on S's rows, and each column of S (one value channel) evolves on its own. So a shard
maps its incoming state S_in to A S_in + U, and its output at t is q_t^T (A_{..t} S_in + U_t) read through the
kernel. One scan from the initial state [I | 0] with values [0 | v] (dk extra value channels) gives both halves at
once: final state [A | U] and output [p_t | o_t], where p_t = (A_{..t}^T q_t)^T and o_t the zero-state output.
The states pass along the ranks (`states`: P-1 rounds of `from_previous_rank`), so rank r receives S_in, the
composition of the earlier ranks' pairs in rank order, and its output is o_t + p_t S_in. Backward is autograd
through the same ops (the exchange's is `to_previous_rank`). Only the small state exchange is sequential; the
scans run in parallel. Kimi delta attention has a per-channel decay, A_t = diag(e^{g_t}) (I - beta_t k_t k_t^T):
still affine in the state with each value channel on its own, so the same rewrite (`kernel` names HF's kernel).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler.sp.recurrence.shards import replace_corrected, shard_spec
from autosp.compiler.sp.recurrence.states import incoming_state
from autosp.compiler.sp.spec import SPContext


def is_gated_delta_rule(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (op("gated_delta_rule").default, op("gated_delta_rule"))


def rewrite(ctx: SPContext, node: fx.Node) -> None:
    """Replace `node` (the `gated_delta_rule` op on this rank's shard) with the scan, exchange and correction."""
    q, k, v, g, beta, chunk_size, l2norm, module, tile_tokens = node.args
    spec = shard_spec(ctx, node, 1, (q, k, v, g, beta), (),
                      "the gated delta rule's inputs are not all sharded along the sequence (dim 1) in rank order; "
                      "AutoSP shards it on [B, S, H, D] inputs")
    batch, _, heads, dv = ctx.current[v].shape
    dk = ctx.current[k].shape[-1]
    before = node
    emit = ctx.emit
    probe_v = emit(before, torch.cat, ([emit(before, "new_zeros", (v, (batch, spec.length, heads, dk))), v], -1))
    eye = emit(before, torch.eye, (dk,), {"dtype": torch.float32, "device": ctx.current[v].device})
    identity = emit(before, "expand", (eye, batch, heads, dk, dk))
    zeros = emit(before, torch.zeros, ((batch, heads, dk, dv),),
                 {"dtype": torch.float32, "device": ctx.current[v].device})
    initial = emit(before, torch.cat, ([identity, zeros], -1))
    scan = emit(before, op("gated_delta_rule_from").default, (q, k, probe_v, g, beta, initial, chunk_size, l2norm,
                                                              module, tile_tokens))
    out = emit(before, operator.getitem, (scan, 0))
    final = emit(before, operator.getitem, (scan, 1))
    transition = emit(before, "narrow", (final, -1, 0, dk))
    own = emit(before, "narrow", (final, -1, dk, dv))
    incoming = incoming_state(ctx, before, own, lambda state: emit(before, torch.matmul, (transition, state)))
    zero_state_out = emit(before, "narrow", (out, -1, dk, dv), spec=spec)
    readout = emit(before, "float", (emit(before, "narrow", (out, -1, 0, dk)),))  # the state is fp32 (bf16 models)
    replace_corrected(ctx, node, zero_state_out, emit(before, torch.einsum, ("blhk,bhkv->blhv", readout, incoming)),
                      spec)
