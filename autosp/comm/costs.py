"""What an opaque op costs the time model (`autosp.experiments.simulate.clock`), declared next to its kernel.

The clock sees a custom op as one call: a recurrence's chunked scan (`autosp.compiler.sp.recurrence`) would be priced
by the bytes of its inputs and outputs alone, though its kernel runs chunk-by-chunk matmuls inside. Each such op
declares its cost as a function of its arguments: `("matmul", flops)` at the matmul rate, or `("memory", bytes)`
for an element-wise kernel bound by the bytes it moves (`@declare_cost(op("ssd_scan"))`). Backward kernels that
re-run their forward under autograd cost that forward plus its backward (2x: each matmul's two gradients).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

CostFn = Callable[..., tuple[str, float]]
#: a backward that re-runs the forward under autograd: the forward, then twice its work for the gradients
RERUN_BACKWARD_FACTOR = 3.0

_DECLARED: dict[Any, CostFn] = {}


def declare_cost(op: Any) -> Callable[[CostFn], CostFn]:
    """Register `fn(*args, **kwargs) -> (op class, quantity)` as what `op` (an op or its overload packet) costs."""

    def register(fn: CostFn) -> CostFn:
        _DECLARED[getattr(op, "overloadpacket", op)] = fn
        return fn

    return register


def declared_cost(func: Any, args: tuple, kwargs: dict) -> tuple[str, float] | None:
    """(op class, quantity) `func` declared for these arguments, or None."""
    fn = _DECLARED.get(getattr(func, "overloadpacket", func))
    return None if fn is None else fn(*args, **kwargs)
