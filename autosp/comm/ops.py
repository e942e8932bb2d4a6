"""Custom ops (`autosp_sp::`, `autosp.comm.library`) for the collectives the SP pass inserts.

Each op carries a fake kernel (so aot_autograd and inductor can trace shapes without communicating) and an
autograd formula, so the backward graph gets the matching collective. The process group travels by name
(`ProcessGroup.group_name`) because custom-op schemas cannot take Python objects.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autosp.comm.library import custom_op, op
from autosp.comm.transients import declare_transient_bytes, nbytes


@custom_op("all_to_all", mutates_args=())
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


@declare_transient_bytes(op("all_to_all"))
def _all_to_all_scratch(x, scatter_dim, gather_dim, group_size, group_name):
    return 2 * nbytes(x)  # the stacked chunks sent and the chunks received, alive while the output is made


def _all_to_all_backward(ctx, grad):
    # The inverse exchange: scatter what was gathered, gather what was scattered.
    return all_to_all(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group_size, ctx.group_name), None, None, None, None


def _all_to_all_setup(ctx, inputs, output):
    _, ctx.scatter_dim, ctx.gather_dim, ctx.group_size, ctx.group_name = inputs


all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


@custom_op("all_reduce_sum", mutates_args=())
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


@custom_op("all_gather_shard", mutates_args=())
def all_gather_shard(
    shard: torch.Tensor, group_size: int, group_name: str, dp_size: int, regather: bool, compute_dtype: torch.dtype
) -> torch.Tensor:
    """The full flat parameter from every rank's flat shard (ZeRO stages 2/3), cast to `compute_dtype` *before*
    the gather so mixed precision communicates in the compute dtype.

    Its gradient is the reduce-scatter of the full gradient, upcast to the shard's (master) dtype first so the
    reduction runs in fp32, summed over the group and divided by `dp_size` (data-parallel replicas are averaged,
    SP ranks' partial gradients summed). `regather` is read by the partitioner only: True (stage 3) re-runs this
    gather in backward instead of keeping the full parameter alive from forward to backward."""
    out = shard.new_empty(shard.numel() * group_size, dtype=compute_dtype)
    dist.all_gather_single(out, shard.to(compute_dtype).contiguous(), group=_resolve_process_group(group_name))
    return out


@all_gather_shard.register_fake
def _all_gather_shard_fake(shard, group_size, group_name, dp_size, regather, compute_dtype):
    return shard.new_empty(shard.numel() * group_size, dtype=compute_dtype)


def _all_gather_shard_backward(ctx, grad):
    shard_grad = reduce_scatter_sum(grad.to(ctx.master_dtype), ctx.group_size, ctx.group_name)
    if ctx.dp_size > 1:
        shard_grad = shard_grad / ctx.dp_size
    return shard_grad, None, None, None, None, None


def _all_gather_shard_setup(ctx, inputs, output):
    shard, ctx.group_size, ctx.group_name, ctx.dp_size, _, _ = inputs
    ctx.master_dtype = shard.dtype


all_gather_shard.register_autograd(_all_gather_shard_backward, setup_context=_all_gather_shard_setup)


@custom_op("reduce_scatter_sum", mutates_args=())
def reduce_scatter_sum(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Chunk i (of `group_size` equal chunks of the flat `x`) summed over the group, returned on rank i."""
    out = x.new_empty(x.numel() // group_size)
    dist.reduce_scatter_single(out, x.contiguous(), op=dist.ReduceOp.SUM, group=_resolve_process_group(group_name))
    return out


@reduce_scatter_sum.register_fake
def _reduce_scatter_sum_fake(x, group_size, group_name):
    if x.numel() % group_size:
        raise ValueError(f"reduce_scatter_sum: {x.numel()} elements not divisible by {group_size}")
    return x.new_empty(x.numel() // group_size)


@custom_op("all_gather_sequence", mutates_args=())
def all_gather_sequence(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    """Every rank's equal shard of `x` joined along `dim` in rank order: the full sequence of a value every rank
    needs whole (DeepSeek sparse attention's indexer keys and MLA's latent KV, `sp/attention/sparse`). Its gradient
    is the reduce-scatter along `dim`: each rank's part of the gradient, summed over the ranks that used it."""
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty(group_size * moved.shape[0], *moved.shape[1:])
    dist.all_gather_single(out, moved, group=_resolve_process_group(group_name))
    return out.movedim(0, dim).contiguous()


@all_gather_sequence.register_fake
def _all_gather_sequence_fake(x, dim, group_size, group_name):
    shape = list(x.shape)
    shape[dim] *= group_size
    return x.new_empty(shape)


@custom_op("reduce_scatter_sequence", mutates_args=())
def reduce_scatter_sequence(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    """This rank's chunk (of `group_size` along `dim`) of `x` summed over the group: `all_gather_sequence`'s
    gradient, and its own gradient is that gather."""
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty(moved.shape[0] // group_size, *moved.shape[1:])
    dist.reduce_scatter_single(out, moved, op=dist.ReduceOp.SUM, group=_resolve_process_group(group_name))
    return out.movedim(0, dim).contiguous()


@reduce_scatter_sequence.register_fake
def _reduce_scatter_sequence_fake(x, dim, group_size, group_name):
    shape = list(x.shape)
    if shape[dim] % group_size:
        raise ValueError(f"reduce_scatter_sequence: dim {dim} of size {shape[dim]} not divisible by {group_size}")
    shape[dim] //= group_size
    return x.new_empty(shape)


@declare_transient_bytes(op("all_gather_sequence"))
def _all_gather_sequence_scratch(x, dim, group_size, group_name):
    return (group_size + 1) * nbytes(x)  # this rank's shard made contiguous, and every rank's before the move back


@declare_transient_bytes(op("reduce_scatter_sequence"))
def _reduce_scatter_sequence_scratch(x, dim, group_size, group_name):
    return nbytes(x)  # the full gradient made contiguous along `dim`


def _all_gather_sequence_backward(ctx, grad):
    return reduce_scatter_sequence(grad, ctx.dim, ctx.group_size, ctx.group_name), None, None, None


def _reduce_scatter_sequence_backward(ctx, grad):
    return all_gather_sequence(grad, ctx.dim, ctx.group_size, ctx.group_name), None, None, None


def _sequence_setup(ctx, inputs, output):
    _, ctx.dim, ctx.group_size, ctx.group_name = inputs


all_gather_sequence.register_autograd(_all_gather_sequence_backward, setup_context=_sequence_setup)
reduce_scatter_sequence.register_autograd(_reduce_scatter_sequence_backward, setup_context=_sequence_setup)
