"""`autosp_sp::masked_attention`: attention under a mask given as O(S) rows and an elementwise program, never [S, S].

A structured mask (sliding window, packed documents, key padding, any mix of them) is a pointwise function
mask[b, h, q, kv] = program(rows), where each row varies along the query or the key positions only (positions,
document ids, a padding vector: O(S) each). The op takes the rows and the program (a JSON list of elementwise
instructions, see `run_program`) and computes attention one block of query rows at a time. Rows of softmax
attention are independent, so this is exact.

Block skipping. For each block of query rows the op first bounds the program over tiles of keys: every row's
minimum and maximum over the block (query rows) or over each key tile (key rows) go through the program in
interval arithmetic (`_Plan.key_span`), which says for each tile whether any entry *may* be unmasked (sound: it
never rules out an unmasked entry). Only the span from the first to the last such tile is evaluated exactly,
and attention runs on the keys from the first to the last unmasked key of the block: a window's block on
[q0 - w + 1, q1), a causal one on [0, q1), a packed document's from its document's first key, left padding from
the first real key; a block whose every entry is masked is skipped (its rows attend to nothing: zeros, as SDPA).
So the mask work and the attention work scale with the blocks' key envelopes, not with S^2.

Why this and not FlexAttention: torch 2.13's `flex_attention` raises "does not support backward on CPU", and
training needs backward. The op calls plain `scaled_dot_product_attention` on each block's span on every device
(CPU flash, CUDA/ROCm memory-efficient kernels); backward recomputes each block, on CPU with the fused kernel pair
SDPA itself runs, elsewhere in tensor ops (`BLOCK_GRADIENTS`). Nothing of size S x S exists: the mask costs
O(rows * span) at a time. On CUDA a FlexAttention `mask_mod` generated from the same program would add skipping at
the kernel's tile level inside a span (e.g. the masked triangle of a window's span) and fuse the mask into the
kernel; not written here, as it cannot be tested.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from autosp.comm import library
from autosp.comm.library import custom_op

BLOCK_ELEMENTS = 2**20  # scores per block of query rows (4 MiB in fp32)
MIN_ROWS = 16
MAX_ROWS = 128  # also the key tile: a block's span overshoots what its rows see by at most one tile per side

_BINARY = {"le": torch.le, "lt": torch.lt, "ge": torch.ge, "gt": torch.gt, "eq": torch.eq, "ne": torch.ne,
           "and": torch.logical_and, "or": torch.logical_or, "add": torch.add, "sub": torch.sub}
_UNARY = {"not": torch.logical_not, "same": lambda x: x}
OPS = frozenset(_BINARY) | frozenset(_UNARY)


def _run(program: str, operand_of, binary, unary):
    """Walk the program: each instruction is [op, operand...]; an operand is ["row", i], ["step", j] (the result
    of instruction j) or ["const", value]; the last instruction's result is the mask."""
    steps: list = []
    for op, *refs in json.loads(program):
        args = [steps[value] if kind == "step" else operand_of(kind, value) for kind, value in refs]
        steps.append(binary(op, *args) if op in _BINARY else unary(op, args[0]))
    return steps[-1]


def run_program(program: str, rows: Sequence[Tensor]) -> Tensor:
    """Evaluate the mask program on `rows` (tensors broadcast against each other)."""
    def operand(kind, value):
        return rows[value] if kind == "row" else torch.tensor(value)
    return _run(program, operand, lambda op, a, b: _BINARY[op](a, b), lambda op, a: _UNARY[op](a))


def _truth(bound: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """A value's bounds as (surely nonzero, maybe nonzero)."""
    lo, hi = bound
    if lo.dtype == torch.bool:
        return lo, hi
    return (lo > 0) | (hi < 0), (lo != 0) | (hi != 0)


def _interval(op: str, a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Bounds of `op` over operands within bounds a (and b); a boolean result is (surely true, maybe true)."""
    if op == "same":
        return a
    if op == "not":
        sure, maybe = _truth(a)
        return ~maybe, ~sure
    (alo, ahi), (blo, bhi) = a, b
    if op in ("and", "or"):
        (asure, amaybe), (bsure, bmaybe) = _truth(a), _truth(b)
        both = torch.logical_and if op == "and" else torch.logical_or
        return both(asure, bsure), both(amaybe, bmaybe)
    if op == "add":
        return alo + blo, ahi + bhi
    if op == "sub":
        return alo - bhi, ahi - blo
    if op in ("ge", "gt"):  # a >= b is b <= a
        return _interval({"ge": "le", "gt": "lt"}[op], b, a)
    if op in ("le", "lt"):
        compare = torch.le if op == "le" else torch.lt
        return compare(ahi, blo), compare(alo, bhi)
    equal_sure = (alo == ahi) & (blo == bhi) & (alo == blo)
    equal_maybe = (alo <= bhi) & (blo <= ahi)
    return (equal_sure, equal_maybe) if op == "eq" else (~equal_maybe, ~equal_sure)


def _tile_bounds(row: Tensor, dim: int, tile: int) -> tuple[Tensor, Tensor]:
    """Per-tile minimum and maximum of `row` along `dim` (over every other dim too): two [tiles] vectors."""
    values = row.movedim(dim, -1).reshape(-1, row.shape[dim])
    short = -values.shape[-1] % tile  # the last tile is filled up with its last value
    values = torch.cat([values, values[:, -1:].expand(-1, short)], -1) if short else values
    values = values.unflatten(-1, (-1, tile)).transpose(0, 1).flatten(1)
    return values.amin(-1), values.amax(-1)


class _Plan:
    """Where each block of query rows may attend: the rows' bounds per query block and per key tile, computed
    once per call, and the interval program over them (None where bounds would not be sound: float rows may
    hold NaN, huge integers may overflow)."""

    def __init__(self, program: str, rows: Sequence[Tensor], seq_len: int, block: int) -> None:
        self.program, self.seq_len, self.block = program, seq_len, block
        self.tiles = -(-seq_len // block)
        sound = len(json.loads(program)) < 32 and all(  # < 32 additions of values < 2**31 fit in int64
            r.dtype == torch.bool or (not r.dtype.is_floating_point and r.numel() > 0 and r.abs().max() < 2**31)
            for r in rows)
        self.bounds = [self._bounds(r) for r in rows] if sound else None

    def _bounds(self, row: Tensor) -> tuple[Tensor, Tensor]:
        if row.dim() >= 2 and row.shape[-2] == self.seq_len:
            lo, hi = _tile_bounds(row, -2, self.block)
            return lo[:, None], hi[:, None]  # [query blocks, 1]
        if row.shape and row.shape[-1] == self.seq_len:
            lo, hi = _tile_bounds(row, -1, self.block)
            return lo[None, :], hi[None, :]  # [1, key tiles]
        return row.amin()[None, None], row.amax()[None, None]

    def key_span(self, index: int) -> slice:
        """The keys a query block may see, whole tiles (all keys when bounds are off)."""
        if self.bounds is None:
            return slice(0, self.seq_len)

        def operand(kind, value):
            if kind == "const":
                return torch.tensor(value), torch.tensor(value)
            lo, hi = self.bounds[value]
            return lo[min(index, lo.shape[0] - 1)], hi[min(index, hi.shape[0] - 1)]

        _, maybe = _truth(_run(self.program, operand, _interval, _interval))
        tiles = maybe.expand(self.tiles).nonzero()
        if not tiles.numel():
            return slice(0, 0)
        return slice(tiles[0, 0].item() * self.block, min(self.seq_len, (tiles[-1, 0].item() + 1) * self.block))


def _narrow_rows(rows: Sequence[Tensor], seq_len: int, queries: slice, keys: slice) -> list[Tensor]:
    """The rows for a block of queries and a span of keys: rows along the queries or keys are narrowed."""
    def narrow(r: Tensor) -> Tensor:
        if r.dim() >= 2 and r.shape[-2] == seq_len:
            return r[..., queries, :]
        return r[..., keys] if r.shape and r.shape[-1] == seq_len else r
    return [narrow(r) for r in rows]


def _attended_blocks(query: Tensor, rows: Sequence[Tensor], program: str) -> Iterator[tuple[slice, slice, Tensor]]:
    """(query block, key span, the block's mask on that span) for every block of query rows that attends to any
    key; the span runs from the first to the last key any row of the block sees (in any batch row)."""
    seq_len = query.shape[-2]
    scores_per_row = query.numel() // query.shape[-1] // seq_len * seq_len  # B * H * S
    block = min(MAX_ROWS, max(MIN_ROWS, BLOCK_ELEMENTS // max(1, scores_per_row)))
    plan = _Plan(program, rows, seq_len, block)
    for index, start in enumerate(range(0, seq_len, block)):
        queries, keys = slice(start, min(seq_len, start + block)), plan.key_span(index)
        if keys.start == keys.stop:
            continue
        mask = run_program(program, _narrow_rows(rows, seq_len, queries, keys))
        # keys seen by any row (amax of bytes: any() along a strided dim is ~40x slower on CPU)
        seen = mask.reshape(-1, mask.shape[-1]).view(torch.uint8).amax(0) if mask.dim() else mask.reshape(1)
        hit = seen.expand(keys.stop - keys.start).nonzero()
        if not hit.numel():
            continue
        first, last = hit[0, 0].item(), hit[-1, 0].item() + 1
        if mask.dim() and mask.shape[-1] > 1:
            mask = mask[..., first:last]
        yield queries, slice(keys.start + first, keys.start + last), mask


@custom_op("masked_attention", mutates_args=())
def masked_attention(query: Tensor, key: Tensor, value: Tensor, rows: list[Tensor], program: str,
                     scale: float | None, enable_gqa: bool) -> Tensor:
    """Softmax attention of `query` over `key`/`value` under the mask `program(rows)` (no argument defaults: the
    dispatcher drops trailing default arguments, which would break the tensor-list autograd bookkeeping)."""
    out = query.new_zeros(query.shape[:-1] + value.shape[-1:])  # rows that attend to nothing stay zero, as in SDPA
    for queries, keys, mask in _attended_blocks(query, rows, program):
        out[..., queries, :] = F.scaled_dot_product_attention(
            query[..., queries, :], key[..., keys, :], value[..., keys, :], attn_mask=mask, scale=scale,
            enable_gqa=enable_gqa)
    return out


@masked_attention.register_fake
def _(query, key, value, rows, program, scale, enable_gqa):
    return query.new_empty(query.shape[:-1] + value.shape[-1:])


def _flash_cpu_gradients(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, mask: Tensor,
                         scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """On CPU, the kernel pair SDPA itself runs (bit-identical to it): the fused forward for the block's
    log-sum-exp, then the fused backward. The kernel takes an additive mask."""
    bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=bias, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, False, attn_mask=bias, scale=scale)


def _math_gradients(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, mask: Tensor,
                    scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """Anywhere else, softmax attention's gradient in tensor ops (probabilities recomputed for the block)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    probs = torch.softmax((query @ key.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf")), dim=-1)
    probs = probs.nan_to_num(0.0)  # a fully masked row attends to nothing: zeros
    grad_probs = grad_out @ value.transpose(-2, -1)
    grad_scores = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True))
    return grad_scores @ key * scale, grad_scores.transpose(-2, -1) @ query * scale, probs.transpose(-2, -1) @ grad_out


#: per device type, the gradient of one block's attention (the kernel runs below autograd: no autograd inside)
BLOCK_GRADIENTS = {"cpu": _flash_cpu_gradients}


@custom_op("masked_attention_backward", mutates_args=())
def masked_attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rows: list[Tensor],
                              program: str, scale: float | None, enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Attention's gradient one block of query rows at a time, on the block's key span only (each block's
    attention recomputed), so nothing larger than a block is held."""
    heads, kv_heads = query.shape[-3], key.shape[-3]
    repeat = heads // kv_heads if enable_gqa else 1
    gradients = BLOCK_GRADIENTS.get(query.device.type, _math_gradients)
    grad_q, grad_k, grad_v = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for queries, keys, mask in _attended_blocks(query, rows, program):
        k, v = (t[..., keys, :].repeat_interleave(repeat, -3) for t in (key, value))
        mask = mask.broadcast_to(torch.broadcast_shapes(mask.shape, (1, 1, queries.stop - queries.start, k.shape[-2])))
        block_q, block_k, block_v = gradients(grad_out[..., queries, :], query[..., queries, :], k, v, mask, scale)
        grad_q[..., queries, :] = block_q
        grad_k[..., keys, :] += block_k.unflatten(-3, (kv_heads, repeat)).sum(-3)  # each KV head served `repeat`
        grad_v[..., keys, :] += block_v.unflatten(-3, (kv_heads, repeat)).sum(-3)  # consecutive query heads
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
    grads = library.op("masked_attention_backward")(grad_out, query, key, value, rows, ctx.program, ctx.scale,
                                                       ctx.enable_gqa)
    return *grads, [None] * len(rows), None, None, None


masked_attention.register_autograd(_backward, setup_context=_setup_context)
