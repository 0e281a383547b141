"""Kernels of the paged engine, bound to a backend once per model.

Every public function here has a plain-PyTorch reference in `kernels.reference` with the same signature and a
Triton implementation in `kernels.triton_ops`. `bind(device)` picks the backend once (Triton on CUDA; on CPU
"cpu": the reference with its paged attention replaced by `kernels.cpu_attention`, index_select + torch's SDPA,
fused_moe by `kernels.cpu_moe`, grouped by expert, and lora_add by `kernels.cpu_lora`, grouped by slot;
`PAGEDQ_KERNELS=triton|cpu|reference` forces one, and with `TRITON_INTERPRET=1` the Triton path runs on CPU
through Triton's interpreter) and returns a `KernelSet`: the engine binds one when it builds the
model, so the environment is read once, not per call. A kernel missing from the Triton backend raises at bind
time instead of falling back to the reference. The module-level functions (`kernels.rms_norm`, ...) bind per
call: for tests and one-off use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedq.kernels import cpu_attention, cpu_lora, cpu_moe, reference

_BACKENDS = ("triton", "cpu", "reference")
KERNEL_NAMES = (
    "store_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "head_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "copy_blocks",
    "gumbel_argmax",
    # LoRA (issue 36)
    "lora_shrink",
    "lora_expand",
    "lora_add",
    "fused_moe",
)
# What the "cpu" backend takes from a CPU path of its own instead of the reference: the paged attention
# (index_select + SDPA, or the native kernel), the MoE grouped by expert (the reference masks per expert) and the
# LoRA products grouped by slot.
CPU_PATHS: dict[str, Callable] = {
    "paged_decode_attention": cpu_attention.paged_decode_attention,
    "paged_prefill_attention": cpu_attention.paged_prefill_attention,
    "fused_moe": cpu_moe.fused_moe,
    "lora_add": cpu_lora.grouped_lora_add,
}


def selected_backend(device: torch.device) -> str:
    """The kernel backend for tensors on `device`: PAGEDQ_KERNELS if set, else Triton on CUDA, "cpu" elsewhere."""
    forced = os.environ.get("PAGEDQ_KERNELS", "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"PAGEDQ_KERNELS must be one of {_BACKENDS}, got {forced!r}")
        return forced
    return "triton" if device.type == "cuda" else "cpu"


@dataclass(frozen=True)
class KernelSet:
    """Every kernel, resolved for one backend."""

    backend: str
    store_kv_cache: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
    rms_norm: Callable
    head_rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    gelu_tanh_and_mul: Callable
    copy_blocks: Callable
    gumbel_argmax: Callable
    lora_shrink: Callable
    lora_expand: Callable
    lora_add: Callable
    fused_moe: Callable


def bind(device: torch.device | str) -> KernelSet:
    """The kernels for tensors on `device`. Raises NotImplementedError if the Triton backend lacks one."""
    backend = selected_backend(torch.device(device))
    if backend == "cpu" and torch.device(device).type != "cpu":
        raise ValueError(f"PAGEDQ_KERNELS=cpu runs on CPU tensors only, not on {device}: use triton or reference")
    if backend in ("reference", "cpu"):
        paths = CPU_PATHS if backend == "cpu" else {}
        return KernelSet(backend, **{name: paths.get(name) or getattr(reference, name) for name in KERNEL_NAMES})
    from pagedq.kernels import triton_ops  # imported lazily: Triton reads TRITON_INTERPRET when kernels are defined

    impls = {name: getattr(triton_ops, name, None) for name in KERNEL_NAMES}
    missing = [name for name, impl in impls.items() if impl is None]
    if missing:
        raise NotImplementedError(
            f"the Triton kernel backend has no {', '.join(missing)}: implement it in "
            f"pagedq.kernels.triton_ops, or run with PAGEDQ_KERNELS=reference"
        )
    return KernelSet(backend, **{name: impl for name, impl in impls.items() if impl is not None})


def _dispatch(name: str) -> Callable:
    ref = getattr(reference, name)

    def call(*args, **kwargs):
        first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
        return getattr(bind(first.device), name)(*args, **kwargs)

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
gelu_tanh_and_mul = _dispatch("gelu_tanh_and_mul")
copy_blocks = _dispatch("copy_blocks")
gumbel_argmax = _dispatch("gumbel_argmax")
lora_shrink = _dispatch("lora_shrink")
lora_expand = _dispatch("lora_expand")
lora_add = _dispatch("lora_add")
fused_moe = _dispatch("fused_moe")

__all__ = ["KERNEL_NAMES", "KernelSet", "bind", "selected_backend", *KERNEL_NAMES]
