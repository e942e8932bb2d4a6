"""Bytes an opaque op allocates and frees inside itself: the scratch a graph's liveness replay cannot see.

The budgeted SAC planner (``autosp.compiler.memory.planner``) estimates a step's peak by replaying the partitioned
graphs node by node from the fake values' shapes. A custom op is one node whose output is all the replay sees,
but its kernel may hold more while it runs: the all-to-all's send and receive buffers, one loss tile's logits
and their log-softmax. Measured on the CPU profiler (2 ranks, tiny, 512 tokens, tiled loss), those buffers
were the whole 22% the replay was short, and the step peaked inside the tiled loss's backward.

So each op that has such scratch declares it here, next to its kernel, as a function of the op's arguments
(fake tensors in place of nodes): ``@declare_transient_bytes(op("all_to_all"))``. The replay adds
that many bytes while the node runs, on top of its inputs and outputs; so does the simulator's tracker
(``autosp.experiments.simulate.tracker``) while the op runs on fake tensors, where it runs only its fake kernel
(`declared_transient_bytes`): one registry for both.
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


def declared_transient_bytes(func: Any, args: tuple, kwargs: dict) -> int:
    """Scratch bytes op `func` declared for these (fake) arguments; 0 for an op that declared none."""
    fn = _DECLARED.get(getattr(func, "overloadpacket", func))
    return 0 if fn is None else int(fn(*args, **kwargs))


def transient_bytes(node: fx.Node) -> int:
    """Scratch bytes `node`'s op declared for its arguments' fake values; 0 for an op that declared none."""
    if node.op != "call_function":
        return 0
    return declared_transient_bytes(node.target, _fake(node.args), {k: _fake(v) for k, v in node.kwargs.items()})


# ------------------------------------------------------------------ aten's CPU flash attention (per-thread tiles)


def _cpu_flash_splits(query: torch.Tensor, key: torch.Tensor) -> tuple[int, int]:
    """The kernel's own query and key block sizes (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp)."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return q_split, min(512, kv_len)


@declare_transient_bytes(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_flash_forward_scratch(query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    """Per thread: one block of scores, the block's running max and sum, its fp32 output rows."""
    q_split, kv_split = _cpu_flash_splits(query, key)
    return torch.get_num_threads() * 4 * (q_split * kv_split + q_split * (2 + query.shape[-1]))


@declare_transient_bytes(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _cpu_flash_backward_scratch(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, *args: Any,
                                **kwargs: Any) -> int:
    """Per thread: a block of probabilities and of their gradient, the block's row sums; and an fp32 buffer of
    the query's size (measured: single process, 1 and 2 threads, 256-4096 tokens, exact to the byte)."""
    q_split, kv_split = _cpu_flash_splits(query, key)
    return torch.get_num_threads() * 4 * (2 * q_split * kv_split + q_split) + numel(query) * 4
