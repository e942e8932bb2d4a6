"""Token routing (mixture-of-experts): gathers and scatters whose indices come from the shard's own values.

A router picks experts per token (`topk` of local router logits), sorts the (token, expert) pairs
(`argsort`), gathers the tokens in that order (`hidden[perm // top_k]`, `hidden.repeat_interleave(top_k, 0)`) and
adds the expert outputs back (`index_add_`, `scatter_add_`). Every index is computed from this rank's tokens, so
it addresses positions of this rank's shard, and routing per token is the same computation as on one device:
the pass follows it locally. The result of a gather has the shape, and so the shard, of its index.

The inverse of a routing permutation (`inv[perm] = arange(n)`, HF's grouped experts) writes the positions of
the (token, expert) pairs: on a shard they are the positions of this rank's pairs, `arange` of the local count.

An index that is not computed from local values (e.g. `arange(S)` over the full sequence, or positions a rank
narrowed from a full tensor) holds global positions: indexing a shard with it is refused.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autosp.compiler.sp.indices import TOKEN_LOOKUP
from autosp.compiler.sp.spec import ShardSpec, SPContext, node_label
from autosp.errors import SequenceParallelError

_REPEAT_INTERLEAVE = {torch.repeat_interleave, "repeat_interleave"}
_INDEX_SELECT = {torch.index_select, "index_select"}
_SCANS = {torch.cumsum, "cumsum", torch.cumprod, "cumprod", torch.cummax, "cummax", torch.logcumsumexp, "logcumsumexp"}


def holds_global_positions(ctx: SPContext, index: fx.Node, seen: dict[fx.Node, bool]) -> bool:
    """True if `index` is computed from a full index value this rank narrowed (positions, ids) without passing
    through the model's trainable computation (router scores, whose top-k/argsort are local choices)."""
    if index not in seen:
        seen[index] = False  # shared ancestors are visited once; a token's looked-up values are not positions
        seen[index] = not index.meta.get(TOKEN_LOOKUP) and (index in ctx.full_of or any(
            holds_global_positions(ctx, n, seen) for n in index.all_input_nodes
            if ctx.is_local(n) and n not in ctx.trainable))
    return seen[index]


def _local_index(ctx: SPContext, node: fx.Node, index: object) -> ShardSpec:
    label = node_label(node)
    if not (isinstance(index, fx.Node) and ctx.is_local(index)):
        raise SequenceParallelError(
            f"{label} indexes the sharded sequence with {getattr(index, 'name', index)}, which is not computed from "
            "this rank's tokens (global positions): only routing indices computed from local values (topk, argsort) "
            "or plain slices can be sharded")
    if index not in ctx.trainable and holds_global_positions(ctx, index, {}):
        raise SequenceParallelError(
            f"{label} indexes the sharded sequence with {index.name}, computed from global positions; "
            "AutoSP can follow indices computed from the tokens' own values (routing), not positions")
    return ctx.spec(index)


def gather_spec(ctx: SPContext, node: fx.Node) -> ShardSpec | None:
    """The shard of a gather along the local sequence (`x[idx]`, `index_select`), or of `repeat_interleave` over it;
    None when `node` is neither (the other rules then apply)."""
    if not node.args or not ctx.is_local(node.args[0]) or not isinstance(ctx.specs[node.args[0]], ShardSpec):
        return None
    spec = ctx.spec(node.args[0])
    if node.target in _SCANS:
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if dim is not None and dim % ctx.current[node.args[0]].dim() == spec.dim:
            raise SequenceParallelError(
                f"{node_label(node)} ({node.target}) scans along the sharded sequence: each position depends on the "
                "tokens of earlier ranks (e.g. expert capacity counting); AutoSP cannot make that exact")
        return None
    if node.target in _REPEAT_INTERLEAVE:
        repeats, dim = (node.args + (None, None))[1:3]
        dim = node.kwargs.get("dim", dim)
        repeats = node.kwargs.get("repeats", repeats)
        if dim is None or not isinstance(repeats, int) or dim % ctx.current[node.args[0]].dim() != spec.dim:
            return None
        return spec.at(spec.dim, inner=spec.inner * repeats)
    if node.target in _INDEX_SELECT:
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if dim % ctx.current[node.args[0]].dim() != spec.dim:
            return None
        return _local_index(ctx, node, node.kwargs.get("index", node.args[2] if len(node.args) > 2 else None)).at(dim)
    if node.target is operator.getitem and isinstance(node.args[1], (fx.Node, tuple, list)):
        items = list(node.args[1]) if isinstance(node.args[1], (tuple, list)) else [node.args[1]]
        if not any(isinstance(i, fx.Node) for i in items) or any(i is Ellipsis or i is None for i in items):
            return None
        if items.index(next(i for i in items if isinstance(i, fx.Node))) != spec.dim or \
                sum(isinstance(i, fx.Node) for i in items) != 1:
            return None  # a tensor index on another dimension: the shard keeps its place (generic rule)
        index_spec = _local_index(ctx, node, items[spec.dim])
        return index_spec.at(spec.dim + index_spec.dim)
    return None


def localize_pair_positions(ctx: SPContext, node: fx.Node) -> None:
    """`inv[perm] = arange(n)` with a local routing index `perm`: write arange of the local pair count instead
    (the values index this rank's pairs, not global positions)."""
    if node.target not in (operator.setitem, "index_put_", "index_put") or len(node.args) < 3:
        return
    _, index, value = node.args[:3]
    index = index[0] if isinstance(index, (tuple, list)) and len(index) == 1 else index
    if not (isinstance(index, fx.Node) and ctx.is_local(index) and isinstance(value, fx.Node)) or ctx.is_local(value):
        return
    if value.target is not torch.arange or value.kwargs.get("step", 1) != 1 or len(value.args) > 1 and (
            len(value.args) != 2 or value.args[0] != 0):
        return
    spec = ctx.spec(index)
    if spec.dim != 0 or tuple(ctx.original[value].shape) != (spec.full_extent,):
        return
    local = ctx.emit(node, torch.arange, (spec.local_extent,), dict(value.kwargs), spec=spec)
    node.replace_input_with(value, local)
