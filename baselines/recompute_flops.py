"""FLOPs of the forward ops an eager method re-runs in backward (per-layer activation checkpointing, DeepSpeed's
TiledMLP), counted as the memory planner counts its own recompute (`autosp.compiler.memory.planner.recompute_flops`):
torch's flop formulas per op, attention as 4·B·H·S_q·S_k·D (not halved for a causal mask), so that a record of
`alst` and one of `autosp --sac auto` compare by the same rule. Element-wise ops count nothing here (the planner
counts one per element where torch has no formula), which leaves this count the lower of the two for the same ops.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count


def _cpu_flash_attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                               **kwargs: Any) -> int:
    """The flop counter's SDPA formula for the CPU flash kernel, which torch's registry lacks."""
    return sdpa_flop_count(query.shape, key.shape, value.shape)


_FORMULAS = {**flop_registry,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops}


class _FlopCount(TorchDispatchMode):
    """Adds each op's FLOPs (where a formula exists) to `flops`."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FORMULAS.get(func.overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


class RecomputeCounter:
    """Counts the FLOPs of wrapped forward functions when they run inside autograd's backward (a checkpointed
    layer's re-run, TiledMLP's per-shard re-run); a call in forward, or nested in a counted call, adds nothing.
    `flops` is the sum since the last `start(shape)` (one step's, read after it). A step at a shape already counted
    keeps that count and runs without the counting mode: the same program re-runs the same ops, and a timed step
    is then the method's own (the mode's Python on every op is the harness's)."""

    def __init__(self) -> None:
        self.flops = 0
        self._counting = False
        self._known: dict[object, int] = {}  # shape -> the count of a finished step at it
        self._shape: object = None
        self._frozen = True  # before the first `start`, nothing is counted

    def start(self, shape: object) -> None:
        """A step at `shape` begins: counted if no step at its shape was, else given that step's count."""
        if not self._frozen:  # the step before was counted, and has finished
            self._known[self._shape] = self.flops
        self._shape, self._frozen = shape, shape in self._known
        self.flops = self._known.get(shape, 0)

    def wrap(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._frozen or self._counting or torch._C._current_graph_task_id() == -1:  # -1: not in backward
                return fn(*args, **kwargs)
            self._counting, count = True, _FlopCount()
            try:
                with count:
                    return fn(*args, **kwargs)
            finally:  # also when non-reentrant checkpointing stops the re-run early: what ran is counted
                self.flops += count.flops
                self._counting = False

        return counted
