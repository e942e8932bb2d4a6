"""CPU ranks keep the memory they free, as a device's caching allocator keeps its blocks.

Why: glibc's malloc hands freed memory back to the kernel, so every step page-faults its working set in again,
a CPU cost in proportion to the bytes a step re-acquires that no GPU pays; since CPU step times stand in for
device step times, each CPU rank tells glibc to keep what it frees (no trimming; chunks up to 32 MiB, glibc's
ceiling for its mmap threshold, from the kept heap). Larger chunks stay mmap'd: reusing heap holes for them can
grow the heap to several times the tensor. Peak memory is unaffected (it is read from the profiler's allocation
events, `autosp.harness.measure`). Measured: docs/measurements/2026-12-01-throughput.md, "The host allocator".
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
