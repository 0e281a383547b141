"""rotary_embedding: neox-style ("rotate half") RoPE on query and key.

Shapes and strides
    query [T, Hq, D], key [T, Hkv, D]   any token/head strides (views of a fused qkv are fine), last dim contiguous
    positions [T] int64/int32           position of each token
    cos_sin_cache [max_pos, D]          row p = cat(cos(p * f_0..f_{D/2-1}), sin(p * f_0..f_{D/2-1})), contiguous
    -> new contiguous (query, key) of the same shapes and dtypes; the inputs are left untouched, as in the
       reference, so callers that keep using the pre-rotation tensors see no difference between backends.

Math, with x = (x1, x2) split at D/2 and c, s = cos/sin rounded to x's dtype (as the reference does):
    out1 = x1 * c - x2 * s,   out2 = x2 * c + x1 * s        (computed in fp32, rounded once)

One program per token rotates all its query and key heads, so the cos/sin row is read once per token.
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
    check_same_device,
    padded_pow2,
)


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, token, stride_token, stride_head, cos, sin,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """Rotate the [NUM_HEADS, 2 * HALF] tile of one token; cos/sin are [HALF_PAD] fp32 rows."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HALF)
    first_half = token * stride_token + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(x_ptr + first_half, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + first_half + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    out_first_half = token * (NUM_HEADS * 2 * HALF) + heads[:, None] * (2 * HALF) + dims[None, :]
    tl.store(out_ptr + out_first_half, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + out_first_half + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr, key_ptr, query_out_ptr, key_out_ptr, positions_ptr, cos_sin_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF
    cos_sin_row = cos_sin_ptr + position * (2 * HALF)
    # Round cos/sin to the activation dtype first: the reference multiplies in that dtype.
    cos = tl.load(cos_sin_row + dims, mask=dim_mask, other=0.0).to(query_ptr.dtype.element_ty).to(tl.float32)
    sin = tl.load(cos_sin_row + HALF + dims, mask=dim_mask, other=0.0).to(query_ptr.dtype.element_ty)
    sin = sin.to(tl.float32)
    _rotate_heads(query_ptr, query_out_ptr, token, stride_q_token, stride_q_head, cos, sin,
                  NUM_Q_HEADS, HALF, Q_HEADS_PAD, HALF_PAD)  # fmt: skip
    _rotate_heads(key_ptr, key_out_ptr, token, stride_k_token, stride_k_head, cos, sin,
                  NUM_KV_HEADS, HALF, KV_HEADS_PAD, HALF_PAD)  # fmt: skip


def _check_rotary_args(query, key, positions, cos_sin_cache) -> None:
    fn = "rotary_embedding"
    check_ndim(fn, "query", query, 3, "[T, Hq, D]")
    check_ndim(fn, "key", key, 3, "[T, Hkv, D]")
    if key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(f"{fn}: key must be [T, Hkv, D] like query {tuple(query.shape)}, got {tuple(key.shape)}")
    if query.shape[2] % 2 != 0:
        raise ValueError(f"{fn}: head_dim must be even, got {query.shape[2]}")
    for name, tensor in (("query", query), ("key", key)):
        check_float_dtype(fn, name, tensor)
        check_last_dim_contiguous(fn, name, tensor)
    if key.dtype != query.dtype:
        raise ValueError(f"{fn}: key dtype {key.dtype} must match query dtype {query.dtype}")
    check_ndim(fn, "positions", positions, 1, "[T]")
    if positions.shape[0] != query.shape[0]:
        raise ValueError(f"{fn}: positions has {positions.shape[0]} entries for {query.shape[0]} tokens")
    check_int_dtype(fn, "positions", positions, (torch.int64, torch.int32))
    check_ndim(fn, "cos_sin_cache", cos_sin_cache, 2, "[max_pos, D]")
    if cos_sin_cache.shape[1] != query.shape[2]:
        raise ValueError(
            f"{fn}: cos_sin_cache must be [max_pos, {query.shape[2]}] (full-dim rotary), "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    check_float_dtype(fn, "cos_sin_cache", cos_sin_cache)
    check_same_device(fn, query=query, key=key, positions=positions, cos_sin_cache=cos_sin_cache)


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE. query [T, Hq, D], key [T, Hkv, D], positions [T], cos_sin_cache [max_pos, D] -> (query, key)."""
    _check_rotary_args(query, key, positions, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query, key, query_out, key_out, positions.contiguous(), cos_sin_cache.contiguous(),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        Q_HEADS_PAD=padded_pow2(num_q_heads), KV_HEADS_PAD=padded_pow2(num_kv_heads), HALF_PAD=padded_pow2(half),
        num_warps=4,
    )  # fmt: skip
    return query_out, key_out
