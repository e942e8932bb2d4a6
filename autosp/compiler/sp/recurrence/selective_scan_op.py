"""Mamba1's selective scan as custom ops, so the SP walk finds the recurrence as one node: HF's kernel
`mamba_selective_scan(x, dt, A, B, C, D, z, delta_bias, ...)` of Jamba, Mamba and FalconMamba, run whole, by name (its
torch path on CPU; mamba_ssm's `selective_scan_fn` where HF finds one).

`selective_scan` is what a traced model calls in place of HF's kernel (`trace_selective_scans`): the gated output
[B, D, S] from a zero state. `selective_scan_with_state` also returns the final state [B, D, N]: what each rank runs
on its shard. Their backward (`selective_scan_backward`) re-runs the kernel under autograd on the saved inputs.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from autosp.comm.costs import RERUN_BACKWARD_FACTOR, declare_cost
from autosp.comm.library import custom_op, op
from autosp.comm.transients import declare_transient_bytes
from autosp.compiler.sp.recurrence.kernels import (
    contiguous,
    gradients,
    original,
    register_rerun_autograd,
    traced_kernels,
)

#: HF's torch kernel of Mamba1's selective scan, a module-level function of these modeling modules
KERNEL_NAME = "mamba_selective_scan"


def _run(x, dt, A, B, C, D, z, delta_bias, softplus, use_mambapy, use_associative_scan, module):
    return contiguous(original(module, KERNEL_NAME)(x, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                                    delta_softplus=softplus, return_last_state=True,
                                                    use_mambapy=use_mambapy, use_associative_scan=use_associative_scan))


@custom_op("selective_scan", mutates_args=())
def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None, softplus: bool,
                   use_mambapy: bool, use_associative_scan: bool, module: str) -> torch.Tensor:
    """The selective scan's output [B, D, S] (D's skip connection, z's gate) from a zero state (HF's kernel)."""
    return _run(x, dt, A, B, C, D, z, delta_bias, softplus, use_mambapy, use_associative_scan, module)[0]


@custom_op("selective_scan_with_state", mutates_args=())
def selective_scan_with_state(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                              D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
                              softplus: bool, use_mambapy: bool, use_associative_scan: bool,
                              module: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, final state [B, D, N]) of the selective scan from a zero state."""
    out, state = _run(x, dt, A, B, C, D, z, delta_bias, softplus, use_mambapy, use_associative_scan, module)
    return out, state


@custom_op("selective_scan_backward", mutates_args=())
def selective_scan_backward(grad_out: torch.Tensor, grad_state: torch.Tensor | None, x: torch.Tensor,
                            dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                            D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
                            softplus: bool, use_mambapy: bool, use_associative_scan: bool,
                            module: str) -> list[torch.Tensor]:
    """Gradients of (x, dt, A, B, C[, D][, z][, delta_bias]) (those given): the kernel re-run under autograd."""
    grads = gradients(lambda *inputs: _run(*inputs, softplus, use_mambapy, use_associative_scan, module),
                      [x, dt, A, B, C, D, z, delta_bias], [grad_out, grad_state])
    return [g for g in grads if g is not None]


def _out_dtype(x, D):
    return x.dtype if D is None else torch.promote_types(x.dtype, D.dtype)


@selective_scan.register_fake
def _selective_scan_fake(x, dt, A, B, C, D, z, delta_bias, *constants):
    return x.new_empty(x.shape, dtype=_out_dtype(x, D))


@selective_scan_with_state.register_fake
def _selective_scan_with_state_fake(x, dt, A, B, C, D, z, delta_bias, *constants):
    state = x.new_empty((x.shape[0], x.shape[1], A.shape[-1]), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=_out_dtype(x, D)), state


@selective_scan_backward.register_fake
def _selective_scan_backward_fake(grad_out, grad_state, x, dt, A, B, C, D, z, delta_bias, *constants):
    return [t.new_empty(t.shape) for t in (x, dt, A, B, C, D, z, delta_bias) if t is not None]


register_rerun_autograd(selective_scan, selective_scan_with_state, selective_scan_backward, tensors=8)


@functools.cache
def _traced_kernel(module: str, hf_kernel):
    """HF's kernel, as the `selective_scan` op where the call is the plain training one (no state out, no packed
    documents); any other call runs HF's kernel inlined (and the walk refuses its loop). One function per kernel, so
    Dynamo's guards see the same global at every call."""

    def kernel(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
               return_last_state=False, use_mambapy=False, use_associative_scan=False, **kwargs):
        packed = kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None
        if return_last_state or packed:
            return hf_kernel(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                             delta_softplus=delta_softplus, return_last_state=return_last_state,
                             use_mambapy=use_mambapy, use_associative_scan=use_associative_scan, **kwargs)
        return selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias, bool(delta_softplus), bool(use_mambapy),
                              bool(use_associative_scan), module)

    kernel._autosp_traced = True
    return kernel


def trace_selective_scans() -> contextlib.AbstractContextManager:
    """While Dynamo traces, every loaded transformers modeling module's `mamba_selective_scan` calls the op."""
    return traced_kernels(KERNEL_NAME, _traced_kernel)


def _expanded_bytes(x, A) -> int:
    """The torch kernel's [B, D, S, N] fp32 arrays: the discretised A and B x, each written once and read once."""
    return 4 * x.shape[0] * x.shape[1] * x.shape[2] * A.shape[-1]


@declare_cost(op("selective_scan"))
@declare_cost(op("selective_scan_with_state"))
def _selective_scan_cost(x, dt, A, *rest):
    """Element-wise work per (channel, position, state entry): bound by the [B, D, S, N] arrays it moves."""
    return "memory", 2.0 * 2 * _expanded_bytes(x, A)


@declare_cost(op("selective_scan_backward"))
def _selective_scan_backward_cost(grad_out, grad_state, x, dt, A, *rest):
    return "memory", RERUN_BACKWARD_FACTOR * 2.0 * 2 * _expanded_bytes(x, A)


@declare_transient_bytes(op("selective_scan"))
@declare_transient_bytes(op("selective_scan_with_state"))
def _selective_scan_scratch(x, dt, A, *rest):
    return 2 * _expanded_bytes(x, A)


@declare_transient_bytes(op("selective_scan_backward"))
def _selective_scan_backward_scratch(grad_out, grad_state, x, dt, A, *rest):
    return 4 * _expanded_bytes(x, A)  # the re-run forward's arrays kept for autograd, and their gradients
