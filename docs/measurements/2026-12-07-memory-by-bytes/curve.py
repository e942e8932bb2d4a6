"""One-off (not part of the package): one thread's add rate by operand size, into a fresh output (as `autosp
calibrate` and a step run it) and into a preallocated one (`out=`), to see where the rate falls and why."""
import statistics
import time

import torch

torch.set_num_threads(1)
MIB = 1 << 20


def seconds(fn, inner, repeats=7):
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def rates(operand: int) -> tuple[float, float]:
    """GB/s read + written by an add of two `operand`-byte tensors: into a fresh output, and into a given one."""
    x, y, out = torch.randn(operand // 4), torch.randn(operand // 4), torch.empty(operand // 4)
    inner = max(1, 32 * MIB // operand)
    fresh = 3 * operand / seconds(lambda: x + y, inner) / 1e9
    return fresh, 3 * operand / seconds(lambda: torch.add(x, y, out=out), inner) / 1e9


for size in [256 << 10, MIB, 2 * MIB, 4 * MIB, 8 * MIB, 12 * MIB, 16 * MIB, 24 * MIB, 32 * MIB, 64 * MIB]:
    fresh, into = rates(size)
    print(f"{size / MIB:7.2f} MiB operand: fresh {fresh:6.1f} GB/s  out= {into:6.1f} GB/s")
