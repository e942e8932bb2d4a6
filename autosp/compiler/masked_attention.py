"""`autosp::masked_attention`: attention under a mask given as O(S) rows and an elementwise program, never [S, S].

A structured mask (sliding window, packed documents, key padding, any mix of them) is a pointwise function
mask[b, h, q, kv] = program(rows), where each row varies along the query or the key positions only (positions,
document ids, a padding vector: O(S) each). The op takes the rows and the program (a JSON list of elementwise
instructions, see `run_program`) and computes attention one block of query rows at a time, building only that
block's [B, 1, rows, S] mask. Rows of softmax attention are independent, so this is exact.

Why this and not FlexAttention: torch 2.13's `flex_attention` raises "does not support backward on CPU", and
training needs backward; the dense SDPA kernels it would replace take a mask operand anyway. The op calls plain
`scaled_dot_product_attention` per block on every device (CPU flash, CUDA/ROCm memory-efficient kernels), so
the mask costs O(rows * S) instead of O(S^2); backward recomputes each block's probabilities from q, k and the
rows (plain tensor ops, any device), saving nothing of size S x S. FlexAttention's block-sparse
kernels, which also skip fully masked blocks, are the faster choice on CUDA once its mask_mod is generated from the
same program (left for a GPU-tested follow-up).
"""
from __future__ import annotations

import json
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK_ELEMENTS = 2**20  # scores per block of query rows (4 MiB in fp32)
MIN_ROWS = 16

_BINARY = {"le": torch.le, "lt": torch.lt, "ge": torch.ge, "gt": torch.gt, "eq": torch.eq, "ne": torch.ne,
           "and": torch.logical_and, "or": torch.logical_or, "add": torch.add, "sub": torch.sub}
_UNARY = {"not": torch.logical_not, "same": lambda x: x}
OPS = frozenset(_BINARY) | frozenset(_UNARY)


def run_program(program: str, rows: Sequence[Tensor]) -> Tensor:
    """Evaluate the mask program on `rows`. Each instruction is [op, operand...]; an operand is ["row", i],
    ["step", j] (the result of instruction j) or ["const", value]; the last instruction's result is the mask."""
    steps: list[Tensor] = []

    def operand(ref: list) -> Tensor | int | float | bool:
        kind, value = ref
        return rows[value] if kind == "row" else steps[value] if kind == "step" else value

    for op, *operands in json.loads(program):
        args = [operand(ref) for ref in operands]
        if op in _BINARY:
            a, b = args
            steps.append(_BINARY[op](*(x if isinstance(x, Tensor) else torch.tensor(x) for x in (a, b))))
        else:
            steps.append(_UNARY[op](args[0]))
    return steps[-1]


def _query_rows(rows: Sequence[Tensor], seq_len: int, start: int, length: int) -> list[Tensor]:
    """The rows for query positions [start, start + length): rows along the queries are narrowed, others kept."""
    return [r.narrow(-2, start, length) if r.dim() >= 2 and r.shape[-2] == seq_len else r for r in rows]


def _blocks(query: Tensor, seq_len: int):
    """Blocks of query rows whose [B, H, rows, S] scores hold about BLOCK_ELEMENTS values."""
    rows = max(MIN_ROWS, BLOCK_ELEMENTS // max(1, query.numel() // query.shape[-1] // seq_len * seq_len))
    for start in range(0, seq_len, rows):
        yield start, min(rows, seq_len - start)


@torch.library.custom_op("autosp::masked_attention", mutates_args=())
def masked_attention(query: Tensor, key: Tensor, value: Tensor, rows: list[Tensor], program: str,
                     scale: float | None, enable_gqa: bool) -> Tensor:
    """Softmax attention of `query` over `key`/`value` under the mask `program(rows)` (no argument defaults: the
    dispatcher drops trailing default arguments, which would break the tensor-list autograd bookkeeping)."""
    seq_len = query.shape[-2]
    out = query.new_empty(query.shape[:-1] + value.shape[-1:])
    for start, length in _blocks(query, seq_len):
        mask = run_program(program, _query_rows(rows, seq_len, start, length))
        out[..., start:start + length, :] = F.scaled_dot_product_attention(
            query[..., start:start + length, :], key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out


@masked_attention.register_fake
def _(query, key, value, rows, program, scale, enable_gqa):
    return query.new_empty(query.shape[:-1] + value.shape[-1:])


@torch.library.custom_op("autosp::masked_attention_backward", mutates_args=())
def masked_attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rows: list[Tensor],
                              program: str, scale: float | None, enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax attention's gradient, one block of query rows at a time (probabilities recomputed per block)."""
    seq_len, heads, kv_heads = query.shape[-2], query.shape[-3], key.shape[-3]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    repeat = heads // kv_heads if enable_gqa else 1
    k, v = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    grad_q, grad_k, grad_v = torch.empty_like(query), torch.zeros_like(k), torch.zeros_like(v)
    for start, length in _blocks(query, seq_len):
        block = slice(start, start + length)
        mask = run_program(program, _query_rows(rows, seq_len, start, length))
        scores = (query[..., block, :] @ k.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row attends to nothing: zeros
        grad_probs = grad_out[..., block, :] @ v.transpose(-2, -1)
        grad_scores = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True))
        grad_q[..., block, :] = grad_scores @ k * scale
        grad_k += grad_scores.transpose(-2, -1) @ query[..., block, :] * scale
        grad_v += probs.transpose(-2, -1) @ grad_out[..., block, :]
    if repeat > 1:  # each KV head served `repeat` consecutive query heads
        grad_k = grad_k.unflatten(-3, (kv_heads, repeat)).sum(-3)
        grad_v = grad_v.unflatten(-3, (kv_heads, repeat)).sum(-3)
    return grad_q, grad_k, grad_v


@masked_attention_backward.register_fake
def _(grad_out, query, key, value, rows, program, scale, enable_gqa):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, rows, program, scale, enable_gqa = inputs
    ctx.save_for_backward(query, key, value, *rows)
    ctx.program, ctx.scale, ctx.enable_gqa = program, scale, enable_gqa


def _backward(ctx, grad_out):
    query, key, value, *rows = ctx.saved_tensors
    grads = torch.ops.autosp.masked_attention_backward(grad_out, query, key, value, rows, ctx.program, ctx.scale,
                                                       ctx.enable_gqa)
    return *grads, [None] * len(rows), None, None, None


masked_attention.register_autograd(_backward, setup_context=_setup_context)
