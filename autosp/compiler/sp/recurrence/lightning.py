"""Lightning attention (MiniMax) along the sharded sequence: each rank runs HF's block loop on its shard from a zero
state, the ranks pass the states along (`states`), and each corrects its outputs with the state entering its shard.
Exact.

Per head with decay rate l the loop computes o_t = q_t S_t with S_t = e^{-l} S_{t-1} + k_t^T v_t (`lightning_op`),
affine in the state with a scalar decay: a shard of L positions from t0 maps its incoming state S_in (the state after
position t0 - 1) to e^{-l L} S_in + U, U its final state from a zero state, and its output at t gains
(q_t e^{-l (t - t0 + 1)}) S_in (the decay HF's loop gives a block's carried state, `query_decay`, counted from the
shard's start). Positions past the sequence (a padded last shard) come after every real one, so they change no real
output. The states are exchanged in fp32. Backward is autograd through the same ops.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler.sp.recurrence.shards import replace_corrected, shard_spec, zero_state_scan
from autosp.compiler.sp.recurrence.states import incoming_state
from autosp.compiler.sp.spec import SPContext, node_label
from autosp.errors import SequenceParallelError

_OPS = ("lightning_attention", "lightning_attention_with_state")


def is_lightning_attention(node: fx.Node) -> bool:
    """A call of either op (the one that also returns the final state is refused by `rewrite`)."""
    return node.op == "call_function" and any(node.target in (op(name).default, op(name)) for name in _OPS)


def drop_unread_states(gm: fx.GraphModule) -> None:
    """Each traced layer's `lightning_attention_with_state` whose final state nothing reads (HF's decoder layer drops
    it) becomes `lightning_attention`, its output alone. Run before the walk, which refuses a state that is read."""
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target == op("lightning_attention_with_state").default):
            continue
        if any(user.target is not operator.getitem for user in node.users):
            continue
        parts = {user.args[1]: user for user in node.users}
        if 1 in parts and parts[1].users:
            continue
        with gm.graph.inserting_before(node):
            output = gm.graph.call_function(op("lightning_attention").default, node.args)
        output.meta = {**node.meta, "example_value": node.meta["example_value"][0]}
        if 0 in parts:
            parts[0].replace_all_uses_with(output)
        for user in parts.values():
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)


def rewrite(ctx: SPContext, node: fx.Node) -> None:
    """Replace `node` (the `lightning_attention` op on this rank's shard) with the loop, exchange and correction."""
    if node.target != op("lightning_attention").default:
        raise SequenceParallelError(
            f"{node_label(node)}: lightning attention's final state is read (a cache or output_attentions), but on a "
            "rank it holds only the shard's: AutoSP shards lightning attention whose state nothing reads; train "
            "without the cache and output_attentions")
    q, k, v, slope_rate, _, _ = node.args
    spec = shard_spec(ctx, node, 2, (q, k, v), (slope_rate,),
                      "lightning attention's inputs are not sharded along the sequence (dim 2 of q, k, v) in rank "
                      "order with its decay rates per head")
    emit = ctx.emit
    out, own = zero_state_scan(ctx, node, "lightning_attention_with_state", spec)
    own = emit(node, "float", (own,))
    rates = emit(node, torch.neg, (emit(node, "float", (slope_rate,)),))  # -l, [H, 1, 1]
    positions = emit(node, torch.arange, (1, spec.length + 1),
                     {"dtype": torch.float32, "device": ctx.current[v].device})
    decay = emit(node, torch.exp, (emit(node, torch.mul, (rates, emit(node, "unsqueeze", (positions, -1)))),))
    shard_decay = emit(node, torch.exp, (emit(node, torch.mul, (rates, spec.length)),))  # e^{-l L}, [H, 1, 1]
    incoming = incoming_state(ctx, node, own, lambda state: emit(node, torch.mul, (shard_decay, state)))
    decayed_q = emit(node, torch.mul, (emit(node, "float", (q,)), decay))  # q_t e^{-l (t - t0 + 1)}
    replace_corrected(ctx, node, out, emit(node, torch.matmul, (decayed_q, incoming)), spec)
