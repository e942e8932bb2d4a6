"""Step 4, communication: Ulysses all-to-alls around every attention.

Outside attention a rank holds all heads of S/P tokens; attention needs all S tokens of a head. One all-to-all
per q, k, v turns [B, H, S/P, D] into [B, H/P, S, D]; one on the output turns it back: four per layer. Attention
itself then runs unchanged on full-length sequences, so causal flags and full masks stay as they are (a mask with
a head dimension is cut to this rank's heads). KV heads fewer than (or not divisible by) the SP degree are
replicated just enough to split evenly, which keeps each query head paired with its own KV head under GQA.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler import hybrid, padding
from autosp.compiler.sdpa import SDPA_PARAMS, attention_args
from autosp.compiler.spec import SPContext, canonical_spec, node_label
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

    def gather_sequence(t: fx.Node) -> fx.Node:
        if ctx.a2a_size == 1:  # pure ring: every rank keeps all heads
            return t
        return ctx.emit(node, ALL_TO_ALL, (t, head_dim, seq_dim, ctx.a2a_size, ctx.a2a_group))

    new_args = dict(args)
    new_args["query"] = gather_sequence(q)
    for name, t in (("key", k), ("value", v)):
        if replicate > 1:
            t = ctx.emit(node, torch.repeat_interleave, (t, replicate), {"dim": head_dim}, spec=spec)
        new_args[name] = gather_sequence(t)
    mask = args["attn_mask"]
    if isinstance(mask, fx.Node) and ctx.is_local(mask):
        raise SequenceParallelError(f"attention {label}: the mask is computed from sharded values")
    mask = new_args["attn_mask"] = padding.attention_mask(ctx, mask, args["is_causal"], before=node)
    if isinstance(mask, fx.Node):
        mask_shape = ctx.current[mask].shape
        if len(mask_shape) >= 3 and mask_shape[-3] == heads and heads > 1:
            per_rank = heads // ctx.a2a_size
            new_args["attn_mask"] = ctx.emit(node, "narrow", (mask, len(mask_shape) - 3,
                                                               ctx.a2a_rank * per_rank, per_rank))
    if ctx.ring_size > 1:
        hybrid.replace_with_ring(ctx, node, new_args)
    else:
        node.args = tuple(new_args[name] for name in SDPA_PARAMS[:3])
        node.kwargs = {name: new_args[name] for name in SDPA_PARAMS[3:]}
    node.meta["example_value"] = ctx.current[node] = ctx.run(node)
    if ctx.a2a_size == 1:
        ctx.specs[node] = spec
        return
    scatter_heads_back(ctx, node, seq_dim, head_dim, spec, ctx.a2a_size, ctx.a2a_group)


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
