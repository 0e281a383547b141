"""The CPU allocator setting the CPU kernels' step-sized temporaries need, for long-lived processes."""

from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters (malloc.h) and the values tune_cpu_allocator sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's ceiling for it on 64-bit
_TRIM_THRESHOLD_BYTES = 2**30


def tune_cpu_allocator() -> bool:
    """Keep glibc from handing a step's large temporaries back to the OS between steps. Returns whether it did.

    torch's CPU tensors come from malloc. A block above the mmap threshold is a fresh mmap, and a big free at the
    heap's top is trimmed: either way the next step's tensor of the same size page-faults on every 4 KiB it
    writes. On CPU a decode step allocates hundreds of MB of such temporaries (the K/V each layer gathers, the
    logits): at 48 sequences on SmolLM2 that was ~170,000 minor faults and half of the step's time
    (docs/kernels.md). A fixed 32 MiB mmap threshold and a 1 GiB trim threshold keep them in the heap and reused.
    An MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ in the environment is the user's choice: left alone.
    Process-wide, so only for long-lived entry points (pagedq/engine/startup.py, the benchmarks); a no-op off glibc.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )
