"""`autosp_sp::rms_norm` and its backward: Llama's RMSNorm (`weight * (x.float() * rsqrt(mean(x.float()**2) + eps))
.to(x.dtype)`) over chunks of the tokens, the kernel the norm pass emits (`autosp.compiler.tiling.norm`).

Unfused, the norm's fp32 upcast of the hidden state and its normalised copy are graph values: aot_eager makes them
for every local token, and a step that recomputes a layer in backward keeps them from the recomputation to the
norm's backward (two fp32 hidden-sized values per norm, twice a bf16 hidden state each). Here they exist for one
chunk of tokens inside the kernel: the op saves only its input (alive anyway as the residual) and the fp32 inverse
RMS per token ([..., 1]), and backward recomputes the chunk's fp32 values from them. The forward runs the same ops
as the module, chunk by chunk (identical values); backward follows autograd's formulas for those ops (equal to
fp32 rounding; the weight's gradient is summed in fp32 over the chunks). Both declare their chunk's scratch for
the planner (`autosp.comm.transients`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from autosp.comm.library import custom_op, op
from autosp.comm.transients import declare_transient_bytes, numel


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _chunks(rows: int, chunk_tokens: int) -> range:
    return range(0, rows, max(1, chunk_tokens))


def _out_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    return torch.result_type(weight, x)


@custom_op("rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, chunk_tokens: int) -> tuple[Tensor, Tensor]:
    """(weight * normalised x in x's dtype, the fp32 inverse RMS of each token [..., 1])."""
    xs = _rows(x)
    out = xs.new_empty(xs.shape, dtype=_out_dtype(x, weight))
    rstd = xs.new_empty((xs.shape[0], 1), dtype=torch.float32)
    for start in _chunks(xs.shape[0], chunk_tokens):
        piece = xs[start:start + chunk_tokens].to(torch.float32)
        r = torch.rsqrt(piece.pow(2).mean(-1, keepdim=True) + eps)
        rstd[start:start + chunk_tokens] = r
        out[start:start + chunk_tokens] = weight * (piece * r).to(x.dtype)
    return out.view(x.shape), rstd.view(*x.shape[:-1], 1)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float, chunk_tokens: int) -> tuple[Tensor, Tensor]:
    return (x.new_empty(x.shape, dtype=_out_dtype(x, weight)),
            x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))


@custom_op("rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, chunk_tokens: int
                      ) -> tuple[Tensor, Tensor]:
    """(d x, d weight) of `rms_norm`'s first output for the upstream gradient `grad`, chunk by chunk: autograd's
    formulas for mul, the casts, rsqrt, mean and pow."""
    xs, gs, rs = _rows(x), _rows(grad), rstd.reshape(-1, 1)
    grad_x = torch.empty_like(xs)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    width = xs.shape[-1]
    for start in _chunks(xs.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        piece, r, g = xs[start:stop].to(torch.float32), rs[start:stop], gs[start:stop]
        normed = (piece * r).to(x.dtype)
        grad_weight += (g * normed).sum(0, dtype=torch.float32)
        grad_u = (g * weight).to(torch.float32)  # through the cast back to x's dtype
        grad_r = (grad_u * piece).sum(-1, keepdim=True)
        grad_var = -0.5 * grad_r * r.pow(3)  # rsqrt's backward
        grad_x[start:stop] = (grad_u * r + grad_var / width * (2 * piece)).to(x.dtype)  # mean's, pow's
    return grad_x.view(x.shape), grad_weight.to(weight.dtype)


@rms_norm_backward.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, chunk_tokens: int) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _chunk_elements(x: Tensor, chunk_tokens: int) -> int:
    return min(numel(x) // x.shape[-1], chunk_tokens) * x.shape[-1]


@declare_transient_bytes(op("rms_norm"))
def _forward_scratch(x: Tensor, weight: Tensor, eps: float, chunk_tokens: int) -> int:
    """One chunk's fp32 upcast, its square and its normalised copy (and that copy in x's dtype)."""
    return _chunk_elements(x, chunk_tokens) * (12 + x.element_size())


@declare_transient_bytes(op("rms_norm_backward"))
def _backward_scratch(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, chunk_tokens: int) -> int:
    """One chunk's fp32 upcast, the upstream gradient through the weight and cast, their product, the fp32 input
    gradient, and the normalised copy and its product with the gradient in x's dtype."""
    return _chunk_elements(x, chunk_tokens) * (16 + 2 * x.element_size())


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, _eps, chunk_tokens = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.chunk_tokens = chunk_tokens


def _backward(ctx: Any, grad: Tensor, _grad_rstd: Any) -> tuple:
    x, weight, rstd = ctx.saved_tensors
    grad_x, grad_weight = rms_norm_backward(grad.contiguous(), x, weight, rstd, ctx.chunk_tokens)
    return grad_x, grad_weight, None, None


rms_norm.register_autograd(_backward, setup_context=_setup_context)
