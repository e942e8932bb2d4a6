"""Custom ops for what a rank's shard of a causal sequence op needs from the ranks before it.

`from_previous_rank` brings rank r-1's tensor to rank r (zeros on rank 0): the halo of a short causal convolution.
Its gradient goes back the other way (`to_previous_rank`). A linear recurrence passes its shards' states along the
ranks with it (`autosp.compiler.sp`'s recurrences). Both are all-gathers of small tensors (k-1 tokens, one state),
so they work on every backend (gloo included); every rank calls them, rank 0 and the last rank included.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autosp.comm.library import custom_op, op
from autosp.comm.transients import declare_transient_bytes, nbytes


def _all_gathered(x: torch.Tensor, group_size: int, group_name: str) -> tuple[torch.Tensor, int]:
    """([group_size, *x.shape] of every rank's `x`, this rank's index in the group)."""
    group = _resolve_process_group(group_name)
    out = x.new_empty(group_size * x.numel())
    dist.all_gather_single(out, x.contiguous().view(-1), group=group)
    return out.view(group_size, *x.shape), dist.get_rank(group)


def _shifted(x: torch.Tensor, group_size: int, group_name: str, offset: int) -> torch.Tensor:
    gathered, rank = _all_gathered(x, group_size, group_name)
    source = rank + offset
    return gathered[source].clone() if 0 <= source < group_size else x.new_zeros(x.shape)


@custom_op("from_previous_rank", mutates_args=())
def from_previous_rank(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Rank r-1's `x` on rank r; zeros on rank 0 (nothing precedes the first shard)."""
    return _shifted(x, group_size, group_name, -1)


@custom_op("to_previous_rank", mutates_args=())
def to_previous_rank(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Rank r+1's `x` on rank r; zeros on the last rank: the gradient of `from_previous_rank`."""
    return _shifted(x, group_size, group_name, 1)


# contiguous, as the kernels return them, whatever `x`'s layout (a causal convolution's halo is a narrow of a
# transposed activation): Inductor asserts the kernels' strides against these
@from_previous_rank.register_fake
def _from_previous_rank_fake(x, group_size, group_name):
    return x.new_empty(x.shape)


@to_previous_rank.register_fake
def _to_previous_rank_fake(x, group_size, group_name):
    return x.new_empty(x.shape)


@declare_transient_bytes(op("from_previous_rank"))
def _from_previous_rank_scratch(x, group_size, group_name):
    return group_size * nbytes(x)  # every rank's tensor, gathered


@declare_transient_bytes(op("to_previous_rank"))
def _to_previous_rank_scratch(x, group_size, group_name):
    return group_size * nbytes(x)


def _from_previous_rank_backward(ctx, grad):
    return to_previous_rank(grad, ctx.group_size, ctx.group_name), None, None


def _to_previous_rank_backward(ctx, grad):
    return from_previous_rank(grad, ctx.group_size, ctx.group_name), None, None


def _group_setup(ctx, inputs, output):
    _, ctx.group_size, ctx.group_name = inputs


from_previous_rank.register_autograd(_from_previous_rank_backward, setup_context=_group_setup)
to_previous_rank.register_autograd(_to_previous_rank_backward, setup_context=_group_setup)
