"""One-off diagnostic (not part of the package): what a gloo all-gather, reduce-scatter, all-reduce and all-to-all
cost in a tight loop with 1 to 2M floats a rank (ZeRO-3's shard sizes for llama3-mini are 2K-512K), against the
committed cpu row's price (run before the row had `collective_by_bytes`: latency + bytes sent / peer). Two ranks,
one thread each; prints rank 0's medians."""
import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autosp.timing.rates import device_rates


def bench(rank: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29537")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    row = device_rates("cpu")

    def per_call(fn, n: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n

    lines = []
    for numel in (1, 2048, 8192, 32768, 131072, 524288, 2097152):
        shard = torch.randn(numel)
        whole = torch.empty(world * numel)
        other = torch.empty(world * numel)
        n = 40 if numel <= 32768 else 10
        for name, fn in (("all_gather", functools.partial(dist.all_gather_into_tensor, whole, shard)),
                         ("reduce_scatter", functools.partial(dist.reduce_scatter_tensor, shard, whole)),
                         ("all_reduce", functools.partial(dist.all_reduce, whole)),
                         ("all_to_all", functools.partial(dist.all_to_all_single, other, whole))):
            fn()
            took = statistics.median(per_call(fn, n) for _ in range(5))
            priced = row.collective_seconds(name, whole.nbytes, world, world)
            lines.append(f"{name:15s} {numel * 4:>9,d} B a rank: {took * 1e6:8.0f} us, priced {priced * 1e6:8.0f} us,"
                         f" {took / priced:5.2f}x")
    if rank == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(bench, args=(2,), nprocs=2)
    sys.exit(0)
