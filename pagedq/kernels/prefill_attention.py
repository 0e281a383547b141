"""paged_prefill_attention: causal attention of packed variable-length query chunks over the paged K/V.

Shapes and strides
    query         [T, Hq, D]     tokens of all S chunks packed back to back; any token/head strides, dense rows
    k/v_cache     [num_blocks, block_size, Hkv, D] contiguous; already holds every chunk's own K/V
    block_tables  [S, M] int32
    cu_seqlens_q  [S+1] int32    chunk s is query[cu[s]:cu[s+1]], q_len = cu[s+1] - cu[s]
    context_lens  [S] int32      cached prefix + chunk; query i of chunk s is at pos = context_len - q_len + i
    out           [T, Hq, D]     query dtype

Math: out[t, h] = softmax(scale * q[t, h] . K^T + causal) @ V with K/V = positions [0, pos] of the sequence and
KV head h / GROUP; flash-attention online softmax over BLOCK_N-token tiles in base 2, fp32 accumulation.

Work split: a program owns BLOCK_Q consecutive query tokens of one chunk and one KV head. Its BLOCK_M rows are
(token, query head of the group) pairs, row r = token r // GROUP, head r % GROUP, so each K/V tile is loaded
once for the whole GQA group (BLOCK_Q = BLOCK_M // GROUP; rows past BLOCK_Q * GROUP are padding).
Chunk s owns query tiles [cu[s] // BLOCK_Q + s, cu[s+1] // BLOCK_Q + s + 1): a bound on ceil(q_len / BLOCK_Q)
that needs no host-side max over the chunk lengths, so the grid is T // BLOCK_Q + S and each program finds its
chunk by binary search over cu_seqlens_q; tiles past a chunk's end exit at once.

Variants (constexpr switches: without them the kernel compiles exactly as before). A sliding window: a query at
pos sees (pos - window, pos]; the K/V loop starts at the tile's first query's window, so tiles before it are
never read, and a row that sees none of a tile keeps its state (its max stays -inf, rescaled against 0, not
itself). A soft-cap bends the scores (triton_common.scaled_scores). Sinks: each row's running max and sum start
at (sink, 1), as if the sink were one more score with a zero value row.
"""

from __future__ import annotations

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

# (BLOCK_M rows, BLOCK_N kv tokens, num_warps, num_stages), sized by registers for sm_90 (kernels.compile_check
# reports them and the CTAs per SM they allow). 16-bit at D = 128: the fused-attention tutorial's 128 x 64 on 8
# warps took 173 registers, so one CTA per SM (11 warps' worth of the 64K register file); 64 x 32 on 4 warps
# takes ~151, 3 CTAs per SM (12 warps), and stays at >= 2 CTAs up to 255 registers. (Peeling the masked diagonal
# tile into its own loop was tried: it added registers, a second pipelined loop.) fp32 operands are twice as
# large and go through IEEE fp32 dots: a 64 x 32 tile spills on 4 or 8 warps, 64 x 16 on 8 warps does not.
TILE_CONFIGS = {
    torch.bfloat16: (64, 32, 4, 3),
    torch.float16: (64, 32, 4, 3),
    torch.float32: (64, 16, 8, 2),
}


@triton.jit
def _find_chunk(cu_seqlens_q_ptr, num_seqs, tile_id, BLOCK_Q: tl.constexpr):
    """The chunk s whose query tiles [cu[s] // BLOCK_Q + s, ...) contain tile_id (last s with start <= id)."""
    low = 0
    high = num_seqs
    while high - low > 1:  # invariant: the answer lies in [low, high)
        mid = (low + high) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        go_right = first_tile <= tile_id
        low = tl.where(go_right, mid, low)
        high = tl.where(go_right, high, mid)
    return low


@triton.jit
def _prefill_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, sinks_ptr,
    scale_log2, cap_inner, cap_outer, window, num_seqs,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table_seq,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_chunk(cu_seqlens_q_ptr, num_seqs, tile_id, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    chunk_index = q_tile * BLOCK_Q + rows // GROUP  # token index inside the chunk
    row_mask = (rows < BLOCK_Q * GROUP) & (chunk_index < q_len)
    q_pos = context_len - q_len + chunk_index
    q_heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q_rows = (q_start + chunk_index) * stride_q_token + q_heads * stride_q_head
    q = tl.load(query_ptr + q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + q_heads) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Causal bound: the last query of this tile sees positions < kv_end; later tiles are all masked.
    kv_end = context_len - q_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    kv_first = 0
    if HAS_WINDOW:  # the tile's first query sees nothing before its window, and the later ones less
        kv_first = tl.maximum(context_len - q_len + q_tile * BLOCK_Q - window + 1, 0)
    table_row = block_tables_ptr + seq * stride_table_seq
    for kv_start in range(kv_first, kv_end, BLOCK_N):
        k_pos = kv_start + tl.arange(0, BLOCK_N)
        k_mask = k_pos < kv_end
        kv_offsets = paged_kv_offsets(
            table_row,
            k_pos,
            k_mask,
            dims,
            kv_head,
            stride_cache_block,
            stride_cache_slot,
            stride_cache_head,
            BLOCK_SIZE,
        )
        kv_mask = k_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = dot_fp32_acc(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST_DOT)
        # Without a window every row sees position 0 in the first tile, so m_i is finite from then on and no row
        # turns NaN; with one, a row may see none of a tile (m_new -inf), and is rescaled against 0 instead.
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        scores = scaled_scores(scores, scale_log2, cap_inner, cap_outer, SOFTCAP)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_ref = m_new
        if HAS_WINDOW:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        acc = dot_fp32_acc(p.to(v.dtype), v, acc * alpha[:, None], UPCAST_DOT)
        m_i = m_new

    out = acc / l_i[:, None]
    out_rows = (q_start + chunk_index) * stride_out_token + q_heads * stride_out_head
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _check_prefill_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens) -> None:
    fn = "paged_prefill_attention"
    check_paged_attention_inputs(fn, query, k_cache, v_cache, block_tables, "[T, Hq, D]")
    check_ndim(fn, "context_lens", context_lens, 1, "[S]")
    check_ndim(fn, "cu_seqlens_q", cu_seqlens_q, 1, "[S + 1]")
    num_seqs = context_lens.shape[0]
    if block_tables.shape[0] != num_seqs or cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(
            f"{fn}: with context_lens [{num_seqs}], block_tables must be [{num_seqs}, M] and cu_seqlens_q "
            f"[{num_seqs + 1}], got {tuple(block_tables.shape)} and {tuple(cu_seqlens_q.shape)}"
        )
    for name, tensor in (("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens)):
        check_int_dtype(fn, name, tensor, (torch.int32,))
    check_same_device(fn, query=query, k_cache=k_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for packed query chunks [T, Hq, D] whose K/V are already cached -> [T, Hq, D].
    window, softcap and sinks as pagedq/kernels/reference.py defines them."""
    _check_prefill_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    variant = AttentionVariant.of("paged_prefill_attention", query, scale, window, softcap, sinks)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = TILE_CONFIGS[k_cache.dtype]
    block_m = max(block_m, padded_pow2(group))  # at least one token per tile
    block_q = block_m // group
    cu_seqlens_q = cu_seqlens_q.contiguous()
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        query, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, variant.sinks,
        variant.scale_log2, variant.cap_inner, variant.cap_outer, variant.window, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_pow2(head_dim, 16),
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        UPCAST_DOT=needs_dot_upcast(_prefill_kernel, k_cache.dtype),
        HAS_WINDOW=variant.has_window, SOFTCAP=variant.softcap, HAS_SINKS=variant.has_sinks,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
