"""`autosp_sp::linear_cross_entropy`: the LM head + token-wise cross-entropy over tiles of the tokens, its gradients
made in forward for an upstream gradient of 1 and scaled in backward (the kernel the loss tiling pass emits,
`autosp.compiler.tiling.loss`); declares one tile's scratch for the planner."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from autosp.comm.library import custom_op, op
from autosp.comm.transients import declare_transient_bytes, nbytes, numel


def _tiles(num_tokens: int, tile_tokens: int) -> range:
    return range(0, num_tokens, max(1, tile_tokens))


def _tile_logits(hidden: Tensor, weight: Tensor, start: int, tile_tokens: int, dtype: torch.dtype) -> Tensor:
    return (hidden[start:start + tile_tokens] @ weight.t()).to(dtype)


def tiled_cross_entropy(
    hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, dtype: torch.dtype, tile_tokens: int,
    with_grads: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(sum over tokens of cross_entropy((hidden @ weight.T).to(dtype), target), its gradients d hidden and d weight
    for an upstream gradient of 1): hidden [N, d], target [N]. One pass: each tile's logits are made once, give
    their loss (logsumexp - target logit, in fp32) and are turned into their gradient in place (softmax - one_hot);
    dW accumulates in fp32. Computing the gradients here, not in backward, means no tile's logits are ever made
    twice: tiling costs no extra FLOPs (backward only scales them by the loss's gradient). Without `with_grads`
    (nothing to differentiate) the gradients are empty."""
    total = hidden.new_zeros((), dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if with_grads else hidden.new_empty(0)
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_grads else weight.new_empty(0, dtype=torch.float32)
    head = weight.to(hidden.dtype)
    for start in _tiles(hidden.shape[0], tile_tokens):
        tile_target = target[start:start + tile_tokens]
        logits = _tile_logits(hidden, weight, start, tile_tokens, dtype)
        logits = logits.float() if logits.dtype != torch.float32 else logits
        valid = tile_target != ignore_index
        rows = torch.arange(tile_target.shape[0], device=logits.device)
        picked = tile_target.clamp(min=0) * valid
        log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
        total += ((log_normalizer.squeeze(-1) - logits[rows, picked]) * valid).sum()
        if not with_grads:
            continue
        logits.sub_(log_normalizer).exp_()  # softmax, in place
        del log_normalizer
        logits[rows, picked] -= valid.to(logits.dtype)
        logits.mul_(valid.to(logits.dtype).unsqueeze(-1))
        grad_logits = logits.to(hidden.dtype)
        del logits
        torch.mm(grad_logits, head, out=grad_hidden[start:start + tile_tokens])
        grad_weight.addmm_(grad_logits.t().float(), hidden[start:start + tile_tokens].float())
        del grad_logits
    return total.to(dtype), grad_hidden, grad_weight


@custom_op("linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, dtype: torch.dtype, tile_tokens: int,
    with_grads: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return tiled_cross_entropy(hidden, weight, target, ignore_index, dtype, tile_tokens, with_grads)


@linear_cross_entropy.register_fake
def _(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, dtype: torch.dtype, tile_tokens: int,
      with_grads: bool) -> tuple[Tensor, Tensor, Tensor]:
    if not with_grads:
        return hidden.new_empty((), dtype=dtype), hidden.new_empty(0), weight.new_empty(0, dtype=torch.float32)
    return (hidden.new_empty((), dtype=dtype), torch.empty_like(hidden),
            torch.empty_like(weight, dtype=torch.float32))


def _tile_elements(hidden: Tensor, weight: Tensor, tile_tokens: int) -> int:
    return min(numel(hidden) // hidden.shape[-1], tile_tokens) * weight.shape[0]


@declare_transient_bytes(op("linear_cross_entropy"))
def _scratch(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, dtype: torch.dtype,
             tile_tokens: int, with_grads: bool) -> int:
    """One tile's fp32 logits and logsumexp's temporary of their size (8 bytes per logit: every other moment of
    a tile, the matmul result and its casts, holds at most as many), plus the weight in the hidden dtype when that
    is not the weight itself. The gradients are the op's outputs, counted as such."""
    recast = nbytes(weight) // weight.element_size() * hidden.element_size() if weight.dtype != hidden.dtype else 0
    return _tile_elements(hidden, weight, tile_tokens) * 8 + recast


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    _, grad_hidden, grad_weight = output
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.weight_dtype = inputs[1].dtype


def _backward(ctx: Any, grad: Tensor, *_unused: Any) -> tuple:
    """The gradients were made in forward for an upstream gradient of 1: scale them by the loss's gradient."""
    grad_hidden, grad_weight = ctx.saved_tensors
    return (grad_hidden * grad.to(grad_hidden.dtype), (grad_weight * grad.float()).to(ctx.weight_dtype),
            None, None, None, None, None)


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
