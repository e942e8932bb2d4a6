"""FLOPs of the ops of a graph (the memory planner's recompute cost and its time ranking's forward compute): torch's
flop counter where it has a formula, attention's own formula, else one per element; the counter's answers are kept by
op and argument shapes, since a deep model's layers repeat them."""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autosp.compiler.fx import getitem_source, is_attention_forward, node_nbytes, unwrap_rng


def recompute_flops(bw: fx.GraphModule) -> int:
    """FLOPs of the forward ops `bw` re-runs (`node_flops`)."""
    total = 0
    for node in bw.graph.nodes:
        # a random op recomputed in backward (attention with dropout's RNG state, under every recompute policy)
        # runs in the partitioner's RNG wrapper, a node of its own that carries no partitioner tag
        rerun = getattr(node.target, "__name__", "") == "run_with_rng_state"
        if node.op != "call_function" or (node.meta.get("partitioner_tag") != "is_forward" and not rerun):
            continue
        total += node_flops(node)
    return total


def node_flops(node: fx.Node) -> int:
    """FLOPs of one op: torch's flop counter where it has a formula, attention's own, else one per element."""
    from torch._inductor.fx_utils import count_flops_fx

    if node.target is operator.getitem or getitem_source(node) is not None:
        return 0
    if is_attention_forward(node):
        flops = _attention_flops(node)
    else:
        key = _flop_key(node)
        if key is None:
            flops = count_flops_fx(node)
        elif (flops := _COUNTED_FLOPS.get(key, -1)) == -1:
            flops = _COUNTED_FLOPS[key] = count_flops_fx(node)
    return flops if flops else node_nbytes(node) // max(1, _itemsize(node))


#: torch's flop counter by op and argument shapes (`_flop_key`): it runs the op on fake tensors, and a deep model's
#: graphs repeat the same ops and shapes in every layer
_COUNTED_FLOPS: dict[Any, int | None] = {}


def _flop_key(node: fx.Node) -> Any:
    """What torch's flop count of `node` depends on: its op and its arguments, each tensor by shape, stride and
    dtype; None where an argument is neither a tensor, a number nor a plain constant (not memoised)."""
    def key(arg: Any) -> Any:
        if isinstance(arg, fx.Node):
            val = arg.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise TypeError
            return (tuple(val.shape), tuple(val.stride()), val.dtype)
        if isinstance(arg, (list, tuple)):
            return tuple(map(key, arg))
        if arg is None or isinstance(arg, (bool, int, float, str, torch.dtype, torch.device, torch.layout)):
            return (type(arg), arg)
        raise TypeError

    try:
        found = (node.target, key(node.args), tuple((name, key(v)) for name, v in node.kwargs.items()))
        hash(found)  # a symbolic size does not hash
    except TypeError:
        return None
    return found


def _attention_flops(node: fx.Node) -> int:
    """4 B H S_q S_k D (QK^T and PV), the flop counter's SDPA formula, which lacks the CPU kernel."""
    _, args = unwrap_rng(node.target, node.args)
    query, key = [a.meta["val"] for a in args
                  if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)][:2]
    *batch_heads_sq, head_dim = query.shape
    numel = 1
    for d in batch_heads_sq:
        numel *= int(d)
    return 4 * numel * int(key.shape[-2]) * int(head_dim)


def _itemsize(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.element_size() if isinstance(val, torch.Tensor) else 1
