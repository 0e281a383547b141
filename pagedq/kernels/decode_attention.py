"""paged_decode_attention: one new query per sequence against its paged K/V (flash-decoding).

Shapes and strides
    query        [S, Hq, D]        any seq/head strides, last dim contiguous
    k/v_cache    [num_blocks, block_size, Hkv, D] contiguous; GROUP = Hq / Hkv query heads share a KV head
    block_tables [S, M] int32      row s lists the physical blocks of sequence s (entries past the context unused)
    context_lens [S] int32         the query sits at position context_len - 1 and sees tokens [0, context_len)
    out          [S, Hq, D]        query dtype

Math: out[s, h] = softmax(scale * q[s, h] . K[s, h/GROUP]^T) @ V[s, h/GROUP], accumulated in fp32, computed as
an online softmax in base 2 (scores pre-multiplied by log2(e) so exp2 replaces exp).

Work split (flash-decoding): program (s, kv_head, p) handles the PARTITION_SIZE tokens of partition p for all
GROUP query heads of kv_head, so each K/V tile is loaded once per group and fed to a [GROUP_PAD, D] x [D, TILE_N]
tensor-core dot. With small batches and long contexts the partitions fill the GPU; each one writes its running
max m_p, sum l_p and unnormalised accumulator acc_p (fp32), and a reduction kernel combines them:
    g = max_p m_p,   out = sum_p acc_p * 2^(m_p - g) / sum_p l_p * 2^(m_p - g).
When every context fits in one partition the first kernel writes the normalised output directly.
The partition count comes from the block-table width M (a host-side shape), not from context_lens, so the
launch never synchronises with the GPU and stays CUDA-graph friendly; partitions past a sequence's end exit.

Variants (constexpr switches: without them the kernels compile exactly as before). A sliding window: the query
sees [context_len - window, context_len); partitions wholly before it exit at once (their blocks are never
read), the one holding its start begins there, and the reduction combines only the partitions from that one on.
A soft-cap bends the scores before the online softmax (triton_common.scaled_scores). Sinks join the denominator
once: the single-partition kernel starts its running max and sum at (sink, 1), the reduction adds 2^(sink - g)
to the total (g then also covers the sink).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedq.kernels.triton_common import (
    AttentionVariant,
    check_int_dtype,
    check_ndim,
    check_paged_attention_inputs,
    check_same_device,
    dot_fp32_acc,
    needs_dot_upcast,
    padded_pow2,
    paged_kv_offsets,
    scaled_scores,
)

# vLLM's paged-attention v2 partition size: long enough to amortise the reduction, short enough that a batch of
# a few sequences with 4k+ tokens still launches hundreds of programs.
DEFAULT_PARTITION_SIZE = 512
# Tokens per inner-loop tile (several pages of 16 gathered through the block table): a [64, 128] bf16 K tile
# is 16 KiB, double-buffered by 2 pipeline stages; on sm_90 that is ~80 registers on 4 warps, no spills
# (kernels.compile_check). fp32 caches halve the tile to keep the same footprint.
TILE_TOKENS = {torch.float32: 32, torch.float16: 64, torch.bfloat16: 64}
# tl.dot needs M >= 16, so the GROUP query heads are padded to at least 16 rows (zeros; never stored).
MIN_DOT_ROWS = 16


@triton.jit
def _decode_partition_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, sinks_ptr,
    scale_log2, cap_inner, cap_outer, window,
    stride_q_seq, stride_q_head, stride_out_seq, stride_out_head,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table_seq,
    num_q_heads, max_partitions,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr, PARTITION_SIZE: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    part_start = partition * PARTITION_SIZE
    if part_start >= context_len:
        return  # the reduction only reads partitions that hold tokens
    part_end = tl.minimum(part_start + PARTITION_SIZE, context_len)
    if HAS_WINDOW:
        window_start = tl.maximum(context_len - window, 0)
        if part_end <= window_start:
            return  # wholly before the window: the reduction starts after it
        part_start = tl.maximum(part_start, window_start)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    q_heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q_offsets = seq * stride_q_seq + q_heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    if HAS_SINKS and not SPLIT:  # the sink as one more score whose value row is zero
        m_i = tl.load(sinks_ptr + q_heads, mask=row_mask, other=0.0) * 1.4426950408889634
        l_i = tl.full([GROUP_PAD], 1.0, tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq * stride_table_seq
    for tile_start in range(part_start, part_end, TILE_N):
        tokens = tile_start + tl.arange(0, TILE_N)
        token_mask = tokens < part_end
        # Per-token gather through the block table: a tile spans TILE_N / BLOCK_SIZE pages anywhere in the pool.
        kv_offsets = paged_kv_offsets(
            table_row,
            tokens,
            token_mask,
            dims,
            kv_head,
            stride_cache_block,
            stride_cache_slot,
            stride_cache_head,
            BLOCK_SIZE,
        )
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = dot_fp32_acc(q, tl.trans(k), tl.zeros([GROUP_PAD, TILE_N], tl.float32), UPCAST_DOT)
        scores = scaled_scores(scores, scale_log2, cap_inner, cap_outer, SOFTCAP)
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        # Online softmax; the first tile always holds part_start < context_len, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        acc = dot_fp32_acc(p.to(v.dtype), v, acc * alpha[:, None], UPCAST_DOT)
        m_i = m_new

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        stat_offsets = (seq * num_q_heads + q_heads) * max_partitions + partition
        tl.store(part_max_ptr + stat_offsets, m_i, mask=row_mask)
        tl.store(part_sum_ptr + stat_offsets, l_i, mask=row_mask)
        tl.store(part_acc_ptr + stat_offsets[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
    else:
        out = acc / l_i[:, None]
        out_offsets = seq * stride_out_seq + q_heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, context_lens_ptr, sinks_ptr, window,
    stride_out_seq, stride_out_head, num_q_heads, max_partitions,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, PARTITIONS_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    q_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_partitions = tl.cdiv(context_len, PARTITION_SIZE)
    first_partition = 0
    if HAS_WINDOW:  # the partitions before the one holding the window's start wrote nothing
        first_partition = tl.maximum(context_len - window, 0) // PARTITION_SIZE
    stat_base = (seq * num_q_heads + q_head) * max_partitions

    parts = tl.arange(0, PARTITIONS_PAD)
    part_mask = (parts >= first_partition) & (parts < num_partitions)
    part_max = tl.load(part_max_ptr + stat_base + parts, mask=part_mask, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + stat_base + parts, mask=part_mask, other=0.0)
    global_max = tl.max(part_max, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + q_head) * 1.4426950408889634
        global_max = tl.maximum(global_max, sink)
    total = tl.sum(part_sum * tl.exp2(part_max - global_max), axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - global_max)

    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for part in range(first_partition, num_partitions):
        weight = tl.exp2(tl.load(part_max_ptr + stat_base + part) - global_max)
        part_acc = tl.load(part_acc_ptr + (stat_base + part) * HEAD_DIM + dims, mask=dim_mask, other=0.0)
        acc += weight * part_acc
    out = acc / total
    out_offsets = seq * stride_out_seq + q_head * stride_out_head + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def _check_decode_args(query, k_cache, v_cache, block_tables, context_lens) -> None:
    fn = "paged_decode_attention"
    check_paged_attention_inputs(fn, query, k_cache, v_cache, block_tables, "[S, Hq, D]")
    check_ndim(fn, "context_lens", context_lens, 1, "[S]")
    num_seqs = query.shape[0]
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"{fn}: block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
            f"must have one row per query sequence ({num_seqs})"
        )
    check_int_dtype(fn, "context_lens", context_lens, (torch.int32,))
    check_same_device(fn, query=query, k_cache=k_cache, block_tables=block_tables, context_lens=context_lens)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence at position context_len-1 over its paged K/V. query [S, Hq, D] -> [S, Hq, D].
    window, softcap and sinks as pagedq/kernels/reference.py defines them."""
    return paged_decode_attention_with_partition(
        query, k_cache, v_cache, block_tables, context_lens, scale, DEFAULT_PARTITION_SIZE,
        window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip


def paged_decode_attention_with_partition(
    query,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale: float,
    partition_size: int,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_decode_attention with an explicit partition size (tests use small ones to exercise the split)."""
    _check_decode_args(query, k_cache, v_cache, block_tables, context_lens)
    variant = AttentionVariant.of("paged_decode_attention", query, scale, window, softcap, sinks)
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"paged_decode_attention: partition_size must be a power of two >= 16, got {partition_size}")
    tile_tokens = min(TILE_TOKENS[k_cache.dtype], partition_size)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0 or block_tables.shape[1] == 0:
        return out.zero_()
    max_context = block_tables.shape[1] * block_size  # upper bound known on the host: no GPU sync
    max_partitions = math.ceil(max_context / partition_size)
    split = max_partitions > 1
    if split:
        stats_shape = (num_seqs, num_q_heads, max_partitions)
        part_max = torch.empty(stats_shape, dtype=torch.float32, device=query.device)
        part_sum = torch.empty(stats_shape, dtype=torch.float32, device=query.device)
        part_acc = torch.empty((*stats_shape, head_dim), dtype=torch.float32, device=query.device)
    else:
        part_max = part_sum = part_acc = out  # never touched when SPLIT is False
    group = num_q_heads // num_kv_heads
    head_dim_pad = padded_pow2(head_dim, 16)
    _decode_partition_kernel[(num_seqs, num_kv_heads, max_partitions)](
        query, k_cache, v_cache, block_tables, context_lens,
        out, part_max, part_sum, part_acc, variant.sinks,
        variant.scale_log2, variant.cap_inner, variant.cap_outer, variant.window,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_q_heads, max_partitions,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=padded_pow2(group, MIN_DOT_ROWS),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        TILE_N=tile_tokens, PARTITION_SIZE=partition_size, SPLIT=split,
        UPCAST_DOT=needs_dot_upcast(_decode_partition_kernel, k_cache.dtype),
        HAS_WINDOW=variant.has_window, SOFTCAP=variant.softcap, HAS_SINKS=variant.has_sinks,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if split:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            out, part_max, part_sum, part_acc, context_lens, variant.sinks, variant.window,
            out.stride(0), out.stride(1), num_q_heads, max_partitions,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            PARTITION_SIZE=partition_size, PARTITIONS_PAD=padded_pow2(max_partitions),
            HAS_WINDOW=variant.has_window, HAS_SINKS=variant.has_sinks,
            num_warps=4,
        )  # fmt: skip
    return out
