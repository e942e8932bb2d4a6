"""Parameters in host memory (ZeRO-Infinity's `offload_param`, `offload="...,params"`): each parameter this rank
stores (its flat ZeRO-3 shard; at one rank the whole parameter, a "shard" of one) lives in host memory; the compiled
graph fetches it to the device where the model uses it, in forward and again in backward (the fetch is re-run in
backward as ZeRO 3's gather is, `autosp.compiler.memory.tags.is_regather`), and its gradient goes back to host memory
as soon as backward has made it (after the gather's reduce-scatter at P > 1), its device copy then freed. So the
device never holds more than the layers in use of parameters or gradients.

The parametrization (`autosp.comm.sharding.ShardedParameter` with a fetch device) calls `fetch_parameter` on the
host shard: forward a host -> device copy, backward `gradient_to_host`, a device -> host copy of the gradient.
Autograd accumulates it into the host parameter's `.grad`, which the host optimizer (`autosp.comm.host_optimizer`,
required: the `optimizer` item) reads for its CPU step and writes back into.

Devices: on CUDA the host shards are pinned, the fetch is a `non_blocking` copy on the compute stream, the gradient's
copy runs on a side stream (which first waits for the compute stream; the device gradient is kept alive for the
copy by `record_stream`), the host optimizer synchronises the device before it reads the gradients, and a gradient
accumulated into an existing `.grad` waits for the copies first. Written
against torch's CUDA API, not run on a GPU here. On CPU the device *is* host memory, so a device run is emulated:
the host shards are allocated inside the host optimizer's `host_region` and the gradients inside the
`gradient_to_host` op, both of which the CPU memory meter (and the simulator's tracker) book as host memory.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from autosp.comm import host_optimizer
from autosp.comm.host_copy import synchronize_side_streams, to_host
from autosp.comm.library import custom_op, op, qualified
from autosp.errors import SequenceParallelError

def _check(device: torch.device) -> None:
    if device.type not in ("cpu", "cuda"):
        raise SequenceParallelError(f"offload=params runs on CUDA/ROCm (pinned host memory) or CPU (emulated), not on "
                                    f"{device.type}: drop params from offload")


@custom_op("fetch_parameter", mutates_args=())
def fetch_parameter(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a parameter's host shard) copied to `device`; its gradient goes back to host memory
    (`gradient_to_host`)."""
    _check(device)
    if device.type == "cpu":
        return host.clone()
    return host.to(device, non_blocking=True, copy=True)  # pinned source: ordered on the compute stream


@fetch_parameter.register_fake
def _(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(host.shape, dtype=host.dtype, device=device)


@custom_op("gradient_to_host", mutates_args=())
def gradient_to_host(grad: torch.Tensor) -> torch.Tensor:
    """`grad` copied to host memory (pinned, on a side stream on CUDA): the device copy dies with its last use."""
    _check(grad.device)
    return to_host(grad)


@gradient_to_host.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty(grad.shape, dtype=grad.dtype, device="cpu")


def _fetch_backward(ctx, grad):
    return gradient_to_host(grad), None


fetch_parameter.register_autograd(_fetch_backward)

FETCH_OP = op("fetch_parameter").default
GRADIENT_TO_HOST_OP = op("gradient_to_host").default
"""What the simulator's storage tracker books as host memory (the gradients streamed to host in backward)."""
GRADIENT_TO_HOST_NAME = qualified("gradient_to_host")
"""The profiler event name of `gradient_to_host`: the CPU memory meter books allocations made inside it as host."""


def place_on_host(params: Iterable[nn.Parameter]) -> None:
    """Move each parameter's data to host memory (pinned when it was on a GPU), allocated inside the host
    optimizer's `host_region` (booked as host memory)."""
    for p in dict.fromkeys(params):
        pinned = p.device.type == "cuda"
        with host_optimizer.host_region():
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pinned).copy_(p.detach())
        p.data = host
        if pinned:
            p.register_hook(_copies_done_before_accumulating(p))


def _copies_done_before_accumulating(p: nn.Parameter):
    """A gradient hook: before autograd adds a new host gradient to an existing `.grad` (gradient accumulation over
    several backward calls, on the CPU), the side stream's copies into both have finished (the host optimizer
    synchronises before its step, which covers a single backward)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if p.grad is not None:
            synchronize_side_streams()
        return grad

    return hook
