"""rms_norm (fused residual add + RMSNorm) and head_rms_norm (per-head RMSNorm, Qwen3's q/k norm).

Shapes and strides
    rms_norm:      x, residual [T, H] (rows may be strided, last dim contiguous), weight [H]
                   -> normed [T, H] in promote(weight, x) dtype (x's with unit_offset), new_residual [T, H] in x
                   dtype (both contiguous)
    head_rms_norm: x [T, Hh, D] (any token/head strides, last dim contiguous), weight [D]
                   -> [T, Hh, D] in promote(weight, x) dtype (x's with unit_offset), contiguous

Math (transformers' numerics, which the reference spells out):
    s = x + residual, rounded to x's dtype     (that rounded sum is also the new residual)
    normed = (s * rsqrt(mean(s^2) + eps)) in fp32, rounded to x's dtype, then * weight in the output dtype.
The intermediate rounding to x's dtype is deliberate: skipping it would be more accurate but would not match
the model the weights were trained with. With unit_offset (Gemma) the model was trained without it:
    normed = (s * rsqrt(mean(s^2) + eps)) * (1 + weight), all in fp32, rounded to x's dtype once.

One program per row (per token for head_rms_norm, all heads of the token at once): a row is at most a few
thousand elements, so the whole row sits in registers and is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels.triton_common import (
    check_float_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    padded_pow2,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    stride_x_row, stride_residual_row, eps,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual_row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * HIDDEN + cols, x, mask=mask)
    x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / HIDDEN
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        out = (x * tl.math.rsqrt(variance + eps)) * (1.0 + weight)
    else:
        normed = (x * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
        out = weight * normed.to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _head_rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, stride_x_token, stride_x_head, eps,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    mask = (heads[:, None] < NUM_HEADS) & dim_mask[None, :]
    x_offsets = token * stride_x_token + heads[:, None] * stride_x_head + dims[None, :]
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=1) / HEAD_DIM
    weight = tl.load(weight_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        out = (x * tl.math.rsqrt(variance + eps)[:, None]) * (1.0 + weight)[None, :]
    else:
        normed = (x * tl.math.rsqrt(variance + eps)[:, None]).to(x_ptr.dtype.element_ty)
        out = weight[None, :] * normed.to(tl.float32)
    out_offsets = token * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def _row_num_warps(row_elements: int) -> int:
    """Enough warps that each thread holds ~8-16 elements of the row (vectorised 16-byte loads); a power of two, as
    Triton requires, whatever the row (hidden 3584: Qwen2-7B, Gemma 2 9B)."""
    return min(16, max(1, padded_pow2(row_elements) // 256))


def _check_weight(fn: str, weight: torch.Tensor, size: int, x: torch.Tensor) -> None:
    check_ndim(fn, "weight", weight, 1, f"[{size}]")
    if weight.shape[0] != size:
        raise ValueError(f"{fn}: weight must be [{size}] to match x {tuple(x.shape)}, got {tuple(weight.shape)}")
    check_float_dtype(fn, "weight", weight)
    check_same_device(fn, x=x, weight=weight)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm. x, residual [T, H]; weight [H] -> (normed, new_residual). unit_offset: Gemma's
    (1 + weight) norm."""
    fn = "rms_norm"
    check_ndim(fn, "x", x, 2, "[T, H]")
    check_float_dtype(fn, "x", x)
    check_last_dim_contiguous(fn, "x", x)
    num_rows, hidden = x.shape
    _check_weight(fn, weight, hidden, x)
    weight = weight.contiguous()
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"{fn}: residual must match x ({tuple(x.shape)}, {x.dtype}), "
                f"got {tuple(residual.shape)}, {residual.dtype}"
            )
        check_last_dim_contiguous(fn, "residual", residual)
        check_same_device(fn, x=x, residual=residual)
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((num_rows, hidden), dtype=out_dtype, device=x.device)
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    if num_rows == 0:
        return out, new_residual
    _rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out, new_residual,
        x.stride(0), residual.stride(0) if residual is not None else 0, eps,
        HIDDEN=hidden, BLOCK_H=padded_pow2(hidden), HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
        num_warps=_row_num_warps(hidden),
    )  # fmt: skip
    return out, new_residual


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, Hh, D] with weight [D]; unit_offset: Gemma 3's (1 + weight) norm."""
    fn = "head_rms_norm"
    check_ndim(fn, "x", x, 3, "[T, Hh, D]")
    check_float_dtype(fn, "x", x)
    check_last_dim_contiguous(fn, "x", x)
    num_tokens, num_heads, head_dim = x.shape
    _check_weight(fn, weight, head_dim, x)
    weight = weight.contiguous()
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if num_tokens == 0 or num_heads == 0:
        return out
    heads_pad, head_dim_pad = padded_pow2(num_heads), padded_pow2(head_dim)
    _head_rms_norm_kernel[(num_tokens,)](
        x, weight, out, x.stride(0), x.stride(1), eps,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS_PAD=heads_pad, HEAD_DIM_PAD=head_dim_pad,
        UNIT_OFFSET=unit_offset, num_warps=_row_num_warps(heads_pad * head_dim_pad),
    )  # fmt: skip
    return out
