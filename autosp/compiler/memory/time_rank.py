"""The planner's plans ranked by predicted step time (issue 43): where the ladder (`planner`) moves saved values to
host memory, the plan that recomputes instead is priced too, and the cheaper one is taken.

A plan's added seconds (`added_seconds`) are its recompute FLOPs at the device's matmul rate plus the copies it
cannot hide: each saved byte goes to host memory during forward and back during backward on the copy stream, so a
copy hides behind the compute of its direction (forward's FLOPs, backward's twice them) and is exposed by what is
left (`autosp.timing.Timeline`'s overlap, summed over the step). The rates are the simulated device's (the
simulator sets them: `planning_rates`) or the CUDA device's catalogue row; on a CPU run, or a device the
catalogue lacks, the ladder decides alone, as before."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from autosp.timing import DeviceRates

_RATES: ContextVar[DeviceRates | None] = ContextVar("autosp_planning_rates", default=None)
#: the catalogue row of a CUDA device, by a marker of its name (`torch.cuda.get_device_name`), first match wins
CUDA_NAMES = (("GH200", "gh200-96gb"), ("H200", "h200-141gb"), ("H100", "h100-80gb"), ("A100-SXM4-40GB", "a100-40gb"),
              ("A100", "a100-80gb"), ("MI300X", "mi300x"), ("MI250", "mi250-gcd"))


@contextlib.contextmanager
def planning_rates(rates: DeviceRates | None) -> Iterator[None]:
    """Inside, the planner prices its plans on `rates` (None: the ladder alone)."""
    token = _RATES.set(rates)
    try:
        yield
    finally:
        _RATES.reset(token)


def current_rates(devices: set[torch.device]) -> DeviceRates | None:
    """The rates plans are priced on: those set by `planning_rates`, else the CUDA device's row, else None."""
    if (rates := _RATES.get()) is not None:
        return rates
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return None
    from autosp.timing.rates import RatesError, device_rates

    name = torch.cuda.get_device_name(cuda[0])
    row = next((row for marker, row in CUDA_NAMES if marker in name), None)
    try:
        return device_rates(row) if row else None
    except RatesError:
        return None


def exposed_copy_seconds(nbytes: int, forward_flops: float, rates: DeviceRates) -> float:
    """Seconds of `nbytes` moved each way that the compute of forward (out) and backward (back) cannot hide."""
    copy = rates.copy_seconds(nbytes)
    forward = rates.matmul_seconds(forward_flops)
    return max(0.0, copy - forward) + max(0.0, copy - 2 * forward)


def added_seconds(recompute_flops: float, offloaded_bytes: int, forward_flops: float, rates: DeviceRates) -> float:
    """A plan's seconds over keeping everything on the device: its recompute and its exposed copies."""
    return rates.matmul_seconds(recompute_flops) + exposed_copy_seconds(offloaded_bytes, forward_flops, rates)
