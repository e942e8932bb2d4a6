"""The collective custom ops on 2 gloo ranks: values, gradients, and torch.library's own consistency checks."""
from __future__ import annotations

import torch
import torch.distributed as dist

import autosp.comm  # noqa: F401
from autosp.harness.launch import launch


def _all_to_all_rank() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    full = torch.arange(2 * 4 * 6 * 3, dtype=torch.float64).reshape(2, 4, 6, 3)  # [B, H, S, D]
    shard = full.chunk(world, dim=2)[rank].clone().requires_grad_()  # this rank's S/P positions, all heads
    gathered = torch.ops.autosp_sp.all_to_all(shard, 1, 2, world, group)  # -> this rank's heads, all positions
    assert torch.equal(gathered, full.chunk(world, dim=1)[rank])
    weight = torch.randn(gathered.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    (gathered * weight).sum().backward()
    # d/d(shard) of sum_r <a2a(shard)_r, w_r>: the weights of every rank for this rank's positions
    weights = [torch.empty_like(weight) for _ in range(world)]
    dist.all_gather(weights, weight)
    expected = torch.cat(weights, dim=1).chunk(world, dim=2)[rank]
    assert torch.equal(shard.grad, expected)
    torch.library.opcheck(torch.ops.autosp_sp.all_to_all.default, (shard.detach(), 1, 2, world, group))


def _all_reduce_rank() -> None:
    rank = dist.get_rank()
    x = torch.tensor([1.0 + rank], requires_grad=True)
    total = torch.ops.autosp_sp.all_reduce_sum(x, dist.group.WORLD.group_name)
    assert total.item() == 3.0
    total.backward()
    assert x.grad.item() == 1.0  # identity: each rank back-propagates its own share only


def _ops_rank() -> None:
    _all_to_all_rank()
    _all_reduce_rank()


def test_all_to_all_values_and_gradient_and_all_reduce_sums_identity_gradient_on_two_ranks():
    """One launch for both ops (starting 2 ranks costs more than either check)."""
    outcome = launch(_ops_rank, world_size=2, timeout_s=120)
    assert outcome.status == "ok", outcome.traceback
