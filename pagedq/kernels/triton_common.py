"""Helpers shared by the Triton kernels: launcher checks, the interpreter workaround for tl.dot, padding sizes.

Nothing here launches a kernel. The launchers in the sibling modules use these to validate their arguments
with messages that name the public function and the offending tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def runs_in_interpreter(kernel) -> bool:
    """True when `kernel` was defined under TRITON_INTERPRET=1 (Triton then returns a non-JIT wrapper)."""
    return not isinstance(kernel, JITFunction)


def needs_dot_upcast(kernel, dtype: torch.dtype) -> bool:
    """Whether tl.dot operands of `dtype` must be widened to fp32 before the product.

    Triton's interpreter stores bf16 as raw uint16 and multiplies those integers in tl.dot (3.6 through 3.9),
    so bf16 dots are garbage there. Widening bf16 to fp32 and multiplying in IEEE fp32 gives exactly the
    products a bf16 tensor-core MMA accumulates in fp32, so the interpreter still tests the same math.
    On a GPU this is always False and the native bf16 MMA runs.
    """
    return dtype == torch.bfloat16 and runs_in_interpreter(kernel)


@triton.jit
def dot_fp32_acc(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation; IEEE fp32 (not TF32) when the operands are fp32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


def needs_bf16_rounding_by_hand(kernel, dtype: torch.dtype) -> bool:
    """Whether fp32 -> `dtype` casts must round to nearest even by hand (`round_to`).

    Triton's interpreter truncates fp32 -> bf16 (3.6 through 3.9) where the GPU and torch round to nearest even;
    a kernel that rounds several intermediates as its torch reference does would drift a few ulps low there.
    On a GPU this is always False and the plain cast rounds.
    """
    return dtype == torch.bfloat16 and runs_in_interpreter(kernel)


@triton.jit
def round_to(x, dtype: tl.constexpr, BY_HAND: tl.constexpr):
    """fp32 x rounded to nearest even in `dtype`; BY_HAND (bf16 in the interpreter only) rounds the fp32 bits to
    their top 16 first, so that the interpreter's truncating cast is exact. Finite values only."""
    if BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def padded_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): Triton block shapes must be powers of two."""
    return max(triton.next_power_of_2(n), minimum)


def check_float_dtype(fn: str, name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_FLOAT_DTYPES:
        raise ValueError(f"{fn}: {name} must be float32, float16 or bfloat16, got {tensor.dtype}")


def check_int_dtype(fn: str, name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{fn}: {name} must be {names}, got {tensor.dtype}")


def check_ndim(fn: str, name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be {layout}, got shape {tuple(tensor.shape)}")


def check_contiguous(fn: str, name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous, got strides {tensor.stride()}")


def check_last_dim_contiguous(fn: str, name: str, tensor: torch.Tensor) -> None:
    """Views (e.g. q/k/v sliced out of a fused qkv projection) are fine as long as rows are dense."""
    if tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} must have a contiguous last dimension, got strides {tensor.stride()}")


def check_same_device(fn: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{fn}: all tensors must be on one device, got {devices}")


def check_paged_caches(fn: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches [num_blocks, block_size, num_kv_heads, head_dim], same shape/dtype, contiguous."""
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_ndim(fn, "k_cache", k_cache, 4, layout)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{fn}: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{fn}: v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    check_float_dtype(fn, "k_cache", k_cache)
    check_contiguous(fn, "k_cache", k_cache)
    check_contiguous(fn, "v_cache", v_cache)


def check_paged_attention_inputs(fn: str, query, k_cache, v_cache, block_tables, layout: str) -> None:
    """The checks both paged attention launchers share: the caches, the query against them, the block tables."""
    check_paged_caches(fn, k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check_ndim(fn, "query", query, 3, layout)
    if query.shape[2] != head_dim or query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"{fn}: query must be {layout} with D = {head_dim} and Hq a multiple of the cache's "
            f"{num_kv_heads} KV heads, got {tuple(query.shape)}"
        )
    check_float_dtype(fn, "query", query)
    if query.dtype != k_cache.dtype:
        raise ValueError(f"{fn}: query dtype {query.dtype} must match the cache dtype {k_cache.dtype}")
    check_last_dim_contiguous(fn, "query", query)
    check_ndim(fn, "block_tables", block_tables, 2, "[S, max_blocks]")
    check_int_dtype(fn, "block_tables", block_tables, (torch.int32,))
    if block_tables.stride(-1) != 1:
        raise ValueError(f"{fn}: block_tables rows must be contiguous, got strides {block_tables.stride()}")


@triton.jit
def paged_kv_offsets(
    table_row,
    positions,
    mask,
    dims,
    kv_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
):
    """Element offsets [N, D] of one sequence's cached K/V rows at `positions` [N], found through its block
    table row: page = table[pos // BLOCK_SIZE], slot = pos % BLOCK_SIZE. Masked positions read page 0."""
    blocks = tl.load(table_row + positions // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    token_offsets = blocks * stride_cache_block + (positions % BLOCK_SIZE) * stride_cache_slot
    return (token_offsets + kv_head * stride_cache_head)[:, None] + dims[None, :]
