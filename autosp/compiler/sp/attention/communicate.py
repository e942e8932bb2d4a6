"""Step 4, communication: Ulysses all-to-alls around every attention.

Outside attention a rank holds all heads of S/P tokens; attention needs all S tokens of a head. One all-to-all
per q, k, v turns [B, H, S/P, D] into [B, H/P, S, D]; one on the output turns it back: four per layer. Attention
itself then runs unchanged on full-length sequences, so causal flags and full masks stay as they are (a mask with
a head dimension is cut to this rank's heads). KV heads fewer than (or not divisible by) the SP degree are
replicated just enough to split evenly, which keeps each query head paired with its own KV head under GQA.
With `attention_chunks` the region (all-to-alls, attention, all-to-all back) runs once per chunk of heads
(`HeadChunks`, for flex attention too: `flex`), so one chunk's full-length tensors are alive at a time.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler.sp.attention import hybrid
from autosp.compiler.sp import padding
from autosp.compiler.fx.sdpa import SDPA_PARAMS, attention_args
from autosp.compiler.sp.spec import ShardSpec, SPContext, canonical_spec, node_label
from autosp.errors import SequenceParallelError

ALL_TO_ALL = op("all_to_all").default


def kv_replication(heads: int, kv_heads: int, sp_size: int) -> int:
    """Smallest factor r so that kv_heads * r splits evenly over the SP ranks and still divides the query heads."""
    r = sp_size // math.gcd(kv_heads, sp_size)
    if heads % (kv_heads * r):
        raise SequenceParallelError(
            f"{kv_heads} KV heads cannot be replicated to split over {sp_size} ranks with {heads} query heads"
        )
    return r


def rewrite_attention(ctx: SPContext, node: fx.Node) -> None:
    import autosp.comm  # noqa: F401  (registers the custom ops)

    args = attention_args(node)
    label = node_label(node)
    q, k, v = args["query"], args["key"], args["value"]
    if not all(ctx.is_local(t) for t in (q, k, v)):
        raise SequenceParallelError(f"attention {label}: query, key and value must all come from the sharded sequence")
    ndim = ctx.current[q].dim()
    seq_dim, head_dim = ndim - 2, ndim - 3
    expected = canonical_spec(seq_dim, ctx.seq_len, ctx.sp_rank, ctx.sp_size)
    for t in (q, k, v):
        if ctx.spec(t) != expected:
            raise SequenceParallelError(
                f"attention {label}: an input is not the even sequence shard Ulysses needs ({ctx.spec(t)})"
            )
    if args["dropout_p"]:
        raise SequenceParallelError(
            f"attention {label} uses dropout_p={args['dropout_p']}: its random mask would differ from single-device "
            "training; set attention dropout to 0"
        )
    heads, kv_heads = ctx.current[q].shape[head_dim], ctx.current[k].shape[head_dim]
    if kv_heads != heads and not args["enable_gqa"] and kv_heads != 1:
        raise SequenceParallelError(f"attention {label}: {heads} query vs {kv_heads} KV heads without enable_gqa")
    replicate = kv_replication(heads, kv_heads, ctx.a2a_size) if kv_heads % ctx.a2a_size else 1
    spec = ctx.spec(q)
    chunks = HeadChunks.of(ctx, label, heads, kv_heads * replicate)

    def gather_sequence(t: fx.Node) -> fx.Node:
        if ctx.a2a_size == 1:  # pure ring: every rank keeps all heads
            return t
        return ctx.emit(node, ALL_TO_ALL, (t, head_dim, seq_dim, ctx.a2a_size, ctx.a2a_group))

    kv = {}
    for name, t in (("key", k), ("value", v)):
        if replicate > 1:
            t = ctx.emit(node, torch.repeat_interleave, (t, replicate), {"dim": head_dim}, spec=spec)
        kv[name] = t if chunks.kv_per_chunk else gather_sequence(t)  # else: exchanged once, sliced per chunk
    mask = args["attn_mask"]
    if isinstance(mask, fx.Node) and ctx.is_local(mask):
        raise SequenceParallelError(f"attention {label}: the mask is computed from sharded values")
    mask = padding.attention_mask(ctx, mask, args["is_causal"], before=node)
    head_mask = isinstance(mask, fx.Node) and len(ctx.current[mask].shape) >= 3 and \
        ctx.current[mask].shape[-3] == heads and heads > 1
    backs = []
    for j in range(chunks.count):
        new_args = dict(args, query=gather_sequence(chunks.take(ctx, q, j, node, spec)), attn_mask=mask)
        for name, t in kv.items():
            new_args[name] = gather_sequence(chunks.take(ctx, t, j, node, spec)) if chunks.kv_per_chunk else \
                chunks.kv_heads_of(ctx, t, j, node)
        if head_mask:
            new_args["attn_mask"] = ctx.emit(node, "narrow", (mask, len(ctx.current[mask].shape) - 3,
                                                              *chunks.rank_heads(ctx.a2a_rank, j)))
        attention = node if chunks.count == 1 else copy_before(ctx, node)
        if ctx.ring_size > 1:
            hybrid.replace_with_ring(ctx, attention, new_args)
        else:
            attention.args = tuple(new_args[name] for name in SDPA_PARAMS[:3])
            attention.kwargs = {name: new_args[name] for name in SDPA_PARAMS[3:]}
        attention.meta["example_value"] = ctx.current[attention] = ctx.run(attention)
        if ctx.a2a_size == 1:
            ctx.specs[attention] = spec
            backs.append(attention)
        else:
            backs.append(scatter_heads_back(ctx, attention, seq_dim, head_dim, spec, ctx.a2a_size, ctx.a2a_group))
    if chunks.count > 1:
        node.replace_all_uses_with(chunks.join(ctx, backs, node, spec))
        ctx.graph.erase_node(node)


def copy_before(ctx: SPContext, node: fx.Node) -> fx.Node:
    """A new attention node before `node`, with its target and metadata (arguments are set by the caller)."""
    with ctx.graph.inserting_before(node):
        copy = ctx.graph.create_node(node.op, node.target, node.args, dict(node.kwargs))
    copy.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})
    return copy


@dataclass(frozen=True)
class HeadChunks:
    """Attention in `count` chunks of heads, each chunk its own all-to-alls, attention and all-to-all back, so
    forward and backward hold one chunk's full-length q, k, v, output and gradients at a time, not every head's.

    Chunk j is the j-th block of every rank's heads (rank r's heads r*H/P + j*h .. + h, h = H/(cP)), not the j-th
    block of all heads: its all-to-all then hands each rank a subset of the heads it holds unchunked, so each query
    head meets the same KV head as without chunks. KV heads split into the chunks when each rank holds a multiple
    of `count` (MHA, mild GQA); else (e.g. one KV head per rank) they are exchanged once and each chunk slices the
    ones its query heads use. count == 1 is plain Ulysses: no slicing, no join."""

    count: int
    ranks: int  # the all-to-all's ranks (1: pure ring)
    heads: int  # query heads
    kv_heads: int  # KV heads after replication for the ranks
    kv_per_chunk: bool
    _pieces: dict = field(default_factory=dict, compare=False, repr=False)  # value -> its unbind/split node

    @classmethod
    def of(cls, ctx: SPContext, label: str, heads: int, kv_heads: int) -> HeadChunks:
        count, ranks = ctx.attention_chunks, ctx.a2a_size
        per_rank, kv_per_rank = heads // ranks, kv_heads // ranks
        if count < 1 or per_rank % count:
            raise SequenceParallelError(
                f"attention {label}: attention_chunks={count} must divide the {per_rank} query heads each rank "
                f"attends ({heads} heads over {ranks} ranks); choose a divisor of {per_rank}")
        h, group = per_rank // count, per_rank // kv_per_rank
        if kv_per_rank % count and h % group and group % h:
            raise SequenceParallelError(
                f"attention {label}: chunks of {h} query heads do not line up with the {kv_per_rank} KV heads a rank "
                f"holds (groups of {group}); choose attention_chunks so the chunk's heads are whole KV groups")
        return cls(count, ranks, heads, kv_heads, kv_per_rank % count == 0)

    def take(self, ctx: SPContext, t: fx.Node, j: int, before: fx.Node, spec: ShardSpec) -> fx.Node:
        """Chunk j of a local [.., H_t, S/P, D] value: heads [r*H_t/P + j*H_t/(cP), ...) of every rank r."""
        if self.count == 1:
            return t
        dim = ctx.current[t].dim() - 3
        if t not in self._pieces:  # one unbind per value: its backward stacks the chunks' gradients once
            per = ctx.current[t].shape[dim] // (self.ranks * self.count)
            blocks = ctx.emit(before, "unflatten", (t, dim, (self.ranks, self.count, per)), spec=spec.at(spec.dim + 2))
            self._pieces[t] = ctx.emit(before, "unbind", (blocks, dim + 1))
        chunk = ctx.emit(before, operator.getitem, (self._pieces[t], j), spec=spec.at(spec.dim + 1))
        return ctx.emit(before, "flatten", (chunk, dim, dim + 1), spec=spec)

    def kv_heads_of(self, ctx: SPContext, t: fx.Node, j: int, before: fx.Node) -> fx.Node:
        """The KV heads (of the ones this rank received whole) that chunk j's query heads use."""
        dim = ctx.current[t].dim() - 3
        group, h = self.heads // self.kv_heads, self.heads // (self.ranks * self.count)
        size = max(1, h // group)
        if self.count == 1 or size == ctx.current[t].shape[dim]:  # every chunk uses them all
            return t
        if t not in self._pieces:  # one split per value: its backward concatenates the gradients once
            self._pieces[t] = ctx.emit(before, "split", (t, size, dim))
        return ctx.emit(before, operator.getitem, (self._pieces[t], j * h // group // size))

    def rank_heads(self, rank: int, j: int) -> tuple[int, int]:
        """(first, count) of the query heads rank `rank` attends in chunk j (for a per-head mask)."""
        h = self.heads // (self.ranks * self.count)
        return rank * self.heads // self.ranks + j * h, h

    def join(self, ctx: SPContext, backs: list[fx.Node], before: fx.Node, spec: ShardSpec) -> fx.Node:
        """The chunks' outputs [.., P*h, S/P(, D)] back in head order [.., H, S/P(, D)] (inverse of `take`); the
        heads are the dim before the sequence's (`spec`): attention's output, flex's logsumexp."""
        dim = spec.dim - 1
        h = self.heads // (self.ranks * self.count)
        parts = [ctx.emit(before, "unflatten", (b, dim, (self.ranks, h)), spec=spec.at(spec.dim + 1)) for b in backs]
        stacked = ctx.emit(before, torch.stack, (parts, dim + 1), spec=spec.at(spec.dim + 2))
        return ctx.emit(before, "flatten", (stacked, dim, dim + 2), spec=spec)


def scatter_heads_back(ctx: SPContext, out: fx.Node, seq_dim: int, head_dim: int, spec: object, size: int,
                       group: str) -> fx.Node:
    """After attention over all positions of this rank's heads: the all-to-all back to all heads of this rank's
    positions, inserted after `out` and taking its place for every user (the fourth all-to-all of Ulysses)."""
    users = list(out.users)
    with ctx.graph.inserting_after(out):
        back = ctx.graph.create_node("call_function", ALL_TO_ALL, (out, seq_dim, head_dim, size, group))
    back.meta["example_value"] = ctx.current[back] = ctx.run(back)
    back.meta["nn_module_stack"] = out.meta.get("nn_module_stack", {})
    ctx.specs[back] = spec
    for user in users:
        user.replace_input_with(out, back)
    return back
