"""The host optimizer's step overlapped with backward: each parameter is stepped on the CPU as soon as its gradient
has reached host memory, while the device runs the rest of backward; `HostOptimizer.step` then validates.

Speculation, then validation (SuperOffload's scheme, DeepSpeed `runtime/superoffload`), kept exact: before a
parameter's early step its master and its optimizer state are copied aside (host memory, allocated once); at
`step()` a gradient that was not changed since it was streamed (same tensor, same version counter) keeps its early
step, one that was (clipped in place, accumulated again, changed by hand) and any step taken under other
hyper-parameters than `step()` sees are rolled back from the copy and stepped again. So the parameters are the
plain step's, bit for bit, whatever happens between backward and `step()`. Clipping that leaves the gradients as
they are (`autosp.training.gradients.clip_grad_norm_` under its threshold) rolls nothing back.

Only the backward passes run inside `HostOptimizer.overlapping()` step early (the last micro-batch's: with gradient
accumulation the earlier ones must not). One worker thread steps, in the order the gradients arrive; on CUDA it
waits for each gradient's copy (an event on the copy's side stream). The device parameters are written by `step()`
only, after backward has finished reading them.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class EarlySteps:
    """The early steps of one host optimizer: the worker, the copies aside, what each early step used."""

    def __init__(self, inner: torch.optim.Optimizer, region: Callable[[], Any]) -> None:
        self.inner = inner
        self.region = region  # the host-memory region every host allocation is made in (`host_optimizer.host_region`)
        self.active = False
        self.hyper: list[dict[str, Any]] = []  # the inner groups' hyper-parameters the early steps use
        self._worker: ThreadPoolExecutor | None = None
        self._pending: dict[int, tuple[Future, torch.Tensor]] = {}  # id(p) -> (its early step, its master)
        self._aside: dict[int, tuple[torch.Tensor, dict[str, Any], bool]] = {}  # id(master) -> copies, had state
        self.rolled_back = 0  # of the last step's early steps, those rolled back and taken again

    def begin(self, hyper: list[dict[str, Any]]) -> None:
        for group, values in zip(self.inner.param_groups, hyper, strict=True):
            group.update(values)
        self.hyper, self.active = hyper, True
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autosp-host-step")

    def submit(self, p: torch.nn.Parameter, master: torch.Tensor, grad: torch.Tensor,
               ready: torch.cuda.Event | None) -> None:
        """Step `master` with host gradient `grad` on the worker (once per parameter per step)."""
        if id(p) in self._pending:  # accumulated twice inside `overlapping()`: its version says so at step()
            return
        self._pending[id(p)] = (self._worker.submit(self._step_one, master, grad, ready), master)

    def _step_one(self, master: torch.Tensor, grad: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            ready.synchronize()  # the gradient's copy to host memory has landed
        self._put_aside(master)
        master.grad = grad
        try:
            with torch.no_grad(), self.region():
                self.inner.step()  # every other master has no gradient now: only this one moves
        finally:
            master.grad = None

    def _put_aside(self, master: torch.Tensor) -> None:
        """Copy `master` and its optimizer state aside (buffers reused from step to step)."""
        state = self.inner.state.get(master, {})
        old = self._aside.get(id(master))
        with self.region():
            master_copy = old[0] if old is not None else torch.empty_like(master)
            buffers = old[1] if old is not None else {}
            copies = {k: (buffers[k] if k in buffers and buffers[k].shape == v.shape and buffers[k].dtype == v.dtype
                          else torch.empty_like(v)) if torch.is_tensor(v) else v for k, v in state.items()}
        master_copy.copy_(master)
        for key, value in state.items():
            if torch.is_tensor(value):
                copies[key].copy_(value)
        self._aside[id(master)] = (master_copy, copies, bool(state))

    def finish(self, hyper: list[dict[str, Any]], keeps: Callable[[int], bool]) -> set[int]:
        """Wait for every early step; roll back those `keeps(id(p))` rejects (or all, if the hyper-parameters
        changed since `begin`). Returns the ids of the parameters whose early step stands."""
        self.active = False
        pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            future.result()  # an error of the worker is the step's error
        same = _same(hyper, self.hyper)
        kept, self.rolled_back = set(), 0
        for pid, (_, master) in pending.items():
            if same and keeps(pid):
                kept.add(pid)
            else:
                self._roll_back(master)
                self.rolled_back += 1
        return kept

    def _roll_back(self, master: torch.Tensor) -> None:
        copy, state, had_state = self._aside[id(master)]
        with torch.no_grad():
            master.copy_(copy)
            if not had_state:  # its first step: no state before it
                self.inner.state.pop(master, None)
                return
            current = self.inner.state[master]
            for key, value in state.items():
                if torch.is_tensor(value):
                    current[key].copy_(value)
                else:
                    current[key] = value

    def host_bytes(self) -> int:
        """Bytes of the copies aside (one master and its state per parameter stepped early)."""
        return sum(c.numel() * c.element_size() + sum(v.numel() * v.element_size() for v in s.values()
                                                        if torch.is_tensor(v)) for c, s, _ in self._aside.values())


def _same(a: Any, b: Any) -> bool:
    """Equal hyper-parameters (lists and dicts of numbers, tuples, tensors: an LR may be a tensor)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b
