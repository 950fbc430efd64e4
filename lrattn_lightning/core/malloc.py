"""glibc's allocator, set for a training process: freed memory is kept for the next step instead of given back.

By default glibc serves an allocation above its mmap threshold (dynamic, at most 32 MiB) with fresh pages from the
kernel and unmaps them when freed, and trims the heap's freed top. A training step allocates and frees the same
large arrays every step (at `small`, the [2048 x 4096] logits and their gradient are 32 MiB each), so every step
page-faults them in again: on one CPU thread that is about 6 % of a step (docs/benchmarks.md). Raising both
thresholds keeps those pages in the process, as PyTorch's CUDA caching allocator does for device memory; the
resident memory stays at the step's peak. Only the training commands (fit, validate, test) set it;
LRATTN_MALLOC=system leaves glibc's defaults. Other C libraries (musl, macOS): nothing is changed.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 1 << 30  # allocations below 1 GiB come from the heap, where freed memory is reused
TRIM_THRESHOLD = (1 << 31) - 1  # the heap's freed top is kept (an int: mallopt takes one)


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True where they were set."""
    if os.environ.get("LRATTN_MALLOC", "").strip().lower() == "system":
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
