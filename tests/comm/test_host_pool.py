"""The pinned host pool's bookkeeping on CPU (a plain allocator stands in for pinned memory): buffers allocated once,
sized by the plan's reservation, and reused every step; held chunks are never handed out twice."""
from __future__ import annotations

import gc

import torch
import torch.fx as fx

from autosp.comm.host_pool import ALIGNMENT, HostPool, aligned_bytes, host_pool, pool_stats
from autosp.compiler.memory import OFFLOAD_OP, reserve_host_buffers


class CountingAllocator:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.calls.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)


LAYER_VALUES = [((4, 33, 8), torch.bfloat16), ((4, 33, 8), torch.bfloat16), ((4, 33), torch.float32)]


def one_step(pool: HostPool, layers: int) -> list[torch.Tensor]:
    """Forward's host copies of every layer, filled with a value per copy."""
    copies = []
    for _ in range(layers):
        for shape, dtype in LAYER_VALUES:
            host = pool.take(shape, dtype)
            host.fill_(float(len(copies)))
            copies.append(host)
    return copies


def plan_bytes(layers: int) -> int:
    sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in LAYER_VALUES]
    return aligned_bytes(sizes * layers)


def test_the_pool_allocates_once_and_reuses_every_chunk_from_the_second_step_on():
    allocate = CountingAllocator()
    pool = HostPool(allocate)
    pool.reserve("graph", plan_bytes(layers=3))
    for _ in range(3):
        copies = one_step(pool, layers=3)
        assert [float(c.flatten()[0]) for c in copies] == [float(i) for i in range(9)]  # no two share memory
        kinds = [(c.shape, c.dtype) for c in copies]
        assert kinds == [(torch.Size(shape), dtype) for shape, dtype in LAYER_VALUES * 3]
        del copies  # backward reloaded them: the host copies die
        gc.collect()
    assert allocate.calls == [plan_bytes(layers=3)]  # one slab, the plan's size, at the first step
    assert (pool.stats.slabs, pool.stats.carved, pool.stats.reused, pool.stats.misses) == (1, 9, 18, 0)


def test_a_chunk_still_held_is_not_handed_out_and_requests_past_the_plan_are_served_and_counted():
    allocate = CountingAllocator()
    pool = HostPool(allocate)
    pool.reserve("graph", aligned_bytes([64]))
    held = pool.take((16,), torch.float32)
    held.fill_(7.0)
    extra = pool.take((16,), torch.float32)  # the slab is full and the only chunk is held: a fresh buffer
    extra.fill_(1.0)
    assert torch.equal(held, torch.full((16,), 7.0))
    assert pool.stats.misses == 1 and allocate.calls == [ALIGNMENT, ALIGNMENT]
    del held
    gc.collect()
    again = pool.take((16,), torch.float32)
    assert pool.stats.reused == 1 and len(allocate.calls) == 2
    assert again.dtype == torch.float32 and again.shape == (16,)


def test_a_graph_compiled_again_replaces_its_reservation():
    pool = HostPool(CountingAllocator())
    pool.reserve("graph", 4096)
    pool.reserve("graph", 8192)  # the same values at a longer length
    pool.reserve("other", 512)
    assert pool.capacity == 8192 + 512


def offload_graph(length: int) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(length, 16, dtype=torch.bfloat16, device="meta")
    h = graph.call_function(torch.ops.aten.relu.default, (x,))
    h.meta["val"] = x.meta["val"]
    host = graph.call_function(OFFLOAD_OP, (h,))
    host.meta["val"] = torch.empty(length, 16, dtype=torch.bfloat16)
    graph.output((h, host))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_the_offload_pass_reserves_what_its_plan_moves_on_the_device_it_moves_from():
    device = torch.device("meta")  # any device but the CPU (which copies into plain memory) reserves
    pool = host_pool(device)
    before = pool.capacity
    reserve_host_buffers(offload_graph(1000))
    assert pool.capacity - before == aligned_bytes([1000 * 16 * 2])
    reserve_host_buffers(offload_graph(3000))  # compiled again at another length: replaced, not added
    assert pool.capacity - before == aligned_bytes([3000 * 16 * 2])


def test_a_runs_record_carries_what_each_used_pool_did_and_nothing_for_a_cpu_run():
    device = torch.device("meta")
    pool = host_pool(device)
    pool.allocate = CountingAllocator()  # a GPU's pinned slabs, stood in for by plain memory
    pool.reserve("record", aligned_bytes([64]))
    held = pool.take((16,), torch.float32)
    assert pool_stats()["meta"]["carved"] >= 1 and "cpu" not in pool_stats()
    del held
