"""Step 6, loss: reductions over the sharded sequence become exact global reductions.

A rank reduces its own tokens to a partial sum and one all-reduce yields the global value on every rank. A mean
becomes sum / (global count): for `cross_entropy(..., reduction="mean")` the count is the number of labels that
are not `ignore_index` in the *full* label tensor, which every rank has, so uneven runs of -100 across shards
stay exact without another collective. The all-reduce's gradient is the identity (see `autosp.comm.ops`).
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.comm.library import op
from autosp.compiler.sp.padding import real_part
from autosp.compiler.sp.spec import SPContext, node_label
from autosp.errors import SequenceParallelError

ALL_REDUCE = op("all_reduce_sum").default
_TOKEN_LOSSES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}
_SUMS = {torch.sum, "sum"}
_MEANS = {torch.mean, "mean"}


def _reduced_dims(node: fx.Node, ndim: int) -> set[int]:
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if dims is None:
        return set(range(ndim))
    dims = dims if isinstance(dims, (tuple, list)) else (dims,)
    return {d % ndim for d in dims}


def is_sequence_reduction(ctx: SPContext, node: fx.Node) -> bool:
    """True for a loss or sum/mean that reduces a local value over its sequence dimension."""
    if node.target in _TOKEN_LOSSES:
        bound = _TOKEN_LOSSES[node.target].bind(*node.args, **node.kwargs)
        return ctx.is_local(bound.arguments["input"]) and bound.arguments.get("reduction", "mean") != "none"
    if node.target in _SUMS or node.target in _MEANS:
        source = node.args[0]
        return ctx.is_local(source) and ctx.spec(source).dim in _reduced_dims(node, ctx.current[source].dim())
    return False


def globalize(ctx: SPContext, node: fx.Node) -> None:
    """Replace a sequence reduction with (local partial sum -> all-reduce [-> / global count])."""
    label = node_label(node)
    users = list(node.users)
    if node.target in _TOKEN_LOSSES:
        bound = _TOKEN_LOSSES[node.target].bind(*node.args, **node.kwargs)
        arguments = dict(bound.arguments)
        if arguments.get("weight") is not None or arguments.get("label_smoothing", 0.0):
            raise SequenceParallelError(f"{label}: class weights and label smoothing are not supported under SP")
        reduction = arguments.pop("reduction", "mean")
        for legacy in ("size_average", "reduce"):
            if arguments.pop(legacy, None) is not None:
                raise SequenceParallelError(f"{label}: the deprecated `{legacy}` argument is not supported")
        target = arguments["target"]
        node.args, node.kwargs = (), {**arguments, "reduction": "sum"}
        denominator = None
        if reduction == "mean":
            full_target = ctx.full_of.get(target, target)
            ignore = arguments.get("ignore_index", -100)
            valid = ctx.emit(node, torch.ne, (full_target, ignore))
            denominator = ctx.emit(node, torch.sum, (valid,))
    else:
        source = node.args[0]
        node.replace_input_with(source, real_part(ctx, source, before=node))  # padded positions add nothing
        reduced = _reduced_dims(node, ctx.current[source].dim())
        denominator = None
        if node.target in _MEANS:
            denominator = math.prod(ctx.original[source].shape[d] for d in reduced)
            node.target = "sum" if node.op == "call_method" else torch.sum
    node.meta["example_value"] = ctx.current[node] = ctx.run(node)
    with ctx.graph.inserting_after(node):
        total = ctx.graph.create_node("call_function", ALL_REDUCE, (node, ctx.group_name))
    total.meta["example_value"] = ctx.current[total] = ctx.run(total)
    result = total
    if denominator is not None:
        with ctx.graph.inserting_after(total):
            result = ctx.graph.create_node("call_function", torch.div, (total, denominator))
        result.meta["example_value"] = ctx.current[result] = ctx.run(result)
    for user in users:
        user.replace_input_with(node, result)
