"""Pure-PyTorch zigzag RingAttention against single-process causal SDPA: forward and backward, GQA, 2 and 4 ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autosp.comm.ring_attention import (
    math_block_backward,
    math_block_forward,
    zigzag_positions,
    zigzag_ring_attention,
)
from tests.baselines.gloo import run_ranks


def _reference(dtype: torch.dtype, heads: int, kv_heads: int, seq: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, 16, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, 16, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, 16, generator=g, dtype=dtype, requires_grad=True)
    dout = torch.randn(2, heads, seq, 16, generator=g, dtype=dtype)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return q, k, v, dout, out


def _check_ring(rank: int, world: int, dtype: torch.dtype, heads: int, kv_heads: int, tol: float) -> None:
    seq = 32 * world
    q, k, v, dout, out = _reference(dtype, heads, kv_heads, seq)
    idx = zigzag_positions(seq, world, rank)
    local = [t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    local_out = zigzag_ring_attention(*local, dist.group.WORLD)
    local_out.backward(dout[:, :, idx])
    torch.testing.assert_close(local_out, out.detach()[:, :, idx], rtol=tol, atol=tol)
    for mine, full in zip(local, (q, k, v), strict=True):
        torch.testing.assert_close(mine.grad, full.grad[:, :, idx], rtol=tol, atol=tol)


def _check_rings(rank: int, world: int) -> None:
    _check_ring(rank, world, torch.float32, 8, 4, 1e-5)  # GQA
    if world == 2:  # MHA in fp64, in the same launch (starting ranks costs more than a check)
        _check_ring(rank, world, torch.float64, 4, 4, 1e-12)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_sdpa_fp32_gqa_and_on_two_ranks_fp64_mha(world: int) -> None:
    run_ranks(world, _check_rings)


def test_zigzag_positions_cover_sequence_once_and_balance_work() -> None:
    shards = [zigzag_positions(64, 4, r) for r in range(4)]
    assert torch.equal(torch.sort(torch.cat(shards)).values, torch.arange(64))
    causal_work = [int((s + 1).sum()) for s in shards]  # keys each query attends to
    assert len(set(causal_work)) == 1


@pytest.mark.parametrize("causal", [True, False])
def test_math_block_matches_cpu_flash_kernel(causal: bool) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 2, 24, 8, generator=g, dtype=torch.float64) for _ in range(4))
    out, lse = math_block_forward(q, k, v, causal, 0.3)
    ref_out, ref_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=0.3)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    grads = math_block_backward(dout, q, k, v, out, lse, causal, 0.3)
    ref_grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, ref_out, ref_lse, 0.0, causal, scale=0.3
    )
    for mine, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, ref)
