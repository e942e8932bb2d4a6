"""Device -> host copies that overlap compute: one side stream per device, pinned host buffers.

Shared by the activation offload (`autosp.compiler.memory.offload`) and the gradients sent to host memory
(`autosp.comm.host_params`); the pinned buffers come from the device's `autosp.comm.host_pool` (allocated once,
reused every step). On CPU the "device" is host memory and the copy is a plain one."""
from __future__ import annotations

import torch

from autosp.comm.host_pool import host_pool

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream host copies to and from `device` run on (one per device, made on first use)."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


def synchronize_side_streams() -> None:
    """Wait for every host copy issued so far (on every device)."""
    for side in _side_streams.values():
        side.synchronize()


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`: on CUDA into a pinned buffer of the device's pool on the side stream, after the
    compute stream has made `tensor`, whose memory is not reused before the copy has read it."""
    if tensor.device.type == "cpu":
        return torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)
    side = side_stream(tensor.device)
    host = host_pool(tensor.device).take(tensor.shape, tensor.dtype)
    side.wait_stream(torch.cuda.current_stream(tensor.device))  # the value is complete
    with torch.cuda.stream(side):
        host.copy_(tensor, non_blocking=True)
    tensor.record_stream(side)
    return host
