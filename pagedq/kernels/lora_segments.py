"""Triton lora_shrink / lora_expand: one segment-gather matmul per kernel, for decode and prefill alike.

The contract (shapes, math, the index) is `kernels.lora`'s. Punica splits each op into BGMV (one token per row,
for decode) and SGMV (contiguous segments, for prefill); here `LoRAIndex` sorts every step's tokens by slot, so
decode tokens of one adapter also form a segment, and one kernel gathers each segment's rows through
`token_order` and runs a tiled tl.dot against that slot's weights. A decode step of 32 tokens over 8 adapters
then reads each adapter's A and B once per tile of rows instead of once per token, which is the cost BGMV pays.

Grid (S, cdiv(max_segment_length, BLOCK_M), slices x column tiles): axis 0 is the slot, so programs of slots
absent from the step (length 0) and tiles past a segment's end return at once, and for a fixed (T, S) the
grid of a static index (rows = T) is fixed, which is what a CUDA graph needs.

shrink: [BLOCK_M rows of x] @ [BLOCK_K x BLOCK_R of A^T], looping over `in`, fp32 accumulation, fp32 out.
expand: [BLOCK_M rows of buf] @ [BLOCK_R x BLOCK_N of B^T], looping over R; buf is rounded to the weights' dtype
for the tensor-core dot when they are fp16/bf16 (IEEE fp32 dot for fp32), and the sum with y is taken in fp32
and rounded once. Every (token, column) of y belongs to exactly one program, so the in-place add needs no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels.lora import MAX_SLICES, LoRAIndex, check_lora_expand_shapes, check_lora_shapes
from pagedq.kernels.triton_common import (
    check_float_dtype,
    check_last_dim_contiguous,
    check_same_device,
    dot_fp32_acc,
    needs_dot_upcast,
    padded_pow2,
)


def _rows_per_tile(max_segment_length: int) -> int:
    """16 rows (tl.dot's minimum) for decode-sized segments, up to 64 for prefill."""
    return min(64, padded_pow2(max_segment_length, 16))


@triton.jit
def _segment_tokens(order_ptr, starts_ptr, lengths_ptr, slot, m_tile, BLOCK_M: tl.constexpr):
    """The token rows [BLOCK_M] of tile m_tile of `slot`'s segment and their mask."""
    length = tl.load(lengths_ptr + slot)
    start = tl.load(starts_ptr + slot)
    in_segment = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = in_segment < length
    tokens = tl.load(order_ptr + start + in_segment, mask=mask, other=0).to(tl.int64)
    return tokens, mask


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, buf_ptr, order_ptr, starts_ptr, lengths_ptr,
    num_tokens, in_dim, stride_x_row, stride_a_slot, stride_a_slice, stride_a_rank,
    RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    RANK_TILES: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0)
    m_tile = tl.program_id(1)
    if m_tile * BLOCK_M >= tl.load(lengths_ptr + slot):
        return
    n = tl.program_id(2) // RANK_TILES
    ranks = (tl.program_id(2) % RANK_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_mask = ranks < RANK
    tokens, row_mask = _segment_tokens(order_ptr, starts_ptr, lengths_ptr, slot, m_tile, BLOCK_M)
    a_base = a_ptr + slot.to(tl.int64) * stride_a_slot + n * stride_a_slice + ranks[None, :] * stride_a_rank
    x_base = x_ptr + tokens[:, None] * stride_x_row
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k_start in range(0, in_dim, BLOCK_K):
        cols = k_start + tl.arange(0, BLOCK_K)
        col_mask = cols < in_dim
        x = tl.load(x_base + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        a = tl.load(a_base + cols[:, None], mask=col_mask[:, None] & rank_mask[None, :], other=0.0)  # A^T tile
        acc = dot_fp32_acc(x, a, acc, UPCAST_DOT)
    out = buf_ptr + n * num_tokens * RANK + tokens[:, None] * RANK + ranks[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr, buf_ptr, b_ptr, order_ptr, starts_ptr, lengths_ptr,
    num_tokens, stride_y_row, stride_b_slot, stride_b_slice, stride_b_out,
    out_size_0, out_size_1, out_size_2,
    RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    COL_TILES: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0)
    m_tile = tl.program_id(1)
    n = tl.program_id(2) // COL_TILES
    out_size = tl.where(n == 0, out_size_0, tl.where(n == 1, out_size_1, out_size_2))
    offset = tl.where(n == 0, 0, tl.where(n == 1, out_size_0, out_size_0 + out_size_1))
    cols = (tl.program_id(2) % COL_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    if (m_tile * BLOCK_M >= tl.load(lengths_ptr + slot)) | ((tl.program_id(2) % COL_TILES) * BLOCK_N >= out_size):
        return
    col_mask = cols < out_size
    tokens, row_mask = _segment_tokens(order_ptr, starts_ptr, lengths_ptr, slot, m_tile, BLOCK_M)
    b_base = b_ptr + slot.to(tl.int64) * stride_b_slot + n * stride_b_slice + cols[None, :] * stride_b_out
    buf_base = buf_ptr + n * num_tokens * RANK + tokens[:, None] * RANK
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r_start in range(0, RANK, BLOCK_R):
        ranks = r_start + tl.arange(0, BLOCK_R)
        rank_mask = ranks < RANK
        b = tl.load(b_base + ranks[:, None], mask=rank_mask[:, None] & col_mask[None, :], other=0.0)  # B^T tile
        shrunk = tl.load(buf_base + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :], other=0.0)
        acc = dot_fp32_acc(shrunk.to(b.dtype), b, acc, UPCAST_DOT)
    y_tile = y_ptr + tokens[:, None] * stride_y_row + offset + cols[None, :]
    io_mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(y_tile, mask=io_mask, other=0.0).to(tl.float32)
    tl.store(y_tile, (y + acc).to(y_ptr.dtype.element_ty), mask=io_mask)


def _check_index(fn: str, index: LoRAIndex, device: torch.device) -> None:
    for name in ("token_order", "slot_starts", "slot_lengths"):
        tensor = getattr(index, name)
        if tensor.dtype != torch.int32 or tensor.device != device:
            raise ValueError(f"{fn}: index.{name} must be int32 on {device}, got {tensor.dtype} on {tensor.device}")


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, index: LoRAIndex) -> torch.Tensor:
    """x [T, in], lora_a [S, N, R, in] -> buf [N, T, R] fp32 (rows of base-model tokens: 0)."""
    fn = "lora_shrink"
    check_lora_shapes(fn, x, lora_a, index, x.shape[-1], "[S, N, R, in]")
    check_float_dtype(fn, "x", x)
    if lora_a.dtype != x.dtype:
        raise ValueError(f"{fn}: lora_a dtype {lora_a.dtype} must match x dtype {x.dtype}")
    check_last_dim_contiguous(fn, "x", x)
    check_same_device(fn, x=x, lora_a=lora_a, token_order=index.token_order)
    if lora_a.stride(-1) != 1:
        raise ValueError(f"{fn}: lora_a must have a contiguous last dimension, got strides {lora_a.stride()}")
    _check_index(fn, index, x.device)
    _, num_slices, rank, in_dim = lora_a.shape
    num_tokens = x.shape[0]
    buf = torch.zeros((num_slices, num_tokens, rank), dtype=torch.float32, device=x.device)
    if not index.has_adapter or num_tokens == 0 or rank == 0:
        return buf
    block_m = _rows_per_tile(index.max_segment_length)
    block_r = min(64, padded_pow2(rank, 16))
    rank_tiles = triton.cdiv(rank, block_r)
    grid = (index.num_slots, triton.cdiv(index.max_segment_length, block_m), num_slices * rank_tiles)
    _lora_shrink_kernel[grid](
        x, lora_a, buf, index.token_order, index.slot_starts, index.slot_lengths,
        num_tokens, in_dim, x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        RANK=rank, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64 if block_m == 64 else 128,
        RANK_TILES=rank_tiles, UPCAST_DOT=needs_dot_upcast(_lora_shrink_kernel, x.dtype), num_warps=4,
    )  # fmt: skip
    return buf


def lora_expand(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, index: LoRAIndex, out_sizes: tuple[int, ...]
) -> None:
    """In place: y[t, off_n : off_n + out_n] += buf[n, t] @ lora_b[slot_t, n, :out_n].T for every adapter token."""
    fn = "lora_expand"
    check_lora_expand_shapes(fn, y, buf, lora_b, index, out_sizes)
    check_float_dtype(fn, "y", y)
    check_float_dtype(fn, "lora_b", lora_b)
    if buf.dtype != torch.float32 or not buf.is_contiguous():
        raise ValueError(
            f"{fn}: buf must be contiguous float32 (lora_shrink's output), got {buf.dtype} with strides {buf.stride()}"
        )
    check_last_dim_contiguous(fn, "y", y)
    check_same_device(fn, y=y, buf=buf, lora_b=lora_b, token_order=index.token_order)
    if lora_b.stride(-1) != 1:
        raise ValueError(f"{fn}: lora_b must have a contiguous last dimension, got strides {lora_b.stride()}")
    _check_index(fn, index, y.device)
    num_tokens, rank, max_out = y.shape[0], buf.shape[2], max(out_sizes, default=0)
    if not index.has_adapter or num_tokens == 0 or rank == 0 or max_out == 0:
        return
    block_m = _rows_per_tile(index.max_segment_length)
    block_n = min(128 if block_m <= 16 else 64, padded_pow2(max_out, 16))
    col_tiles = triton.cdiv(max_out, block_n)
    # IEEE fp32 dots hold far more registers than tensor-core ones: narrower rank tiles keep them from spilling.
    block_r = min(16 if lora_b.dtype == torch.float32 else 64, padded_pow2(rank, 16))
    sizes = (*out_sizes, *(0,) * (MAX_SLICES - len(out_sizes)))
    grid = (index.num_slots, triton.cdiv(index.max_segment_length, block_m), len(out_sizes) * col_tiles)
    _lora_expand_kernel[grid](
        y, buf, lora_b, index.token_order, index.slot_starts, index.slot_lengths,
        num_tokens, y.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), *sizes,
        RANK=rank, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        COL_TILES=col_tiles, UPCAST_DOT=needs_dot_upcast(_lora_expand_kernel, lora_b.dtype), num_warps=4,
    )  # fmt: skip


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    index: LoRAIndex,
    out_sizes: tuple[int, ...],
) -> None:
    """y += each adapter token's LoRA product: the shrink kernel, then the expand kernel on its fp32 buffer."""
    lora_expand(y, lora_shrink(x, lora_a, index), lora_b, index, out_sizes)
