"""Step 5, index recomputation: positions, rotary tables and masks with this shard's global offsets.

Index tensors (token ids, labels, positions, rotary cos/sin, causal/padding/document masks) are computed from
user inputs, buffers and `arange`/`cumsum`/comparisons without touching a trainable parameter. The walk leaves
that computation on the *full* sequence — it is O(S) work, and attention needs full-length masks anyway — and
a rank takes its slice only where an index tensor meets the model's trainable computation. The slice starts at
the shard's global offset, so every position, rotary angle and mask row is the one single-device training uses.
This module decides where that meeting point (the frontier) is; after the walk, `index_chains` moves a slice up
the chain that computed its value where nothing else needs that value full (the rotary tables).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autosp.compiler.sp.spec import SPContext, canonical_spec, node_label
from autosp.errors import SequenceParallelError

TOKEN_LOOKUP = "autosp_token_lookup"


def trainable_nodes(graph: fx.Graph, original: dict[fx.Node, object]) -> set[fx.Node]:
    """Nodes a trainable parameter flows into. Read off the graph, not off `requires_grad`, so a graph traced
    under `torch.no_grad()` (evaluation) finds the same frontier as a training graph."""
    trainable: set[fx.Node] = set()
    for node in graph.nodes:
        value = original.get(node)
        if node.op == "placeholder":
            if isinstance(value, torch.Tensor) and (value.requires_grad or isinstance(value, torch.nn.Parameter)):
                trainable.add(node)
        elif any(n in trainable for n in node.all_input_nodes):
            trainable.add(node)
    return trainable


def is_index_value(ctx: SPContext, node: fx.Node) -> bool:
    """A tensor that no trainable parameter flows into."""
    return isinstance(ctx.original.get(node), torch.Tensor) and node not in ctx.trainable


def sequence_dim(ctx: SPContext, node: fx.Node) -> int | None:
    """The dimension of a full index tensor that runs along the sequence, if any."""
    dims = [d for d, size in enumerate(ctx.original[node].shape) if size == ctx.seq_len]
    if len(dims) > 1:
        if 1 in dims:  # [B, S, ...] is the layout of token ids, labels and positions
            return 1
        raise SequenceParallelError(
            f"{node_label(node)} has several dimensions of the sequence length {ctx.seq_len} "
            f"(shape {tuple(ctx.original[node].shape)}); AutoSP cannot tell which one to shard"
        )
    return dims[0] if dims else None


def is_frontier(ctx: SPContext, node: fx.Node) -> bool:
    """True where trainable computation starts consuming a full index tensor (e.g. the token embedding)."""
    if not isinstance(ctx.original.get(node), torch.Tensor) or node not in ctx.trainable:
        return False
    return any(is_index_value(ctx, n) and sequence_dim(ctx, n) is not None for n in node.all_input_nodes)


def is_token_lookup(ctx: SPContext, node: fx.Node) -> bool:
    """`table[ids]`: a fixed integer table (no trainable value flows into it, no sequence dim) read at full index
    values along the sequence (DeepSeek-V4's hash routing, `tid2eid[input_ids]`): a per-token value, so the walk
    reads it for this rank's tokens only. Marked, so routing indices computed from it are not taken for positions
    (`routing.holds_global_positions`)."""
    if node.target is not operator.getitem or not isinstance(node.args[1], fx.Node):
        return False
    table, ids = node.args
    value = ctx.original.get(table)
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or table in ctx.trainable \
            or ctx.seq_len in value.shape or not is_index_value(ctx, ids) or sequence_dim(ctx, ids) is None:
        return False
    node.meta[TOKEN_LOOKUP] = True
    return True


def localize_frontier(ctx: SPContext, node: fx.Node) -> None:
    """Feed `node` this rank's canonical shard of each full index tensor it consumes."""
    for inp in node.all_input_nodes:
        if is_index_value(ctx, inp):
            dim = sequence_dim(ctx, inp)
            if dim is not None:
                spec = canonical_spec(dim, ctx.seq_len, ctx.sp_rank, ctx.sp_size)
                node.replace_input_with(inp, ctx.localize(inp, dim, spec, before=node))
