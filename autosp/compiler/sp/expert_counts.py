"""Tokens per expert (mixture-of-experts): `histc`/`bincount` of routing choices, counted on the shard.

HF's experts kernels count the (token, expert) pairs per expert (`torch.histc(expert_ids, bins=E)`) and cut the
sorted tokens into one group per expert at the running sums of those counts. On a shard the counts of this rank's
tokens are exactly what this rank's tokens need: the pass keeps the count local (a *rank-local* value, full in
shape but not the single-device value) and lets everything computed from it alone stay rank-local. A rank-local
value consumed together with local tokens is routing, and exact. One that leaves the layer without meeting local
tokens — an auxiliary load-balancing loss or logged expert loads reaching the graph's outputs or a mutated
buffer — gets the global value instead: the count of the real positions, all-reduced over the SP group, and the
rank-local computation after it repeated on that global count.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autosp.compiler.sp.loss import ALL_REDUCE
from autosp.compiler.sp.padding import padded_length, real_part
from autosp.compiler.sp.routing import holds_global_positions
from autosp.compiler.sp.spec import SPContext, node_label
from autosp.errors import SequenceParallelError

_COUNTS = {torch.histc, "histc", torch.bincount, "bincount"}
_INPLACE = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
            operator.itruediv: operator.truediv, "add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div"}
_SORTS = {torch.sort, "sort", torch.argsort, "argsort"}
_ORDER_KEEPING = {operator.getitem, "to", "float", "int", "long", "reshape", "view", "flatten", "contiguous",
                  torch.flatten, torch.reshape}


def is_count(ctx: SPContext, node: fx.Node) -> bool:
    """True for a histc/bincount of a local value (counts over this rank's tokens)."""
    return node.target in _COUNTS and ctx.is_local(node.args[0])


def count_locally(ctx: SPContext, node: fx.Node) -> None:
    """Keep the count over this rank's tokens, as a rank-local value (see the module docstring)."""
    source = node.args[0]
    if source not in ctx.trainable and holds_global_positions(ctx, source, {}):
        raise SequenceParallelError(
            f"{node_label(node)} ({node.target}) counts global positions over the sharded sequence; AutoSP can count "
            "routing choices computed from the tokens (tokens per expert), not positions")
    node.meta["example_value"] = ctx.current[node] = ctx.run(node)
    ctx.rank_local[node] = None


def follow(ctx: SPContext, node: fx.Node) -> None:
    """A node without local inputs: rank-local if computed from a rank-local value; a mutation of full state
    (a buffer of expert loads) gets the global value instead."""
    inputs = [n for n in node.all_input_nodes if n in ctx.rank_local]
    if not inputs:
        return
    if _is_mutating(node):
        _use_global(ctx, node, inputs)
    else:
        ctx.rank_local[node] = None


def globalize_outputs(ctx: SPContext, output: fx.Node) -> None:
    """Rank-local values among the graph's outputs get their global (single-device) value."""
    _use_global(ctx, output, [n for n in output.all_input_nodes if n in ctx.rank_local])


def _is_mutating(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _use_global(ctx: SPContext, user: fx.Node, inputs: list[fx.Node]) -> None:
    """Replace `user`'s rank-local inputs by their global values; drop the rank-local computation nothing reads
    any more (it may update a value in place, `loss += aux`, which the global copy now does)."""
    memo: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        user.replace_input_with(node, _global(ctx, node, user, memo))
    for node in reversed(list(ctx.rank_local)):
        if not node.users:
            ctx.graph.erase_node(node)
            del ctx.rank_local[node]


def _global(ctx: SPContext, node: fx.Node, before: fx.Node, memo: dict[fx.Node, fx.Node]) -> fx.Node:
    """The single-device value of rank-local `node`, computed before `before`."""
    if node not in memo:
        if node.target in _COUNTS:
            source = node.args[0]
            if padded_length(ctx.seq_len, ctx.sp_size) != ctx.seq_len and _sorted(source):  # same on every rank
                raise SequenceParallelError(
                    f"{node_label(node)} ({node.target}) counts sorted tokens of a padded shard and its counts leave "
                    f"the layer; use a sequence length divisible by the SP degree {ctx.sp_size}")
            args = (real_part(ctx, source, before=before), *node.args[1:])  # padded positions count nothing
            memo[node] = ctx.emit(before, ALL_REDUCE, (ctx.emit(before, node.target, args, dict(node.kwargs)),
                                                        ctx.group_name))
        else:
            args, kwargs = fx.node.map_arg(
                (node.args, node.kwargs), lambda n: _global(ctx, n, before, memo) if n in ctx.rank_local else n)
            memo[node] = ctx.emit(before, _INPLACE.get(node.target, node.target), args, kwargs)
    return memo[node]


def _sorted(node: fx.Node) -> bool:
    """True if `node` is (a cast or view of) sorted values: its padded positions need not be its last ones."""
    while node.target not in _SORTS:
        if node.target not in _ORDER_KEEPING or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    return True
