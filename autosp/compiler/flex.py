"""FlexAttention (`torch.ops.higher_order.flex_attention`, HF attn_implementation="flex_attention") under Ulysses.

The model builds its BlockMask in the graph from index tensors (HF: `mask_mod` evaluated over [S, S] positions,
reduced to blocks; `flex_masks` computes the same blocks by rows), which the pass keeps full on every rank
(`indices`): the mask covers the global sequence.
Attention is then wrapped as SDPA is (`communicate`): all-to-alls turn q, k, v from [B, H, S/P, D] into
[B, H/P, S, D] (KV heads replicated to split evenly), the HOP runs unchanged on this rank's heads over all
positions with the global block mask, and its outputs go back (the output, and the logsumexp where the model
reads it: attention sinks). After the exchange a rank's head h is the model's
head h + offset, so `score_mod`/`mask_mod` that read the head index (alibi, per-head biases or masks) get
`h + offset` in their subgraph, and a block mask with a head dimension is cut to this rank's heads. A padded
sequence (S not divisible by P) is cut back to S positions for the HOP, and its output padded with zeros, so the
block mask keeps its length and padded positions stay inert.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.compiler import communicate, padding
from autosp.compiler.spec import SPContext, canonical_spec, node_label
from autosp.errors import SequenceParallelError

FLEX_ATTENTION = torch.ops.higher_order.flex_attention
_BLOCK_TENSORS = range(2, 10)  # kv_num_blocks, kv_indices, full_kv_*, q_num_blocks, q_indices, full_q_* ([B, H, ..])
_HEAD_INPUT = {"score": 2, "mask": 1}  # index of `h` in score_mod(score, b, h, q, kv), mask_mod(b, h, q, kv)
_OFFSET_ATTR = "_autosp_head_offset"


def is_flex_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is FLEX_ATTENTION


def is_output(node: fx.Node) -> bool:
    """`flex_attention(...)[i]`: the output [B, H/P, S, D], logsumexp or max [B, H/P, S] the all-to-all takes back
    to the shard."""
    return node.op == "call_function" and node.target is operator.getitem and \
        isinstance(node.args[0], fx.Node) and is_flex_attention(node.args[0])


def query_key(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    return node.args[0], node.args[1]


def rewrite(ctx: SPContext, node: fx.Node) -> None:
    """All-to-alls on q, k, v; the HOP over this rank's heads and the global block mask (its outputs: `scatter`)."""
    import autosp.comm  # noqa: F401  (registers the custom ops)

    label = node_label(node)
    q, k, v, score_mod, block_mask, *rest = node.args
    if not all(ctx.is_local(t) for t in (q, k, v)):
        raise SequenceParallelError(f"attention {label}: query, key and value must all come from the sharded sequence")
    ndim = ctx.current[q].dim()
    seq_dim, head_dim = ndim - 2, ndim - 3
    expected = canonical_spec(seq_dim, ctx.seq_len, ctx.sp_rank, ctx.sp_size)
    if any(ctx.spec(t) != expected for t in (q, k, v)):
        raise SequenceParallelError(f"attention {label}: an input is not the even sequence shard Ulysses needs")
    if any(ctx.is_local(b) for buffers in rest[2:] for b in buffers):
        raise SequenceParallelError(f"attention {label}: a score_mod/mask_mod reads a sharded value; AutoSP shards "
                                    "flex_attention whose mods read full tensors (positions, parameters) only")
    if ctx.attention_chunks > 1:
        raise SequenceParallelError(
            f"attention {label} is flex_attention, which AutoSP runs unchunked: use attention_chunks=1")
    heads, kv_heads = ctx.current[q].shape[head_dim], ctx.current[k].shape[head_dim]
    replicate = communicate.kv_replication(heads, kv_heads, ctx.sp_size) if kv_heads % ctx.sp_size else 1
    per_rank = heads // ctx.sp_size
    offset = ctx.sp_rank * per_rank
    amount = padding.padded_length(ctx.seq_len, ctx.sp_size) - ctx.seq_len

    def gather(t: fx.Node, repeat: int) -> fx.Node:
        if repeat > 1:
            t = ctx.emit(node, torch.repeat_interleave, (t, repeat), {"dim": head_dim}, spec=ctx.spec(t))
        full = ctx.emit(node, communicate.ALL_TO_ALL, (t, head_dim, seq_dim, ctx.sp_size, ctx.group_name))
        return ctx.emit(node, "narrow", (full, seq_dim, 0, ctx.seq_len)) if amount else full

    mask_mod = block_mask[-1]
    block_mask = tuple(_rank_heads(ctx, b, heads, offset, per_rank, node) if i in _BLOCK_TENSORS else b
                       for i, b in enumerate(block_mask))
    for mod, kind in ((score_mod, "score"), (mask_mod, "mask")):
        _offset_head_index(ctx, mod, kind, offset, label)
    node.args = (gather(q, 1), gather(k, replicate), gather(v, replicate), score_mod, block_mask, *rest)
    ctx.current.update({n: _module(ctx, n) for n in (score_mod, mask_mod)})
    with torch.no_grad():  # shapes only: the HOP's autograd would trace the mods in Dynamo's fake mode, not ctx's
        node.meta["example_value"] = ctx.current[node] = ctx.run(node)


def scatter(ctx: SPContext, out: fx.Node) -> None:
    """One of the HOP's outputs back to all heads of this rank's (padded) positions: each has the query's head and
    sequence dims ([B, H/P, S, D] output, [B, H/P, S] logsumexp and max)."""
    head_dim = ctx.current[out.args[0].args[0]].dim() - 3
    seq_dim = head_dim + 1
    out.meta["example_value"] = ctx.current[out] = ctx.run(out)
    amount = padding.padded_length(ctx.seq_len, ctx.sp_size) - ctx.seq_len
    if amount:  # padded positions' values: zeros (nothing reads them but the padded positions themselves)
        users, after = list(out.users), ctx.current[out].dim() - 1 - seq_dim
        with ctx.graph.inserting_after(out):
            padded = ctx.graph.create_node("call_function", F.pad, (out, [0, 0] * after + [0, amount]),
                                           {"value": 0.0})
        padded.meta["example_value"] = ctx.current[padded] = ctx.run(padded)
        padded.meta["nn_module_stack"] = out.meta.get("nn_module_stack", {})
        for user in users:
            user.replace_input_with(out, padded)
        out = padded
    spec = canonical_spec(seq_dim, ctx.seq_len, ctx.sp_rank, ctx.sp_size)
    communicate.scatter_heads_back(ctx, out, seq_dim, head_dim, spec, ctx.sp_size, ctx.group_name)


def _module(ctx: SPContext, node: fx.Node) -> torch.nn.Module:
    return ctx.graph.owning_module.get_submodule(node.target)


def _rank_heads(ctx: SPContext, block: object, heads: int, offset: int, per_rank: int, before: fx.Node) -> object:
    """A block-mask tensor [B, H, ..] with a per-head dimension, cut to this rank's heads (H == 1 broadcasts)."""
    if not isinstance(block, fx.Node) or ctx.current[block].shape[1] == 1:
        return block
    if ctx.current[block].shape[1] != heads:
        raise SequenceParallelError(f"attention {node_label(before)}: its block mask has "
                                    f"{ctx.current[block].shape[1]} heads, not 1 or the {heads} query heads")
    return ctx.emit(before, "narrow", (block, 1, offset, per_rank))


def _offset_head_index(ctx: SPContext, mod: fx.Node, kind: str, offset: int, label: str) -> None:
    """Rewrite the mod's subgraph so it reads the model's head index, h + offset, where it reads h at all."""
    module = _module(ctx, mod)
    if not isinstance(module, fx.GraphModule):
        raise SequenceParallelError(f"attention {label}: its {kind}_mod is not a graph AutoSP can read")
    head = [n for n in module.graph.nodes if n.op == "placeholder"][_HEAD_INPUT[kind]]
    if not head.users or not offset or getattr(module, _OFFSET_ATTR, None) == offset:
        return
    users = list(head.users)
    with module.graph.inserting_after(head):
        shifted = module.graph.call_function(operator.add, (head, offset))
    for user in users:
        user.replace_input_with(head, shifted)
    module.recompile()
    setattr(module, _OFFSET_ATTR, offset)
