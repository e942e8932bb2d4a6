"""CPU ranks keep the memory they free, as a device's caching allocator keeps its blocks.

Why: on CPU, torch allocates through glibc's malloc, which hands freed memory back to the kernel (the heap is
trimmed above ``M_TRIM_THRESHOLD``, and a chunk above the mmap threshold is an mmap of its own, unmapped when
freed), so every step page-faults its working set in again and the kernel zeroes each page. That costs CPU time in
proportion to the bytes a step re-acquires, not to its computation: a policy that saves more for backward paid for
it in system time (`tiny`, S=2048, 2 ranks, aot_eager: `--sac auto` 2,739 minor faults and 13 ms of system time per
step, `sac` 1,424 and 6 ms), which no GPU pays (CUDA's caching allocator keeps its blocks for the next step). The
step times measured here stand in for device step times, so each CPU rank tells glibc to keep what it frees:
no trimming, and chunks up to 32 MiB (glibc's own ceiling for its mmap threshold) from the kept heap (same
step, 0 faults). Larger chunks stay mmap'd: serving a repeated 64 MiB tensor from the heap grew it to 7 times the
tensor before a hole was reused (alignment padding), a risk on a shared host that a few faults per large tensor
are not. Peak memory is unaffected: it is read from the profiler's allocation events (`autosp.harness.measure`),
not from the process's resident size.
"""
from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (4 MiB * sizeof(long)): the largest mmap threshold it accepts
MMAP_THRESHOLD_BYTES = 32 * 2**20


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory in this process (trimming off, chunks up to 32 MiB from the heap);
    False where the C library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # mallopt(3): "Setting M_TRIM_THRESHOLD to -1 disables trimming completely"; setting either parameter also
    # ends glibc's dynamic thresholds, so the mmap threshold is set too (else it stays at 128 KiB)
    return bool(mallopt(_M_TRIM_THRESHOLD, -1)) and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
