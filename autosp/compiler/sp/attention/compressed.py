"""DeepSeek-V4's compressed attention (CSA, HCA) under SP, exactly: gathered keys and pooled entries, local queries.

A compressed layer's queries attend over the sequence's S keys joined along it with T pooled entries (keys pooled
over windows of positions: `q @ kT` of [.., S, S + T] over a `cat` of both, then a softmax with a per-head sink),
under a mask joined the same way: the sliding window's [S, S] and the pooled entries' visibility [S, T] (a query
sees an entry once its window has closed; CSA also only the lightning indexer's top k, scored against pooled
indexer keys). Every pooled entry is a function of a window of global positions (CSA's windows overlap the one
before), and windows straddle the shards, so the projections the keys and pooled entries are computed from (the
first linears inside the attention module that no query is computed from: the keys', the compressor's and the
indexer's) are all-gathered along the sequence (`sparse.gather`, `autosp_sp::all_gather_sequence`, its gradient a
reduce-scatter) and every rank pools the whole sequence as single-process training does. Each rank then attends its
own queries over every key and pooled entry: the mask's rows, the sink's rows and the fresh buffers the mask is
built in (`new_zeros`/`new_full` of [.., S, T]) are cut to this rank's positions. No all-to-all.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autosp.compiler.fx import module_path
from autosp.compiler.sp import resize
from autosp.compiler.sp.attention import sparse
from autosp.compiler.sp.spec import ShardSpec, SPContext, canonical_spec, node_label
from autosp.errors import SequenceParallelError

MATMULS = {torch.matmul, operator.matmul, "matmul", torch.bmm, "bmm"}
SOFTMAXES = {torch.nn.functional.softmax, torch.softmax, "softmax"}
LINEARS = {torch._C._nn.linear, torch.nn.functional.linear}
_ROWS = "autosp_compressed_rows"  # meta: an op between the scores and the softmax (its full partners cut to rows)
_FRESH = "autosp_compressed_fresh"  # meta: the dim of a fresh mask buffer that holds the queries


@dataclass(frozen=True)
class JoinedAttention:
    scores: fx.Node  # q @ kT over [.., S, S + T]
    softmax: fx.Node
    queries: int  # S
    pooled: int  # T


def find(gm: fx.GraphModule, trainable: set[fx.Node]) -> list[JoinedAttention]:
    """Every hand-written attention whose queries see the sequence's keys joined along it with pooled entries."""
    found = []
    for node in gm.graph.nodes:
        scores = _value(node)
        if node.target not in MATMULS or node not in trainable or scores is None or scores.dim() < 3:
            continue
        queries, keys = scores.shape[-2], scores.shape[-1]
        softmax = _softmax_after(node)
        if keys > queries > 1 and softmax is not None and _joined(node.args[1], queries, keys):
            found.append(JoinedAttention(node, softmax, queries, keys - queries))
    return found


def mark(gm: fx.GraphModule, seq_len: int, trainable: set[fx.Node]) -> None:
    """Marks what the walk gathers for each compressed attention, the ops whose full partners it cuts to this rank's
    query rows, and the fresh mask buffers it allocates for this rank's queries only."""
    for attention in find(gm, trainable):
        if attention.queries != seq_len:
            continue
        scope = module_path(attention.scores) or ""
        upstream = sparse.ancestors([attention.softmax])
        for_query = sparse.ancestors([attention.scores.args[0]]) | {attention.scores.args[0]}
        pooled = [n for n in upstream if _value(n) is not None and attention.pooled in _value(n).shape
                  and seq_len not in _value(n).shape]
        feeding = (sparse.ancestors([attention.scores.args[1], *pooled]) | set(pooled)) - for_query
        candidates = {n for n in feeding if n.target in LINEARS and n in trainable
                      and (module_path(n) or "").startswith(scope) and _value(n) is not None
                      and _value(n).dim() >= 2 and _value(n).shape[1] == seq_len}
        firsts = [n for n in candidates if not sparse.ancestors([n]) & candidates]
        if not firsts:
            raise SequenceParallelError(
                f"attention {node_label(attention.scores)} attends over the sequence's {seq_len} keys joined with "
                f"{attention.pooled} pooled entries, but AutoSP found no projection inside it that the keys are "
                "computed from to gather; compute keys and pooled entries from linear projections of the tokens")
        for linear in firsts:
            sparse.mark_gather(linear, 1)
        for node in sparse.descendants(attention.scores) & (upstream | {attention.softmax}):
            node.meta[_ROWS] = attention
        for node in upstream - for_query - sparse.ancestors([attention.scores.args[1]]):  # the mask's side
            value = _value(node)
            if node.target in resize.FRESH_LIKE and value is not None and value.dim() >= 2 \
                    and value.shape[-2] == seq_len and (module_path(node) or "").startswith(scope):
                node.meta[_FRESH] = value.dim() - 2


def is_fresh_rows(node: fx.Node) -> bool:
    return _FRESH in node.meta


def fresh_rows(ctx: SPContext, node: fx.Node) -> None:
    """A fresh mask buffer over [.., S, T] (filled from this rank's indexer picks or its positions) is allocated for
    this rank's query rows only."""
    dim = node.meta[_FRESH]
    spec = canonical_spec(dim, ctx.seq_len, ctx.sp_rank, ctx.sp_size)
    if "size" in node.kwargs:
        sizes = list(node.kwargs["size"])
        sizes[dim] = spec.local_extent
        node.kwargs = {**node.kwargs, "size": tuple(sizes)}
    elif isinstance(node.args[1], (tuple, list, torch.Size)):  # new_full(size, fill) or new_zeros(size)
        sizes = list(node.args[1])
        sizes[dim] = spec.local_extent
        node.args = (node.args[0], tuple(sizes), *node.args[2:])
    else:  # new_zeros(*sizes)
        sizes = list(node.args[1:])
        sizes[dim] = spec.local_extent
        node.args = (node.args[0], *sizes)
    node.meta["example_value"] = ctx.current[node] = ctx.run(node)
    ctx.specs[node] = spec


def localize_rows(ctx: SPContext, node: fx.Node) -> None:
    """Between the scores and the softmax: a full partner with a dim of the queries (the joined mask, the sink
    expanded over the queries) is cut to this rank's rows."""
    if _ROWS not in node.meta:
        return
    local = next(n for n in node.all_input_nodes if ctx.is_local(n))
    if not isinstance(ctx.specs[local], ShardSpec):  # an element of a tuple (max's values)
        return
    spec, ndim = ctx.spec(local), ctx.current[local].dim()
    for side in node.all_input_nodes:
        value = ctx.current.get(side)
        if ctx.is_local(side) or not isinstance(value, torch.Tensor):
            continue
        dim = spec.dim - (ndim - value.dim())
        if 0 <= dim < value.dim() and value.shape[dim] == spec.full_extent:
            node.replace_input_with(side, ctx.localize(side, dim, spec, before=node))


def _value(node: object) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _joined(keys: fx.Node, queries: int, total: int, depth: int = 8) -> bool:
    """`keys` is computed (within `depth` ops) from a `cat` of `queries` keys and more entries into `total`."""
    frontier = [keys]
    for _ in range(depth):
        for node in frontier:
            if node.target in (torch.cat, "cat") and _value(node) is not None and total in _value(node).shape:
                dim = list(_value(node).shape).index(total)
                parts = [_value(n).shape[dim] for n in node.args[0] if _value(n) is not None]
                if queries in parts:
                    return True
        frontier = [n for node in frontier for n in node.all_input_nodes]
    return False


def _softmax_after(matmul: fx.Node, depth: int = 8) -> fx.Node | None:
    frontier = [matmul]
    for _ in range(depth):
        frontier = [u for node in frontier for u in node.users]
        softmax = next((n for n in frontier if n.target in SOFTMAXES), None)
        if softmax is not None:
            return softmax
    return None


