"""Custom ops for the collectives the SP pass inserts.

Each op carries a fake kernel (so aot_autograd and inductor can trace shapes without communicating) and an
autograd formula, so the backward graph gets the matching collective. The process group travels by name
(`ProcessGroup.group_name`) because custom-op schemas cannot take Python objects.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group


@torch.library.custom_op("autosp::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group_size: int, group_name: str) -> torch.Tensor:
    """Split `x` into `group_size` chunks along `scatter_dim`, send chunk i to rank i, and concatenate the
    chunks received along `gather_dim` in rank order. Ulysses uses it as [B,H,S/P,D] -> [B,H/P,S,D] and back."""
    chunks = torch.stack(x.chunk(group_size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=_resolve_process_group(group_name))
    return torch.cat(received.unbind(0), dim=gather_dim)


@all_to_all.register_fake
def _all_to_all_fake(x, scatter_dim, gather_dim, group_size, group_name):
    shape = list(x.shape)
    if shape[scatter_dim] % group_size:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {shape[scatter_dim]} not divisible by {group_size}")
    shape[scatter_dim] //= group_size
    shape[gather_dim] *= group_size
    return x.new_empty(shape)


def _all_to_all_backward(ctx, grad):
    # The inverse exchange: scatter what was gathered, gather what was scattered.
    return all_to_all(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group_size, ctx.group_name), None, None, None, None


def _all_to_all_setup(ctx, inputs, output):
    _, ctx.scatter_dim, ctx.gather_dim, ctx.group_size, ctx.group_name = inputs


all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


@torch.library.custom_op("autosp::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of `x` over the group, returned on every rank.

    Its gradient is the identity: it turns each rank's partial loss (a sum over its own tokens) into the global
    loss, and each rank then back-propagates only through its own tokens; the parameter-gradient all-reduce after
    backward adds the ranks' contributions. (Summing the gradient here too would count every token P times.)"""
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_resolve_process_group(group_name))
    return out


@all_reduce_sum.register_fake
def _all_reduce_sum_fake(x, group_name):
    return torch.empty_like(x)


def _all_reduce_sum_backward(ctx, grad):
    return grad, None


all_reduce_sum.register_autograd(_all_reduce_sum_backward)
