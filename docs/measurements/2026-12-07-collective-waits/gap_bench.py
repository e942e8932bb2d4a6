"""One-off diagnostic (not part of the package): what a one-element gloo all-reduce costs right after a stretch of
compute, against the same all-reduce in a tight loop (the calibration's `collective_latency_us`). Two ranks, one
thread each; prints rank 0's medians."""
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def bench(rank: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    one, a = torch.ones(1), torch.randn(128, 128)

    def per_call(fn, n: int = 40) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    lines = [f"tight loop: {statistics.median(per_call(lambda: dist.all_reduce(one)) for _ in range(5)):.0f} us"]
    for matmuls in (0, 1, 4, 16, 64, 256):
        def compute(matmuls: int = matmuls) -> None:
            for _ in range(matmuls):
                a @ a

        alone, with_collective = [], []
        for _ in range(7):
            alone.append(per_call(compute))
            with_collective.append(per_call(lambda: (compute(), dist.all_reduce(one))))
        extra = statistics.median(b - c for c, b in zip(alone, with_collective, strict=True))
        lines.append(f"{matmuls} matmuls: compute {statistics.median(alone):.0f} us, the all-reduce after it "
                     f"{extra:.0f} us")
    if rank == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(bench, args=(2,), nprocs=2)
