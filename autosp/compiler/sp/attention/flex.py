"""FlexAttention (`torch.ops.higher_order.flex_attention`, HF attn_implementation="flex_attention") under Ulysses.

The model builds its BlockMask in the graph from index tensors (HF: `mask_mod` evaluated over [S, S] positions,
reduced to blocks; `flex_masks` computes the same blocks by rows), which the pass keeps full on every rank
(`indices`): the mask covers the global sequence.
Attention is then wrapped as SDPA is (`communicate`): all-to-alls turn q, k, v from [B, H, S/P, D] into
[B, H/P, S, D] (KV heads replicated to split evenly), the HOP runs unchanged on this rank's heads over all
positions with the global block mask, and its outputs go back (the output, and the logsumexp where the model
reads it: attention sinks). With `attention_chunks` this region runs once per chunk of the rank's heads, as
SDPA's does (`communicate.HeadChunks`). A HOP's head h is the model's head h + offset (the rank's and the
chunk's first head), so `score_mod`/`mask_mod` that read the head index (alibi, per-head biases or masks) get a
copy reading `h + offset`, and a block mask with a head dimension is cut to the HOP's heads. A padded
sequence (S not divisible by P) is cut back to S positions for the HOP, and its output padded with zeros, so the
block mask keeps its length and padded positions stay inert. Training on CPU under Inductor is refused
(`check_lowering`): torch's CPU flex kernel there is inference-only.
"""
from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx

from autosp.compiler.sp.attention import communicate
from autosp.compiler.sp import padding
from autosp.compiler.sp.spec import SPContext, canonical_spec, node_label
from autosp.errors import SequenceParallelError

FLEX_ATTENTION = torch.ops.higher_order.flex_attention
_BLOCK_TENSORS = range(2, 10)  # kv_num_blocks, kv_indices, full_kv_*, q_num_blocks, q_indices, full_q_* ([B, H, ..])
_HEAD_INPUT = {"score": 2, "mask": 1}  # index of `h` in score_mod(score, b, h, q, kv), mask_mod(b, h, q, kv)
_CHUNKS = "autosp_flex_chunks"  # meta of the last chunk's HOP: its HeadChunks, the earlier chunks' outputs back


def is_flex_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is FLEX_ATTENTION


def is_output(node: fx.Node) -> bool:
    """`flex_attention(...)[i]`: the output [B, H/P, S, D], logsumexp or max [B, H/P, S] the all-to-all takes back
    to the shard."""
    return node.op == "call_function" and node.target is operator.getitem and \
        isinstance(node.args[0], fx.Node) and is_flex_attention(node.args[0])


def check_lowering(gm: fx.GraphModule, backend: str) -> None:
    """Refuse Inductor for a flex graph that trains on CPU: torch's CPU flex_attention kernel is inference-only (it
    neither returns the logsumexp backward needs nor has a backward), and fails deep in Inductor otherwise."""
    for node in gm.graph.nodes if backend == "inductor" else ():
        values = [n.meta.get("example_value") for n in node.all_input_nodes] if is_flex_attention(node) else []
        if values and values[0].device.type == "cpu" and torch.is_grad_enabled() and \
                any(getattr(t, "requires_grad", False) for t in values):  # as aot_autograd tells training
            raise SequenceParallelError(f"attention {node_label(node)}: Inductor compiles flex_attention on CPU for "
                                        "inference only; train it on CPU with backend='aot_eager'")


def query_key(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    return node.args[0], node.args[1]


def rewrite(ctx: SPContext, node: fx.Node) -> None:
    """All-to-alls on q, k, v; the HOP over this rank's heads and the global block mask, once per chunk of heads
    (`communicate.HeadChunks`: `node` runs the last chunk, copies before it the others, whose outputs go back to
    the shard right after them; the last chunk's, and the join, at `scatter`)."""
    import autosp.comm  # noqa: F401  (registers the custom ops)

    label = node_label(node)
    q, k, v, score_mod, block_mask, *rest = node.args
    if not all(ctx.is_local(t) for t in (q, k, v)):
        raise SequenceParallelError(f"attention {label}: query, key and value must all come from the sharded sequence")
    ndim = ctx.current[q].dim()
    seq_dim, head_dim = ndim - 2, ndim - 3
    spec = canonical_spec(seq_dim, ctx.seq_len, ctx.sp_rank, ctx.sp_size)
    if any(ctx.spec(t) != spec for t in (q, k, v)):
        raise SequenceParallelError(f"attention {label}: an input is not the even sequence shard Ulysses needs")
    if any(ctx.is_local(b) for buffers in rest[2:] for b in buffers):
        raise SequenceParallelError(f"attention {label}: a score_mod/mask_mod reads a sharded value; AutoSP shards "
                                    "flex_attention whose mods read full tensors (positions, parameters) only")
    heads, kv_heads = ctx.current[q].shape[head_dim], ctx.current[k].shape[head_dim]
    replicate = communicate.kv_replication(heads, kv_heads, ctx.sp_size) if kv_heads % ctx.sp_size else 1
    chunks = communicate.HeadChunks.of(ctx, label, heads, kv_heads * replicate)
    amount = padding.padded_length(ctx.seq_len, ctx.sp_size) - ctx.seq_len

    def gather(t: fx.Node) -> fx.Node:
        full = ctx.emit(node, communicate.ALL_TO_ALL, (t, head_dim, seq_dim, ctx.sp_size, ctx.group_name))
        return ctx.emit(node, "narrow", (full, seq_dim, 0, ctx.seq_len)) if amount else full

    kv = []
    for t in (k, v):
        if replicate > 1:
            t = ctx.emit(node, torch.repeat_interleave, (t, replicate), {"dim": head_dim}, spec=spec)
        kv.append(t if chunks.kv_per_chunk else gather(t))  # else: exchanged once, sliced per chunk
    outputs = sorted({user.args[1] for user in node.users})  # which of output, logsumexp, max the model reads
    backs: dict[int, list[fx.Node]] = {i: [] for i in outputs}
    for j in range(chunks.count):
        first, count = chunks.rank_heads(ctx.sp_rank, j)
        keys = [gather(chunks.take(ctx, t, j, node, spec)) if chunks.kv_per_chunk else
                chunks.kv_heads_of(ctx, t, j, node) for t in kv]
        mask = tuple(_rank_heads(ctx, b, heads, first, count, node) if i in _BLOCK_TENSORS else b
                     for i, b in enumerate(block_mask[:-1]))
        args = (gather(chunks.take(ctx, q, j, node, spec)), *keys, _at_offset(ctx, score_mod, "score", first, node),
                mask + (_at_offset(ctx, block_mask[-1], "mask", first, node),), *rest)
        hop = node if j == chunks.count - 1 else communicate.copy_before(ctx, node)
        hop.args = args
        with torch.no_grad():  # shapes only: the HOP's autograd would trace the mods in Dynamo's fake mode, not ctx's
            hop.meta["example_value"] = ctx.current[hop] = ctx.run(hop)
        if hop is not node:
            for i in outputs:
                backs[i].append(_back(ctx, ctx.emit(node, operator.getitem, (hop, i)), node))
    for mod in (score_mod, block_mask[-1]):
        if not mod.users:  # every chunk reads a shifted copy
            ctx.graph.erase_node(mod)
    node.meta[_CHUNKS] = (chunks, backs)


def scatter(ctx: SPContext, out: fx.Node) -> None:
    """One of the last chunk's HOP outputs back to all heads of this rank's positions, joined with the earlier
    chunks' (`rewrite`) in head order."""
    out.meta["example_value"] = ctx.current[out] = ctx.run(out)
    chunks, backs = out.args[0].meta[_CHUNKS]
    users, anchor = list(out.users), out.next
    parts = [*backs[out.args[1]], _back(ctx, out, anchor)]
    joined = parts[0] if len(parts) == 1 else chunks.join(ctx, parts, anchor, ctx.specs[parts[0]])
    for user in users:
        user.replace_input_with(out, joined)


def _back(ctx: SPContext, out: fx.Node, before: fx.Node) -> fx.Node:
    """A HOP output ([B, h, S, D] output, [B, h, S] logsumexp or max) to all heads of this rank's (padded)
    positions: padded with zeros past S (nothing reads them but the padded positions themselves), all-to-all."""
    seq_dim = ctx.current[out.args[0].args[0]].dim() - 2
    amount = padding.padded_length(ctx.seq_len, ctx.sp_size) - ctx.seq_len
    padded = ctx.pad(out, seq_dim, amount, 0.0, before)
    return ctx.emit(before, communicate.ALL_TO_ALL, (padded, seq_dim, seq_dim - 1, ctx.sp_size, ctx.group_name),
                    spec=canonical_spec(seq_dim, ctx.seq_len, ctx.sp_rank, ctx.sp_size))


def _module(ctx: SPContext, node: fx.Node) -> torch.nn.Module:
    return ctx.graph.owning_module.get_submodule(node.target)


def _rank_heads(ctx: SPContext, block: object, heads: int, first: int, count: int, before: fx.Node) -> object:
    """A block-mask tensor [B, H, ..] with a per-head dimension, cut to heads [first, first + count) (H == 1
    broadcasts)."""
    if not isinstance(block, fx.Node) or ctx.current[block].shape[1] == 1:
        return block
    if ctx.current[block].shape[1] != heads:
        raise SequenceParallelError(f"attention {node_label(before)}: its block mask has "
                                    f"{ctx.current[block].shape[1]} heads, not 1 or the {heads} query heads")
    return ctx.emit(before, "narrow", (block, 1, first, count))


def _at_offset(ctx: SPContext, mod: fx.Node, kind: str, offset: int, before: fx.Node) -> fx.Node:
    """The mod for a HOP whose head h is the model's head h + offset: where it reads h at all, a copy reading
    h + offset (one per mod and offset, shared by the HOPs that use it); the model's own is left as it is."""
    module = _module(ctx, mod)
    if not isinstance(module, fx.GraphModule):
        raise SequenceParallelError(f"attention {node_label(before)}: its {kind}_mod is not a graph AutoSP can read")
    ctx.current[mod] = module
    if not offset or not _head(module.graph, kind).users:
        return mod
    root, name = ctx.graph.owning_module, f"{mod.target}_h{offset}"
    if not hasattr(root, name):
        graph = copy.deepcopy(module.graph)
        head = _head(graph, kind)
        with graph.inserting_after(head):
            shifted = graph.call_function(operator.add, (head, offset))
        head.replace_all_uses_with(shifted, delete_user_cb=lambda user: user is not shifted)
        root.add_submodule(name, fx.GraphModule(module, graph))
    with ctx.graph.inserting_before(before):
        shifted_mod = ctx.graph.get_attr(name)
    ctx.current[shifted_mod] = getattr(root, name)
    return shifted_mod


def _head(graph: fx.Graph, kind: str) -> fx.Node:
    return [n for n in graph.nodes if n.op == "placeholder"][_HEAD_INPUT[kind]]
