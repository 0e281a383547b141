"""Process-wide set-up that only long-lived entry points (the worker, `pagedq generate`, the benchmarks) may do.

A library constructor must not change process-global state, so `LLMEngine` never calls this itself.
"""

from __future__ import annotations

import atexit
import gc

from pagedq.kernels.cpu_allocator import tune_cpu_allocator


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (modules, weights' wrappers, tokenizer) out of the cyclic GC's reach.

    A loaded engine holds hundreds of thousands of long-lived objects, and every full collection walked them all:
    a periodic pause in the step loop (docs/benchmarks-log.md#figures-moved-from-code-comments). vLLM does the same.
    Call it once the engine is built, before serving. It also tunes the CPU allocator (pagedq/kernels/cpu_allocator.py).
    """
    tune_cpu_allocator()
    gc.collect()
    gc.freeze()
    # Thaw at exit so interpreter teardown can still collect them (nanobind, under Triton, reports leaks else).
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
