"""Paged attention for the CPU: gather the blocks a step reads with `index_select`, then torch's fused SDPA.

Same signatures and semantics as `kernels.reference.paged_decode_attention` / `paged_prefill_attention` (the
oracle these are tested against). Why this shape, measured on the 2-core CPU (docs/kernels.md has the figures):
  - `cache.index_select(0, blocks)` copies a sequence's blocks ~4x faster than `cache[tables]` (advanced indexing),
    at the speed of a plain copy of the same bytes;
  - the gathered [S, L, Hkv, D] buffer is handed to SDPA as a transposed view: SDPA's CPU flash kernel reads it
    strided as fast as contiguous, and a `.contiguous()` copy would cost more than it saves;
  - a boolean length mask (a float -inf mask made SDPA 4x slower) and `enable_gqa`, so K/V are never repeated
    per query head;
  - decode sorts the sequences by context length and gathers a few length groups, each up to its own longest
    context, never the step's widest table.
SDPA accumulates in fp32 for bf16/fp16 inputs, as the reference does; only the summation order differs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[S, M] block ids -> the blocks' tokens as an [S, Hkv, M * block_size, D] view (one copy, by index_select)."""
    num_seqs, num_table_blocks = tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, tables.reshape(-1).long())
    return blocks.view(num_seqs, num_table_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence at position context_len-1 over its context_len cached tokens.

    query [S, Hq, D]; block_tables [S, M] int32; context_lens [S] int32 -> [S, Hq, D].
    Sequences are sorted by length and cut into a few groups, each gathered and padded to its own longest
    context (length_groups): a step's contexts spread widely, and one batch padded to the longest wasted up to
    half of the gather and of SDPA's work.
    """
    if query.shape[0] == 0:
        return torch.empty_like(query)
    lens = context_lens.numpy()  # a CPU tensor: no device sync to pay
    groups = length_groups(lens, k_cache.shape[1])
    if len(groups) == 1:
        return _decode_group(query, k_cache, v_cache, block_tables, context_lens, int(lens.max()), scale)
    order = torch.from_numpy(np.argsort(lens, kind="stable"))
    query, block_tables, context_lens = query[order], block_tables[order], context_lens[order]
    out = torch.empty_like(query)
    for start, end, longest in groups:
        part = slice(start, end)
        out[part] = _decode_group(query[part], k_cache, v_cache, block_tables[part], context_lens[part], longest, scale)
    return torch.empty_like(out).index_copy_(0, order, out)


def _decode_group(query, k_cache, v_cache, block_tables, context_lens, longest: int, scale: float) -> torch.Tensor:
    tables = block_tables[:, : -(-longest // k_cache.shape[1])]
    keys, values = _gather(k_cache, tables), _gather(v_cache, tables)
    positions = torch.arange(keys.shape[2], device=query.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]  # [S, 1, 1, L]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :], keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[:, :, 0]


# A group's fixed cost (an index_select pair and an SDPA call, ~40 us) in the units of its work, sequences x padded
# tokens (~0.2 us each at head dim 64 on the 2-core CPU): a split must save more padded work than this to pay.
GROUP_COST_TOKENS = 256
MAX_LENGTH_GROUPS = 4


def length_groups(context_lens: np.ndarray, block_size: int) -> list[tuple[int, int, int]]:
    """(start, end, longest context) of each group of the sequences sorted by context length: the cut that saves the
    most padded work, applied again to each side while it saves more than a group costs (at most 4 groups)."""
    padded = -(-np.sort(context_lens) // block_size) * block_size  # what a group gathers per sequence, at most
    groups = [(0, len(padded))]
    while len(groups) < MAX_LENGTH_GROUPS:
        best = max(((*_best_cut(padded, start, end), i) for i, (start, end) in enumerate(groups)), default=None)
        if best is None or best[0] <= GROUP_COST_TOKENS:
            break
        _, cut, i = best
        start, end = groups[i]
        groups[i : i + 1] = [(start, cut), (cut, end)]
    return [(start, end, int(padded[end - 1])) for start, end in groups]


def _best_cut(padded: np.ndarray, start: int, end: int) -> tuple[int, int]:
    """(padded work saved, cut) of the best split of sorted padded[start:end] into two groups; (0, start) if none."""
    if end - start < 2:
        return 0, start
    cuts = np.arange(start + 1, end)
    split_cost = (cuts - start) * padded[cuts - 1] + (end - cuts) * padded[end - 1]
    best = int(np.argmin(split_cost))
    return int((end - start) * padded[end - 1] - split_cost[best]), int(cuts[best])


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for a packed batch of query chunks whose K/V are already in the cache.

    query [T, Hq, D]; cu_seqlens_q [S+1] int32; context_lens [S] int32 (cached prefix + this chunk).
    Query i of sequence s sits at position context_len - q_len + i and sees positions <= its own.
    One SDPA call per chunk: a chunk's work (q_len x context_len) dwarfs the call, and padding the chunks of a
    step to one batch wasted more than the loop costs (prompt lengths vary a lot within a step).
    """
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        tables = block_tables[seq : seq + 1, : -(-context_len // block_size)]
        keys = _gather(k_cache, tables)[:, :, :context_len]
        values = _gather(v_cache, tables)[:, :, :context_len]
        q = query[q_start:q_end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        prefix = context_len - q_len
        if prefix == 0:  # SDPA's is_causal aligns query 0 with key 0: right only without a cached prefix
            attended = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(prefix, context_len, device=query.device)
            mask = torch.arange(context_len, device=query.device)[None, :] <= q_pos[:, None]
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[q_start:q_end] = attended[0].transpose(0, 1)
    return out
