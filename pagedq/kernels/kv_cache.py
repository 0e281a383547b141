"""store_kv_cache: scatter this step's keys/values into the paged KV cache.

Shapes and strides
    key, value   [T, Hkv, D]          any token/head strides, last dim contiguous (may be views of a fused qkv)
    k_cache,     [num_blocks, block_size, Hkv, D], contiguous, so one slot's Hkv*D values are adjacent:
    v_cache      flat offset of (slot, head, d) = slot * Hkv*D + head * D + d, slot = block * block_size + offset
    slot_mapping [T] int32/int64, -1 = padding token, nothing written

Math: k_cache.flat[slot_mapping[t]] = key[t] (cast to the cache dtype), same for value.

One program per token copies the whole [Hkv, D] tile of both K and V: the work per token is small
(8 heads x 128 dims = 2 KiB per tensor in bf16), so finer grids would only add launch overhead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels.triton_common import (
    check_float_dtype,
    check_int_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_paged_caches,
    check_same_device,
    padded_pow2,
)


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: pools can exceed 2**31 elements
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]

    key_offsets = token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :]
    key = tl.load(key_ptr + key_offsets, mask=mask)
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)

    value_offsets = token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :]
    value = tl.load(value_ptr + value_offsets, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_store_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    fn = "store_kv_cache"
    check_paged_caches(fn, k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    for name, tensor in (("key", key), ("value", value)):
        check_ndim(fn, name, tensor, 3, "[T, Hkv, D]")
        if tuple(tensor.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{fn}: {name} must be [T, {num_kv_heads}, {head_dim}] to match the cache, got {tuple(tensor.shape)}"
            )
        check_float_dtype(fn, name, tensor)
        check_last_dim_contiguous(fn, name, tensor)
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"{fn}: key has {key.shape[0]} tokens but value has {value.shape[0]}")
    check_ndim(fn, "slot_mapping", slot_mapping, 1, "[T]")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"{fn}: slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    check_int_dtype(fn, "slot_mapping", slot_mapping, (torch.int32, torch.int64))
    check_same_device(fn, key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hkv, D] into the caches at slot_mapping [T]; slot -1 means skip. In place."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, num_kv_heads, head_dim = k_cache.shape
    slot_mapping = slot_mapping.contiguous()
    _store_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=padded_pow2(num_kv_heads),
        HEAD_DIM_PAD=padded_pow2(head_dim),
        num_warps=4,
    )
