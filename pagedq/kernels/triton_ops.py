"""Triton implementations of the public kernels, with exactly the signatures of `kernels.reference`.

`pagedq/kernels/__init__.py` looks these names up with getattr when the Triton backend is selected. Import this module
only after deciding on TRITON_INTERPRET: Triton fixes compiled-vs-interpreted when the kernels are defined.
"""

from __future__ import annotations

from pagedq.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from pagedq.kernels.block_copy import copy_blocks
from pagedq.kernels.decode_attention import paged_decode_attention
from pagedq.kernels.kv_cache import store_kv_cache
from pagedq.kernels.lora_segments import lora_add, lora_expand, lora_shrink
from pagedq.kernels.moe import fused_moe
from pagedq.kernels.norm import head_rms_norm, rms_norm
from pagedq.kernels.prefill_attention import paged_prefill_attention
from pagedq.kernels.rotary import rotary_embedding
from pagedq.kernels.sampling import gumbel_argmax

__all__ = [
    "copy_blocks",
    "fused_moe",
    "gelu_tanh_and_mul",
    "gumbel_argmax",
    "head_rms_norm",
    "lora_add",
    "lora_expand",
    "lora_shrink",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv_cache",
]
