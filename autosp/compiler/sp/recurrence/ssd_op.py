"""Mamba2's chunked selective scan (SSD) as custom ops, so the SP walk finds the recurrence as one node: HF's kernel
`mamba2_chunk_scan(x, dt, A, B, C, chunk_size, D, dt_bias, ...)` of Mamba2, Bamba, Falcon-H1, GraniteMoeHybrid,
Nemotron-H and Zamba2, run whole, by name (its torch path on CPU; mamba_ssm's kernel where HF finds one).

`ssd_scan` is what a traced model calls in place of HF's kernel (`trace_ssd_scans`): the output [B, S, H, P] from a
zero state. `ssd_scan_with_state` also returns the final state [B, H, P, N]: what each rank runs on its shard. Their
backward (`ssd_scan_backward`) re-runs the kernel under autograd on the saved inputs, so only the inputs are kept.
Each runs the kernel over tiles of `tile_tokens` (0: whole), the state carried (`kernels.run_in_tiles`; the tiling's
`recurrence` part sets it), so its intermediates are one tile's.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from autosp.comm.costs import declare_cost
from autosp.comm.library import custom_op, op
from autosp.comm.transients import declare_transient_bytes, nbytes
from autosp.compiler.sp.recurrence.kernels import (
    contiguous,
    gradients_in_tiles,
    original,
    register_rerun_autograd,
    rerun_backward_factor,
    run_in_tiles,
    tile_bounds,
    tile_copies,
    traced_kernels,
)

#: HF's torch kernel of the SSD chunked scan, a module-level function of these modeling modules
KERNEL_NAME = "mamba2_chunk_scan"


def _kernel(chunk_size, dt_softplus, dt_min, dt_max, module):
    """HF's kernel as `run(x, dt, B, C, state, A, D, dt_bias) -> (output, final state)` (`kernels.run_in_tiles`)."""
    def run(x, dt, B, C, state, A, D, dt_bias):
        return contiguous(original(module, KERNEL_NAME)(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                                                        initial_states=state, dt_softplus=dt_softplus,
                                                        dt_limit=(dt_min, dt_max), return_final_states=True))
    return run


def _run(x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, module, tile_tokens):
    return run_in_tiles(_kernel(chunk_size, dt_softplus, dt_min, dt_max, module), [x, dt, B, C], None,
                        tile_bounds(x.shape[1], tile_tokens, chunk_size), shared=(A, D, dt_bias))


@custom_op("ssd_scan", mutates_args=())
def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None, dt_bias: torch.Tensor | None, chunk_size: int, dt_softplus: bool, dt_min: float,
             dt_max: float, module: str, tile_tokens: int) -> torch.Tensor:
    """The SSD scan's output [B, S, H, P] (with D's skip connection) from a zero state (HF's kernel in `module`)."""
    return _run(x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, module, tile_tokens)[0]


@custom_op("ssd_scan_with_state", mutates_args=())
def ssd_scan_with_state(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor | None, dt_bias: torch.Tensor | None, chunk_size: int, dt_softplus: bool,
                        dt_min: float, dt_max: float, module: str,
                        tile_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, final state [B, H, P, N]) of the SSD scan from a zero state."""
    out, state = _run(x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, module, tile_tokens)
    return out, state


@custom_op("ssd_scan_backward", mutates_args=())
def ssd_scan_backward(grad_out: torch.Tensor, grad_state: torch.Tensor | None, x: torch.Tensor, dt: torch.Tensor,
                      A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
                      dt_bias: torch.Tensor | None, chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float,
                      module: str, tile_tokens: int) -> list[torch.Tensor]:
    """Gradients of (x, dt, A, B, C[, D][, dt_bias]) (those given): the kernel re-run under autograd, tile by tile."""
    gx, gdt, gB, gC, _, gA, gD, gdt_bias = gradients_in_tiles(
        _kernel(chunk_size, dt_softplus, dt_min, dt_max, module), [x, dt, B, C], None,
        tile_bounds(x.shape[1], tile_tokens, chunk_size), grad_out, grad_state, shared=(A, D, dt_bias))
    return [g for g in (gx, gdt, gA, gB, gC, gD, gdt_bias) if g is not None]


def _fake_state(x, B):
    return x.new_empty((x.shape[0], x.shape[2], x.shape[3], B.shape[-1]), dtype=torch.float32)


@ssd_scan.register_fake
def _ssd_scan_fake(x, dt, A, B, C, D, dt_bias, *constants):
    return x.new_empty(x.shape, dtype=torch.float32)


@ssd_scan_with_state.register_fake
def _ssd_scan_with_state_fake(x, dt, A, B, C, D, dt_bias, *constants):
    return x.new_empty(x.shape, dtype=torch.float32), _fake_state(x, B)


@ssd_scan_backward.register_fake
def _ssd_scan_backward_fake(grad_out, grad_state, x, dt, A, B, C, D, dt_bias, *constants):
    return [t.new_empty(t.shape) for t in (x, dt, A, B, C, D, dt_bias) if t is not None]


register_rerun_autograd(ssd_scan, ssd_scan_with_state, ssd_scan_backward, tensors=7)


@functools.cache
def _traced_kernel(module: str, hf_kernel):
    """HF's kernel, as the `ssd_scan` op where the call is the plain training one (no state in or out, no packed
    documents, no gate); any other call runs HF's kernel inlined (and the walk refuses its chunk loop). One function
    per kernel, so Dynamo's guards see the same global at every call."""

    def kernel(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
               dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **kwargs):
        packed = kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None
        if initial_states is not None or return_final_states or z is not None or packed:
            return hf_kernel(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                             initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                             return_final_states=return_final_states, z=z, **kwargs)
        return ssd_scan(hidden_states, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus, float(dt_limit[0]),
                        float(dt_limit[1]), module, 0)

    kernel._autosp_traced = True
    return kernel


def trace_ssd_scans() -> contextlib.AbstractContextManager:
    """While Dynamo traces, every loaded transformers modeling module's `mamba2_chunk_scan` calls the op."""
    return traced_kernels(KERNEL_NAME, _traced_kernel)


def _forward_flops(x, B, chunk_size) -> float:
    """SSD's chunked scan: per chunk C B^T and its product with x (2 L Q (N + P) per head), the chunk states B^T x
    and their read-out C h (2 L P N each)."""
    batch, length, heads, head_dim = x.shape
    return 2.0 * batch * length * heads * (chunk_size * (B.shape[-1] + head_dim) + 2 * head_dim * B.shape[-1])


@declare_cost(op("ssd_scan"))
@declare_cost(op("ssd_scan_with_state"))
def _ssd_scan_cost(x, dt, A, B, C, D, dt_bias, chunk_size, *constants):
    return "matmul", _forward_flops(x, B, chunk_size)


@declare_cost(op("ssd_scan_backward"))
def _ssd_scan_backward_cost(grad_out, grad_state, x, dt, A, B, C, D, dt_bias, chunk_size, *constants):
    return "matmul", rerun_backward_factor(x.shape[1], constants[-1], chunk_size) * _forward_flops(x, B, chunk_size)


def scratch_bytes(x, B, chunk_size, tile_tokens) -> int:
    """An estimate of the torch kernel's intermediates alive together over one tile of `tile_tokens` (0: the whole
    sequence; fp32): x, its discretised copy and the diagonal and off-diagonal outputs ([L, P] each, per head), B and C
    per head and B's decayed copy ([L, N] each), the chunks' [Q, Q] decays, scores and masked scores, the chunk states
    [L/Q, P, N]."""
    batch, _, heads, head_dim = x.shape
    state = B.shape[-1]
    tile = tile_bounds(x.shape[1], tile_tokens, chunk_size)[0]
    padded = -(-(tile.stop - tile.start) // chunk_size) * chunk_size
    per_head = padded * (4 * head_dim + 3 * state + 3 * chunk_size) + padded // chunk_size * head_dim * state
    return 4 * batch * heads * per_head


@declare_transient_bytes(op("ssd_scan"))
@declare_transient_bytes(op("ssd_scan_with_state"))
def _ssd_scan_scratch(x, dt, A, B, C, D, dt_bias, chunk_size, *constants):
    # tiled, a tile's fp32 output and its contiguous copy
    return scratch_bytes(x, B, chunk_size, constants[-1]) + tile_copies(4 * x.numel(), x.shape[1], constants[-1],
                                                                        chunk_size)


@declare_transient_bytes(op("ssd_scan_backward"))
def _ssd_scan_backward_scratch(grad_out, grad_state, x, dt, A, B, C, D, dt_bias, chunk_size, *constants):
    # the re-run forward's intermediates kept for autograd, and their gradients; tiled, the fp32 states entering the
    # tiles and a tile's input gradients with their contiguous copies
    tiles = len(tile_bounds(x.shape[1], constants[-1], chunk_size))
    states = 4 * x.shape[0] * x.shape[2] * x.shape[3] * B.shape[-1] * (tiles - 1)
    return (2 * scratch_bytes(x, B, chunk_size, constants[-1]) + states
            + tile_copies(sum(map(nbytes, (x, dt, B, C))), x.shape[1], constants[-1], chunk_size))
