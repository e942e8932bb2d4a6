"""The gradient all-reduce that completes sequence parallelism.

Each SP rank back-propagates only through its own tokens, so a parameter's gradient is the sum of the ranks'
gradients; data-parallel replicas (each averaging its own batch) are averaged. The reduction runs in a tensor hook,
i.e. on the gradient *before* it is accumulated into `.grad`, so gradient accumulation over several backward calls
stays exact.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

_SYNCED_ATTR = "_autosp_grad_sync"


def sync_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup, dp_size: int = 1) -> int:
    """Sum each parameter's gradient over `group` (all SP x DP ranks that hold it) and divide by `dp_size`.

    Idempotent per parameter: recompiling a model does not add a second hook. Returns how many hooks were added."""
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
