"""RingAttention in pure PyTorch: zigzag (or contiguous) ring with an exact backward.

The algorithm of ring-flash-attn's `zigzag_ring_flash_attn_func`, written for any device so it runs where
flash-attn cannot (CPU, fp32) and stays fp32-exact:

* Zigzag layout: the sequence is cut into 2P chunks; SP rank r holds chunks r and 2P-1-r, so every rank has
  the same amount of causal work (`zigzag_positions`).
* Forward: K/V blocks (with the KV head count, GQA is expanded only inside a block) travel around the ring by
  P2P (`batch_isend_irecv`); each block's partial attention (out, log-sum-exp) is merged by online softmax.
  Step 0 is the causal local block; a block from an earlier rank is seen by all local queries but only its
  first chunk is visible; a block from a later rank is seen only by the second local chunk, in full.
* Contiguous layout (rank r holds the r-th block; what the compiler's hybrid Ulysses x Ring uses, so its shards
  stay plain ranges): earlier blocks are seen in full, later ones not at all (no load balancing), and
  non-causal attention sees every block.
* Backward: a custom autograd.Function recomputes each block's gradient from the final out / log-sum-exp
  (flash-attention style); dQ stays local, dK/dV accumulators travel around the ring with their K/V block and
  arrive back at their owner after P hops.

Layout: [batch, heads, local_seq, head_dim] (the model's SDPA layout); K/V may have fewer heads (GQA).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autosp.comm.library import custom_op


def zigzag_positions(seq_len: int, sp_size: int, sp_rank: int, device: torch.device | str = "cpu") -> Tensor:
    """Global token positions held by `sp_rank`: chunks r and 2P-1-r of 2P equal chunks, in that order."""
    if seq_len % (2 * sp_size):
        raise ValueError(f"zigzag sharding needs seq_len ({seq_len}) divisible by 2 * sp_size ({2 * sp_size})")
    chunk = seq_len // (2 * sp_size)
    first = torch.arange(sp_rank * chunk, (sp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * sp_size - 1 - sp_rank) * chunk, (2 * sp_size - sp_rank) * chunk, device=device)
    return torch.cat([first, second])


# ---- one block of attention: (out, lse) forward and its flash-style backward ---------------------------------


def _expand_kv(kv: Tensor, num_heads: int) -> Tensor:
    groups = num_heads // kv.shape[1]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _reduce_kv_grad(grad: Tensor, num_kv_heads: int) -> Tensor:
    b, h, s, d = grad.shape
    return grad if h == num_kv_heads else grad.view(b, num_kv_heads, h // num_kv_heads, s, d).sum(2)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial outputs and log-sum-exps are merged in at least fp32."""
    return torch.promote_types(dtype, torch.float32)


def block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of q over one K/V block: (out, lse [B, H, Sq]); the CPU flash kernel on CPU, math elsewhere."""
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    if q.device.type == "cpu":  # O(block) memory and it returns the log-sum-exp
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(accumulator_dtype(q.dtype))
    return math_block_forward(q, k, v, causal, scale)


def block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *final* out and lse of these query rows (dK/dV with the KV head count)."""
    num_kv_heads = k.shape[1]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    else:
        dq, dk, dv = math_block_backward(dout, q, k, v, out, lse, causal, scale)
    return dq, _reduce_kv_grad(dk, num_kv_heads), _reduce_kv_grad(dv, num_kv_heads)


def math_block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Device-generic block attention (q, k, v with equal heads), computed in the accumulator dtype."""
    acc = accumulator_dtype(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_future(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.to(acc))
    return out.to(q.dtype), lse


def math_block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Flash-attention backward in plain matmuls: P = exp(S - lse), dS = P * (dP - rowsum(dO * O))."""
    acc = accumulator_dtype(q.dtype)
    qa, ka, va, douta = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    scores = torch.matmul(qa, ka.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_future(q.shape[2], k.shape[2], q.device), float("-inf"))
    probs = torch.exp(scores - lse[..., None])
    dv = torch.matmul(probs.transpose(-1, -2), douta)
    dprobs = torch.matmul(douta, va.transpose(-1, -2))
    delta = (douta * out.to(acc)).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq, dk = torch.matmul(dscores, ka), torch.matmul(dscores.transpose(-1, -2), qa)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def _future(sq: int, sk: int, device: torch.device) -> Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets (fp32 accumulators)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = (out * torch.exp(lse - new_lse)[..., None]
           + block_out.to(out.dtype) * torch.exp(block_lse - new_lse)[..., None])
    return out, new_lse


# ---- the ring -----------------------------------------------------------------------------------------------


class _Ring:
    """Send to the next SP rank, receive from the previous one (global ranks resolved once)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: list[Tensor]) -> tuple[list[Tensor], list]:
        """Post sends of `tensors` to next and receives of same-shaped tensors from prev; returns (recv, works)."""
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for work in works:
            work.wait()


def _block_plan(step: int, source: int, rank: int, half: int, zigzag: bool, causal: bool) -> tuple | None:
    """(query rows, key rows, causal) of the block this rank computes at `step` against `source`'s K/V, or None.

    Contiguous layout (rank r holds the r-th of P blocks): an earlier rank's block is seen in full, a later one not
    at all. Zigzag layout: see the module docstring."""
    every = slice(None)
    if not causal:
        return every, every, False
    if step == 0:
        return every, every, True
    if zigzag:
        return (every, slice(None, half), False) if source < rank else (slice(half, None), every, False)
    return (every, every, False) if source < rank else None


def _with_rows(full: Tensor, rows: slice, part: Tensor) -> Tensor:
    """`full` with its query rows `rows` (all, or a suffix) replaced by `part`."""
    return torch.cat([full[:, :, : rows.start or 0], part], dim=2)


def ring_forward(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float, zigzag: bool,
                 causal: bool) -> tuple[Tensor, Tensor]:
    """(out, lse [B, H, S_local]) of attention over the K/V blocks of every rank of the ring."""
    ring = _Ring(group)
    half = q.shape[2] // 2
    acc = accumulator_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    k_cur, v_cur = k, v
    for step in range(ring.size):
        if step + 1 < ring.size:
            (k_next, v_next), works = ring.start([k_cur, v_cur])
        plan = _block_plan(step, (ring.rank - step) % ring.size, ring.rank, half, zigzag, causal)
        if plan is not None:
            rows, keys, block_causal = plan
            block = block_forward(q[:, :, rows], k_cur[:, :, keys], v_cur[:, :, keys], block_causal, scale)
            merged_out, merged_lse = _merge(out[:, :, rows], lse[:, :, rows], *block)
            out, lse = _with_rows(out, rows, merged_out), _with_rows(lse, rows, merged_lse)
        if step + 1 < ring.size:
            ring.wait(works)
            k_cur, v_cur = k_next, v_next
    return out.to(q.dtype), lse


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  group: dist.ProcessGroup, scale: float, zigzag: bool, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv): dQ stays local, dK/dV accumulators travel with their K/V block back to its owner."""
    ring = _Ring(group)
    half = q.shape[2] // 2
    dout = dout.contiguous()
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_cur, v_cur = k, v
    dk_acc = dv_acc = None  # gradient of the K/V block held now, summed over the ranks it has visited
    acc_works: list = []
    for step in range(ring.size):
        if step + 1 < ring.size:
            (k_next, v_next), kv_works = ring.start([k_cur, v_cur])
        dk_blk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_blk = torch.zeros(v.shape, dtype=acc, device=v.device)
        plan = _block_plan(step, (ring.rank - step) % ring.size, ring.rank, half, zigzag, causal)
        if plan is not None:
            rows, keys, block_causal = plan
            dq_p, dk_p, dv_p = block_backward(dout[:, :, rows], q[:, :, rows], k_cur[:, :, keys], v_cur[:, :, keys],
                                              out[:, :, rows], lse[:, :, rows], block_causal, scale)
            dq[:, :, rows] += dq_p
            dk_blk[:, :, keys] += dk_p
            dv_blk[:, :, keys] += dv_p
        if dk_acc is not None:  # the accumulator for this block arrived from the previous rank
            ring.wait(acc_works)
            dk_blk += dk_acc
            dv_blk += dv_acc
        (dk_acc, dv_acc), acc_works = ring.start([dk_blk, dv_blk])
        if step + 1 < ring.size:
            ring.wait(kv_works)
            k_cur, v_cur = k_next, v_next
    ring.wait(acc_works)  # after P hops each accumulator is back at the rank owning its K/V
    return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float, zigzag: bool,
                causal: bool) -> Tensor:
        out, lse = ring_forward(q, k, v, group, scale, zigzag, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.zigzag, ctx.causal = group, scale, zigzag, causal
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ring_backward(dout, q, k, v, out, lse, ctx.group, ctx.scale, ctx.zigzag, ctx.causal)
        return *grads, None, None, None, None


def zigzag_ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Causal attention of zigzag-sharded q/k/v ([B, H, S/P, D], K/V may have fewer heads) over the whole ring."""
    if q.shape[2] % 2:
        raise ValueError(f"zigzag ring attention needs an even local length, got {q.shape[2]}")
    return _RingAttention.apply(q, k, v, group, 1.0 / math.sqrt(q.shape[-1]), True, True)


# ---- the compiler's ring: custom ops (contiguous layout), ring-flash-attn on CUDA in bf16/fp16 -------------------


def _flash_ring():
    """ring-flash-attn's forward/backward when it can run here (CUDA, flash-attn installed), else None."""
    try:
        from ring_flash_attn.ring_flash_attn import ring_flash_attn_backward, ring_flash_attn_forward
    except ImportError:
        return None
    return ring_flash_attn_forward, ring_flash_attn_backward


def _uses_flash(q: Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _flash_ring() is not None


@custom_op("ring_attention", mutates_args=())
def ring_attention_op(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
                      group_name: str) -> tuple[Tensor, Tensor]:
    """(out, lse) of attention of contiguous sequence blocks [B, H, S/R, D] over the ring `group_name`."""
    group = _resolve_process_group(group_name)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the model's transposed projections, without a2a
    if _uses_flash(q):  # [B, S, H, D] for flash-attn; it takes K/V with fewer heads as they are
        forward, _ = _flash_ring()
        out, lse = forward(group, q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
                           softmax_scale=scale, causal=causal)
        return out.transpose(1, 2).contiguous(), lse.float().contiguous()
    return ring_forward(q, k, v, group, scale, False, causal)


@ring_attention_op.register_fake
def _ring_attention_fake(q, k, v, scale, causal, group_name):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=accumulator_dtype(q.dtype))  # contiguous, as real


@custom_op("ring_attention_backward", mutates_args=())
def ring_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                               causal: bool, group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    group = _resolve_process_group(group_name)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if _uses_flash(q):
        _, backward = _flash_ring()
        bshd = [t.transpose(1, 2).contiguous() for t in (dout, q, k, v, out)]
        grads = backward(group, *bshd, lse, softmax_scale=scale, causal=causal)
        return tuple(g.to(t.dtype).transpose(1, 2).contiguous() for g, t in zip(grads, (q, k, v), strict=True))
    return ring_backward(dout, q, k, v, out, lse, group, scale, False, causal)


@ring_attention_backward_op.register_fake
def _ring_attention_backward_fake(dout, q, k, v, out, lse, scale, causal, group_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_setup(ctx, inputs, output):
    q, k, v, ctx.scale, ctx.causal, ctx.group_name = inputs
    ctx.save_for_backward(q, k, v, *output)


def _ring_backward_formula(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward_op(dout, q, k, v, out, lse, ctx.scale, ctx.causal, ctx.group_name)
    return dq, dk, dv, None, None, None


ring_attention_op.register_autograd(_ring_backward_formula, setup_context=_ring_setup)
