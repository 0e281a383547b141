"""Triton implementations of the public kernels, with exactly the signatures of `kernels.reference`.

`kernels/__init__.py` looks these names up with getattr when the Triton backend is selected. Import this module
only after deciding on TRITON_INTERPRET: Triton fixes compiled-vs-interpreted when the kernels are defined.
"""

from __future__ import annotations

from kernels.activation import silu_and_mul
from kernels.block_copy import copy_blocks
from kernels.decode_attention import paged_decode_attention
from kernels.kv_cache import store_kv_cache
from kernels.norm import head_rms_norm, rms_norm
from kernels.prefill_attention import paged_prefill_attention
from kernels.rotary import rotary_embedding
from kernels.sampling import gumbel_argmax

__all__ = [
    "copy_blocks",
    "gumbel_argmax",
    "head_rms_norm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv_cache",
]
