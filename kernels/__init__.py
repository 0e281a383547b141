"""Kernels of the paged engine, dispatched by device.

Every public function here has a plain-PyTorch reference in `kernels.reference` with the same signature.
On CUDA tensors the Triton implementation runs; on CPU the reference does. `PAGEDQ_KERNELS=triton|reference`
forces one path (with `TRITON_INTERPRET=1`, the Triton path runs on CPU through Triton's interpreter).
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from kernels import reference

_BACKENDS = ("triton", "reference")


def selected_backend(device: torch.device) -> str:
    """The kernel backend for tensors on `device`: PAGEDQ_KERNELS if set, else Triton on CUDA only."""
    forced = os.environ.get("PAGEDQ_KERNELS", "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"PAGEDQ_KERNELS must be one of {_BACKENDS}, got {forced!r}")
        return forced
    return "triton" if device.type == "cuda" else "reference"


def _triton_impl(name: str) -> Callable | None:
    """The Triton implementation of `name`, or None where the Triton module does not provide it yet."""
    from kernels import triton_ops  # imported lazily: Triton reads TRITON_INTERPRET when kernels are defined

    return getattr(triton_ops, name, None)


def _dispatch(name: str) -> Callable:
    ref = getattr(reference, name)

    def call(*args, **kwargs):
        first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
        device = first.device
        if selected_backend(device) == "triton":
            impl = _triton_impl(name)
            if impl is not None:
                return impl(*args, **kwargs)
        return ref(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = ref.__doc__
    return call


store_kv_cache = _dispatch("store_kv_cache")
paged_decode_attention = _dispatch("paged_decode_attention")
paged_prefill_attention = _dispatch("paged_prefill_attention")
rms_norm = _dispatch("rms_norm")
head_rms_norm = _dispatch("head_rms_norm")
rotary_embedding = _dispatch("rotary_embedding")
silu_and_mul = _dispatch("silu_and_mul")
copy_blocks = _dispatch("copy_blocks")
gumbel_argmax = _dispatch("gumbel_argmax")

__all__ = [
    "selected_backend",
    "store_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "head_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "copy_blocks",
    "gumbel_argmax",
]
