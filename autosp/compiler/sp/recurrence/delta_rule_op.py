"""The gated delta rule as custom ops, so the SP walk finds the recurrence as one node: HF's torch kernels run whole,
by name — `torch_chunk_gated_delta_rule(q, k, v, g, beta, ...)` of Qwen3-Next, Qwen3.5, OLMo-hybrid (a per-head scalar
decay g [B, S, H]) and Kimi Linear's `chunk_kimi_delta_attention` (the same call, a per-channel decay g [B, S, H, Dk]).
Both are affine in the state with each value channel on its own, so one op (the kernel named in its `kernel` argument,
"module.function") and one rewrite (`delta_rule`) serve both.

`gated_delta_rule` is what a traced model calls in place of HF's kernel (`trace_gated_delta_rules`): the output only,
from a zero state. `gated_delta_rule_from` also takes an initial state and returns the final one: what each rank runs
on its shard. Their backward (`gated_delta_rule_backward`) re-runs the kernel under autograd on the saved inputs, so
only the inputs are kept (the kernel's chunk intermediates are rebuilt, as a checkpoint would). Each op runs the
kernel over tiles of `tile_tokens` (0: whole), the state carried from tile to tile (`kernels.run_in_tiles`), so its
intermediates are one tile's: what the tiling sets where a rank's tokens make them too large (`tiles`).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from autosp.comm.costs import declare_cost
from autosp.comm.library import custom_op, op
from autosp.comm.transients import declare_transient_bytes, nbytes
from autosp.compiler.sp.recurrence.kernels import (
    contiguous,
    gradients_in_tiles,
    original,
    rerun_backward_factor,
    run_in_tiles,
    tile_bounds,
    tile_copies,
    traced_kernels,
)

#: HF's torch kernels of the gated delta rule, module-level functions of these modeling modules (the rule AutoSP
#: recognises them by: the kernels HF's gated delta-net and Kimi delta attention layers call, not a pattern of the
#: inlined chunk loop)
KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention")


def _run(q, k, v, g, beta, initial_state, chunk_size, l2norm, kernel):
    module, name = kernel.rsplit(".", 1)
    return contiguous(original(module, name)(q, k, v, g=g, beta=beta, chunk_size=chunk_size,
                                             initial_state=initial_state, output_final_state=True,
                                             use_qk_l2norm_in_kernel=l2norm))


def _run_tiled(q, k, v, g, beta, initial_state, chunk_size, l2norm, kernel, tile_tokens):
    return run_in_tiles(lambda *inputs: _run(*inputs, chunk_size, l2norm, kernel), [q, k, v, g, beta],
                        initial_state, tile_bounds(q.shape[1], tile_tokens, chunk_size))


@custom_op("gated_delta_rule", mutates_args=())
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     chunk_size: int, l2norm: bool, kernel: str, tile_tokens: int) -> torch.Tensor:
    """The gated delta rule's output [B, S, Hv, Dv] from a zero state (HF's kernel `kernel`, "module.function")."""
    return _run_tiled(q, k, v, g, beta, None, chunk_size, l2norm, kernel, tile_tokens)[0]


@custom_op("gated_delta_rule_from", mutates_args=())
def gated_delta_rule_from(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          initial_state: torch.Tensor, chunk_size: int, l2norm: bool, kernel: str,
                          tile_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, final state [B, Hv, Dk, Dv]) of the gated delta rule from `initial_state`."""
    out, state = _run_tiled(q, k, v, g, beta, initial_state, chunk_size, l2norm, kernel, tile_tokens)
    return out, state


@custom_op("gated_delta_rule_backward", mutates_args=())
def gated_delta_rule_backward(grad_out: torch.Tensor, grad_state: torch.Tensor | None, q: torch.Tensor,
                              k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                              initial_state: torch.Tensor | None, chunk_size: int, l2norm: bool, kernel: str,
                              tile_tokens: int) -> list[torch.Tensor]:
    """Gradients of (q, k, v, g, beta[, initial_state]): the kernel re-run under autograd, tile by tile."""
    grads = gradients_in_tiles(lambda *inputs: _run(*inputs, chunk_size, l2norm, kernel), [q, k, v, g, beta],
                               initial_state, tile_bounds(q.shape[1], tile_tokens, chunk_size), grad_out, grad_state)
    return grads[:5] if initial_state is None else grads


@gated_delta_rule.register_fake
def _gated_delta_rule_fake(q, k, v, g, beta, chunk_size, l2norm, kernel, tile_tokens):
    return v.new_empty(v.shape)


@gated_delta_rule_from.register_fake
def _gated_delta_rule_from_fake(q, k, v, g, beta, initial_state, chunk_size, l2norm, kernel, tile_tokens):
    return v.new_empty(v.shape), initial_state.new_empty(initial_state.shape, dtype=torch.float32)


@gated_delta_rule_backward.register_fake
def _gated_delta_rule_backward_fake(grad_out, grad_state, q, k, v, g, beta, initial_state, *constants):
    wrt = (q, k, v, g, beta) + ((initial_state,) if initial_state is not None else ())
    return [x.new_empty(x.shape) for x in wrt]


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5], *([inputs[5]] if len(inputs) == 10 else []))
    ctx.constants = inputs[-4:]


def _gated_delta_rule_grad(ctx, grad_out):
    grads = gated_delta_rule_backward(grad_out, None, *ctx.saved_tensors, None, *ctx.constants)
    return (*grads, None, None, None, None)


def _gated_delta_rule_from_grad(ctx, grad_out, grad_state):
    q, k, v, g, beta, state = ctx.saved_tensors
    grads = gated_delta_rule_backward(grad_out, grad_state, q, k, v, g, beta, state, *ctx.constants)
    return (*grads, None, None, None, None)


gated_delta_rule.register_autograd(_gated_delta_rule_grad, setup_context=_setup)
gated_delta_rule_from.register_autograd(_gated_delta_rule_from_grad, setup_context=_setup)


@functools.cache
def _traced_kernel(name: str, module: str, hf_kernel):
    """HF's kernel `name` of `module`, as the `gated_delta_rule` op where the call is the plain training one (no state
    in or out, no packed documents); any other call runs HF's kernel inlined (and the walk refuses its chunk loop).
    One function per kernel, so Dynamo's guards see the same global at every call."""

    def kernel(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        packed = cu_seqlens is not None or any(name.startswith("cu_seq") for name in kwargs)
        if initial_state is not None or output_final_state or packed:
            return hf_kernel(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             cu_seqlens=cu_seqlens, **kwargs)
        return gated_delta_rule(query, key, value, g, beta, chunk_size, use_qk_l2norm_in_kernel,
                                f"{module}.{name}", 0), None

    kernel._autosp_traced = True
    return kernel


@contextlib.contextmanager
def trace_gated_delta_rules() -> Iterator[None]:
    """While Dynamo traces, every loaded transformers modeling module's gated delta rule kernels call the op."""
    with contextlib.ExitStack() as stack:
        for name in KERNEL_NAMES:
            stack.enter_context(traced_kernels(name, functools.partial(_traced_kernel, name)))
        yield


def _forward_flops(q, v, chunk_size) -> float:
    """The chunked rule per head and chunk of C tokens: k k^T, q k^T and the products of the [C, C] matrices with
    k and v (C^2 (6 dk + 4 dv)), the triangular solve's row updates (2 C^3 / 3), the state's read-outs and update
    (6 C dk dv), for each value head (queries and keys shared by a group of them are read per value head). Kimi's
    per-channel decays make k k^T and q k^T elementwise [C, C, dk] products: the same count."""
    batch, length, _, dk = q.shape
    heads, dv, chunk = v.shape[2], v.shape[-1], min(chunk_size, length)
    per_token = chunk * (6 * dk + 4 * dv) + 2 * chunk * chunk / 3 + 6 * dk * dv
    return float(batch * heads * length * per_token)


@declare_cost(op("gated_delta_rule"))
@declare_cost(op("gated_delta_rule_from"))
def _gated_delta_rule_cost(q, k, v, g, beta, *rest):
    chunk_size = rest[-4]
    return "matmul", _forward_flops(q, v, chunk_size)


@declare_cost(op("gated_delta_rule_backward"))
def _gated_delta_rule_backward_cost(grad_out, grad_state, q, k, v, g, beta, initial_state, chunk_size, *rest):
    return "matmul", rerun_backward_factor(q.shape[1], rest[-1], chunk_size) * _forward_flops(q, v, chunk_size)


def scratch_bytes(q, v, g, chunk_size, tile_tokens) -> int:
    """HF's torch kernel's intermediates alive together during its chunk loop over one tile of `tile_tokens` (0: the
    whole sequence; fp32, per value head, counted from `torch_chunk_gated_delta_rule`): the decayed queries and keys,
    the beta-weighted keys, their decayed copy and the solved keys ([L, dk] each), the values' fp32 copy, the
    beta-weighted values, the solved values and the output ([L, dv] each), the chunks' pairwise decays, UT system and
    intra-chunk scores ([L, C] each), beta and the decay and its cumulative sum. With a per-channel decay (Kimi delta
    attention, g [B, S, H, Dk]) its peak is the UT system's product, three [L, C, dk] arrays at once (the pairwise
    decays and two products with the keys). `python -m tests.experiments.recurrence_scratch_check` measures the
    kernels against it."""
    batch, _, _, dk = q.shape
    heads, dv, chunk = v.shape[2], v.shape[-1], chunk_size
    tile = tile_bounds(q.shape[1], tile_tokens, chunk)[0]
    padded = -(-(tile.stop - tile.start) // chunk) * chunk
    per_channel = 3 * chunk * dk if g.dim() == 4 else 0
    return 4 * batch * heads * padded * (5 * dk + 4 * dv + 3 * chunk + 3 + per_channel)


@declare_transient_bytes(op("gated_delta_rule"))
@declare_transient_bytes(op("gated_delta_rule_from"))
def _gated_delta_rule_scratch(q, k, v, g, beta, *rest):
    # tiled, a tile's output and its contiguous copy
    return scratch_bytes(q, v, g, rest[-4], rest[-1]) + tile_copies(nbytes(v), v.shape[1], rest[-1], rest[-4])


@declare_transient_bytes(op("gated_delta_rule_backward"))
def _gated_delta_rule_backward_scratch(grad_out, grad_state, q, k, v, g, beta, initial_state, chunk_size, *rest):
    # one tile's re-run forward intermediates kept for autograd, and their gradients; tiled, the fp32 states
    # [B, Hv, Dk, Dv] entering the tiles and a tile's input gradients with their contiguous copies
    tiles = len(tile_bounds(q.shape[1], rest[-1], chunk_size))
    states = 4 * v.shape[0] * v.shape[2] * q.shape[-1] * v.shape[-1] * (tiles - 1)
    return (2 * scratch_bytes(q, v, g, chunk_size, rest[-1]) + states
            + tile_copies(sum(map(nbytes, (q, k, v, g, beta))), q.shape[1], rest[-1], chunk_size))
