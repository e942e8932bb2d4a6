"""Bytes an opaque op allocates and frees inside itself: the scratch a graph's liveness replay cannot see.

The budgeted SAC planner (``autosp.compiler.sac_auto``) estimates a step's peak by replaying the partitioned
graphs node by node from the fake values' shapes. A custom op is one node whose output is all the replay sees,
but its kernel may hold more while it runs: the all-to-all's send and receive buffers, one loss tile's logits
and their log-softmax. Measured on the CPU profiler (2 ranks, tiny, 512 tokens, tiled loss), those buffers
were the whole 22% the replay was short, and the step peaked inside the tiled loss's backward.

So each op that has such scratch declares it here, next to its kernel, as a function of the op's arguments
(fake tensors in place of nodes): ``@declare_transient_bytes(torch.ops.autosp.all_to_all)``. The replay adds
that many bytes while the node runs, on top of its inputs and outputs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

TransientFn = Callable[..., int]

_DECLARED: dict[Any, TransientFn] = {}


def declare_transient_bytes(op: Any) -> Callable[[TransientFn], TransientFn]:
    """Register `fn(*args)` as the scratch bytes `op` (an op or its overload packet) holds while it runs."""

    def register(fn: TransientFn) -> TransientFn:
        _DECLARED[getattr(op, "overloadpacket", op)] = fn
        return fn

    return register


def numel(value: torch.Tensor) -> int:
    """Elements of a (fake) tensor, symbolic sizes by their hint."""
    total = 1
    for d in value.shape:
        total *= d if isinstance(d, int) else int(d.node.hint if d.node.has_hint() else d.node.size_hint())
    return total


def nbytes(value: torch.Tensor) -> int:
    return numel(value) * value.element_size()


def _fake(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_fake(a) for a in arg)
    return arg


def transient_bytes(node: fx.Node) -> int:
    """Scratch bytes `node`'s op declared for these arguments; 0 for an op that declared none."""
    if node.op != "call_function":
        return 0
    fn = _DECLARED.get(getattr(node.target, "overloadpacket", node.target))
    if fn is None:
        return 0
    return int(fn(*_fake(node.args), **{k: _fake(v) for k, v in node.kwargs.items()}))
