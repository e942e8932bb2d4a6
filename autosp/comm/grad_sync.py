"""Backend `eager` only (no joint graph to put gradient buckets into, `autosp.compiler.zero.grad_buckets`): each
parameter's gradient summed over the ranks sharing it in a tensor hook, before autograd accumulates it into
`.grad`, and divided by the data-parallel degree. A debugging path: one blocking collective per parameter."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

_SYNCED_ATTR = "_autosp_grad_sync"


def sync_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup, dp_size: int = 1) -> int:
    """`inner="eager"` only (no joint graph): sum each parameter's gradient over `group` in a tensor hook, before it
    is accumulated into `.grad`, and divide by `dp_size`. Idempotent per parameter; returns how many hooks were
    added."""
    added = 0
    for p in params:
        if p.requires_grad and not getattr(p, _SYNCED_ATTR, False):
            p.register_hook(_make_hook(group, dp_size))
            setattr(p, _SYNCED_ATTR, True)
            added += 1
    return added


def _make_hook(group: dist.ProcessGroup, dp_size: int):
    def reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        return grad.div_(dp_size) if dp_size > 1 else grad

    return reduce
