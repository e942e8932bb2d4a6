"""Gradient clipping by the whole model's norm when the gradients are ZeRO 2/3 shards."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autosp.api import SequenceParallelModule


def clip_grad_norm_(model: SequenceParallelModule, max_norm: float = math.inf) -> torch.Tensor:
    """Collective at ZeRO 2/3: the 2-norm of the whole model's gradient (each rank's shards' squares summed over the
    ranks sharing the parameters; a shard's padding has no gradient), every gradient then scaled by
    min(1, max_norm / (norm + 1e-6)) as `torch.nn.utils.clip_grad_norm_` does; returns the norm (before clipping).
    At stages 0/1 every rank holds the full gradients, and this is torch's clip. Under the threshold (a factor of 1)
    the gradients are left as they are rather than multiplied by 1, the same values, so a host optimizer's steps
    taken during backward stand (`autosp.comm.early_step`); reading that costs one scalar's synchronisation."""
    params = [p for p in model.parameters() if p.grad is not None]
    squares = torch.stack([p.grad.detach().float().pow(2).sum() for p in params]).sum()
    if model.zero >= 2 and dist.get_world_size(model.reduce_group) > 1:
        dist.all_reduce(squares, group=model.reduce_group)
    norm = squares.sqrt()
    if max_norm != math.inf and bool(max_norm / (norm + 1e-6) < 1):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
