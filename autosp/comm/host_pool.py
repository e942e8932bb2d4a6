"""Pinned host buffers allocated once, sized by the plan, and reused every step.

What a step moves to host memory (saved activations, gradients of host parameters) has the same sizes every step,
so the buffers are carved once out of a few large pinned slabs: the offload pass reserves the bytes its plan moves
(`reserve`), the first step allocates the slabs, and each host copy takes a chunk of exactly its size (`take`); a
chunk returns to the free list when the host tensor made from it dies (after backward reloaded it), so step 2 on
allocates nothing. Pinning is slow (cudaHostAlloc runs at a few GB/s and serialises with the device) and torch's
caching host allocator rounds each block up to a power of two (up to 2x the host memory a plan was sized for).

Safety without events: every write into a chunk (the device -> host copy) and every read of it by the device (the
reload) run on the one side stream of `autosp.comm.host_copy`, so a reused chunk's next write is ordered after its
previous reload. A request the slabs cannot hold is served by a fresh pinned tensor and counted (`misses`).
The bookkeeping is device-agnostic and tested on CPU with a plain allocator (`HostPool(allocate=...)`)."""
from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

ALIGNMENT = 512
"""Bytes each chunk starts on (DMA-friendly, and a multiple of every dtype's element size)."""


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` of pinned host memory (needs CUDA/ROCm)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@dataclass
class PoolStats:
    """What the pool did so far: slabs and their bytes, chunks carved, takes served from the free list, misses."""

    slabs: int = 0
    slab_bytes: int = 0
    carved: int = 0
    reused: int = 0
    misses: int = 0


class HostPool:
    """Chunks of pinned host memory by exact byte size (module docstring)."""

    def __init__(self, allocate: Callable[[int], torch.Tensor] = pinned_bytes) -> None:
        self.allocate = allocate
        self._reserved: dict[str, int] = {}  # what each compiled graph's plan moves per step
        self._slabs: list[torch.Tensor] = []
        self._tail = 0  # first free byte of the newest slab
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)  # chunk bytes -> free chunks
        self.stats = PoolStats()

    def reserve(self, owner: str, nbytes: int) -> None:
        """`owner`'s plan moves `nbytes` per step (a later reservation by the same owner replaces its earlier one)."""
        self._reserved[owner] = nbytes

    @property
    def capacity(self) -> int:
        """Bytes the slabs should hold: each reservation, every chunk aligned."""
        return sum(self._reserved.values())

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of `shape` and `dtype` from the pool; its chunk is free again when the tensor
        (and every view of it) dies."""
        numel = 1
        for size in shape:
            numel *= size
        nbytes = _aligned(numel * torch.empty((), dtype=dtype).element_size())
        chunk = self._chunk(nbytes)
        if chunk is None:
            self.stats.misses += 1
            return self.allocate(nbytes)[: nbytes].view(dtype)[:numel].view(shape)
        host = chunk.view(dtype)[:numel].view(shape)
        weakref.finalize(host, self._free[nbytes].append, chunk)
        return host

    def _chunk(self, nbytes: int) -> torch.Tensor | None:
        if self._free[nbytes]:
            self.stats.reused += 1
            return self._free[nbytes].pop()
        slab = self._slabs[-1] if self._slabs else None
        if slab is None or self._tail + nbytes > slab.numel():
            grow = max(self.capacity - self.stats.slab_bytes, 0)
            if grow < nbytes:
                return None
            slab = self.allocate(grow)
            self._slabs.append(slab)
            self._tail = 0
            self.stats.slabs += 1
            self.stats.slab_bytes += grow
        chunk = slab[self._tail: self._tail + nbytes]
        self._tail += nbytes
        self.stats.carved += 1
        return chunk


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def aligned_bytes(sizes: list[int]) -> int:
    """What chunks of these byte sizes take in a slab (what `HostPool.reserve` should be given)."""
    return sum(_aligned(size) for size in sizes)


_pools: dict[torch.device, HostPool] = {}


def host_pool(device: torch.device) -> HostPool:
    """The pool host copies from `device` take their buffers from (one per device, made on first use)."""
    if device not in _pools:
        _pools[device] = HostPool()
    return _pools[device]


def pool_stats() -> dict[str, dict[str, int]]:
    """What each device's pool did so far (`PoolStats`), for a run's record; devices whose pool was never used are
    left out (a CPU run copies into plain memory: empty)."""
    return {str(device): asdict(pool.stats) for device, pool in _pools.items() if pool.stats.slabs or pool.stats.misses}
