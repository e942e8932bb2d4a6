"""Run a test body on P local gloo ranks (`autosp.harness.launch`: in the suite, forked from the warm-rank server)
and fail the test if any rank fails."""
from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from autosp.harness.launch import launch

_TIMEOUT_S = 600


def run_ranks(world_size: int, body: Callable, *args) -> None:
    """`body(rank, world_size, *args)` on every rank; body must be a module-level (picklable) function."""
    result = launch(_rank, (body, args), world_size=world_size, timeout_s=_TIMEOUT_S)
    assert result.status == "ok", result.traceback or result.error


def _rank(body: Callable, args: tuple) -> None:
    body(dist.get_rank(), dist.get_world_size(), *args)
