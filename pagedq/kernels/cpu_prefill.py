"""Prefill chunks on the CPU path (pagedq/kernels/cpu_attention.py, which re-exports these names): the step's plan
(plan_prefill, once a step: the chunks, their blocks and causal/window masks; the short chunks batched in length
groups or handed to the native kernel) and its run (planned_prefill)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from pagedq.kernels import cpu_native, reference
from pagedq.kernels.cpu_gathered import attend, length_groups

# Chunks of at most this many query tokens (a verify row: its last token and up to 16 drafts,
# the speculative config's bound; a one-token chunk) are attended in batches, like decode rows: such a chunk's
# work (q_len x context_len) is too small to pay its own gather slice, mask and SDPA call in every layer. Longer chunks
# keep one call each.
MAX_BATCHED_QUERY_TOKENS = 17


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's query chunk: rows [q_start, q_end) of the step's prefill queries, attending to its cached
    tokens [key_start, context_len), held by the plan's blocks [block_start, block_start + num_blocks). key_start
    is 0 but with a sliding window, where it is the first block of the chunk's first query's window: blocks
    before it are not gathered."""

    q_start: int
    q_end: int
    context_len: int
    block_start: int
    # [q_len, context_len - key_start] bool after a cached prefix or with a window; None: is_causal from token 0
    mask: torch.Tensor | None
    key_start: int = 0

    @property
    def num_keys(self) -> int:
        return self.context_len - self.key_start


@dataclass(frozen=True)
class ShortChunkGroup:
    """Short chunks attended by one SDPA call, each padded to `width` queries and num_blocks gathered blocks (the
    plan's blocks [block_start, block_start + rows * num_blocks), row after row).

    queries [rows * width]: the prefill rows gathered (a padding query repeats its chunk's last one); kept
    [n]: which of them are real, scattered back to their prefill rows `targets` [n]. mask [rows, 1, width *
    heads_per_kv, num_blocks * block_size] bool: query i of a chunk (each KV head's query heads folded in as
    heads_per_kv rows per query, as decode folds them) sees the keys up to its position context_len - q_len + i.
    """

    rows: int
    width: int
    num_blocks: int
    block_start: int
    queries: torch.Tensor
    kept: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class PrefillPlan:
    blocks: torch.Tensor  # every chunk's and group's blocks: one index_select per cache and layer
    chunks: tuple[PrefillChunk, ...]
    short_groups: tuple[ShortChunkGroup, ...] = ()
    heads_per_kv: int = 1  # query heads per KV head, which the short groups' masks are laid out for
    # A native plan's short chunks, for the native kernel instead of short groups (none are built), and the
    # plan's inputs (block_tables, cu_seqlens_q, context_lens, block_size), to plan again for SDPA should the
    # query not suit the kernel (as a native decode plan keeps its tables and lengths).
    native_short: cpu_native.Chunks | None = None
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None


def plan_prefill(
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    heads_per_kv: int = 1,
    native: bool = False,
    *,
    window: int = 0,
) -> PrefillPlan:
    """The chunks of a prefill step (empty ones left out), their blocks and causal masks: once a step. Chunks of
    up to MAX_BATCHED_QUERY_TOKENS queries go to the native kernel's Chunks if `native` (use_native), else to
    length groups (length_groups); the others one call each, over the blocks from their first query's window on
    (window > 0: the blocks wholly before it are not gathered)."""
    starts, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    blocks, chunks, short, block_start = [], [], [], 0
    for seq, context_len in enumerate(lens):
        q_start, q_end = starts[seq], starts[seq + 1]
        if q_end == q_start:
            continue
        if q_end - q_start <= MAX_BATCHED_QUERY_TOKENS:
            short.append(seq)
            continue
        prefix = context_len - (q_end - q_start)
        q_pos = torch.arange(prefix, context_len)[:, None]
        first_block = int(reference.window_start(torch.tensor(prefix), window)) // block_size
        num_blocks = -(-context_len // block_size) - first_block
        blocks.append(block_tables[seq, first_block : first_block + num_blocks])
        key_start = first_block * block_size
        mask = None
        if prefix or (window and context_len > window):  # SDPA's is_causal: query 0 sees key 0, and no window
            k_pos = torch.arange(key_start, context_len)[None, :]
            mask = (k_pos <= q_pos) & (k_pos >= reference.window_start(q_pos, window))
        chunks.append(PrefillChunk(q_start, q_end, context_len, block_start, mask, key_start))
        block_start += num_blocks
    flat = torch.cat(blocks).long() if blocks else torch.zeros(0, dtype=torch.long)
    if short and native:
        inputs = (block_tables, cu_seqlens_q, context_lens, block_size)
        native_short = cpu_native.short_chunks(block_tables, starts, lens, short)
        return PrefillPlan(flat, tuple(chunks), (), heads_per_kv, native_short, inputs)
    groups = []
    if short:
        seqs = np.array(short)[np.argsort(np.array(lens)[short], kind="stable")]
        for start, end, longest in length_groups(np.array(lens)[seqs], block_size):
            group = _short_group(seqs[start:end], starts, lens, longest, block_size, heads_per_kv, block_start, window)
            blocks.append(block_tables[torch.from_numpy(seqs[start:end]), : group.num_blocks].reshape(-1))
            block_start += group.rows * group.num_blocks
            groups.append(group)
    flat = torch.cat(blocks).long() if blocks else torch.zeros(0, dtype=torch.long)
    return PrefillPlan(flat, tuple(chunks), tuple(groups), heads_per_kv)


def _short_group(
    seqs: np.ndarray,
    starts: list[int],
    lens: list[int],
    longest: int,
    block_size: int,
    heads: int,
    block_start: int,
    window: int,
) -> ShortChunkGroup:
    """The gather and scatter indices and the causal mask of short chunks `seqs` (sorted by context length)."""
    q_starts = torch.tensor([starts[s] for s in seqs])
    q_lens = torch.tensor([starts[s + 1] - starts[s] for s in seqs])
    context = torch.tensor([lens[s] for s in seqs])
    width, num_blocks = int(q_lens.max()), -(-longest // block_size)
    step = torch.arange(width)
    real = step[None, :] < q_lens[:, None]  # [rows, width]
    queries = q_starts[:, None] + torch.minimum(step[None, :], q_lens[:, None] - 1)
    # a padding query sits where its chunk's last one does: its row is a copy, never all masked (no NaN)
    positions = context[:, None] - q_lens[:, None] + torch.minimum(step[None, :], q_lens[:, None] - 1)
    keys, positions = torch.arange(num_blocks * block_size)[None, None, :], positions[:, :, None]
    mask = (keys <= positions) & (keys >= reference.window_start(positions, window))  # [rows, width, keys]
    mask = mask.repeat_interleave(heads, dim=1)[:, None]  # query i's heads_per_kv folded rows share its mask
    flat_real = real.reshape(-1)
    return ShortChunkGroup(
        len(seqs),
        width,
        num_blocks,
        block_start,
        queries.reshape(-1),
        flat_real.nonzero().reshape(-1),
        queries.reshape(-1)[flat_real],
        mask,
    )


def planned_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One SDPA call per long chunk over its part of one gather: a chunk's work (q_len x context_len) dwarfs the
    call, and padding the chunks of a step to one batch wasted more than the loop costs (prompt lengths vary a
    lot). Then the short chunks (verify rows): by the native kernel, or one call per group, as decode does."""
    out = torch.empty_like(query)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if plan.native_short is not None and plan.inputs is not None and not cpu_native.supports(query, k_cache, v_cache):
        plan = plan_prefill(*plan.inputs, query.shape[1] // num_kv_heads, native=False, window=window)
    if plan.short_groups and query.shape[1] != plan.heads_per_kv * num_kv_heads:
        raise ValueError(f"the plan folds {plan.heads_per_kv} query heads per KV head, the query has {query.shape[1]}")
    keys, values = k_cache.index_select(0, plan.blocks), v_cache.index_select(0, plan.blocks)
    heads = query.shape[1] // num_kv_heads
    for chunk in plan.chunks:
        width, num_keys = -(-chunk.num_keys // block_size), chunk.num_keys
        part = slice(chunk.block_start, chunk.block_start + width)
        k = keys[part].view(1, width * block_size, num_kv_heads, head_dim)[:, :num_keys].transpose(1, 2)
        v = values[part].view(1, width * block_size, num_kv_heads, head_dim)[:, :num_keys].transpose(1, 2)
        q = query[chunk.q_start : chunk.q_end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        if softcap or sinks is not None:  # the manual path: K/V repeated per query head, an explicit causal mask
            k, v = k.repeat_interleave(heads, dim=1), v.repeat_interleave(heads, dim=1)
            mask = chunk.mask if chunk.mask is not None else torch.ones(q.shape[2], num_keys, dtype=torch.bool).tril()
            row_sinks = None if sinks is None else sinks.view(1, -1, 1, 1)
            attended = attend(q, k, v, mask[None, None], scale, softcap=softcap, sinks=row_sinks)
        else:
            attended = F.scaled_dot_product_attention(
                q, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=True
            )
        out[chunk.q_start : chunk.q_end] = attended[0].transpose(0, 1)
    if plan.native_short is not None:
        chunks = plan.native_short
        cpu_native.run_chunks(query, k_cache, v_cache, chunks, scale, out, window=window, softcap=softcap, sinks=sinks)
    for group in plan.short_groups:
        attended = _attend_short_group(query, keys, values, group, block_size, scale, softcap, sinks)
        out.index_copy_(0, group.targets, attended)
    return out


def _attend_short_group(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: ShortChunkGroup,
    block_size: int,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The group's real queries' outputs [n, Hq, D], in the order of group.targets."""
    rows, width, num_blocks = group.rows, group.width, group.num_blocks
    _, num_q_heads, head_dim = query.shape
    num_kv_heads = keys.shape[2]
    heads = num_q_heads // num_kv_heads
    part = slice(group.block_start, group.block_start + rows * num_blocks)
    k = keys[part].view(rows, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    v = values[part].view(rows, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    q = query.index_select(0, group.queries).view(rows, width, num_kv_heads, heads, head_dim)
    q = q.transpose(1, 2).reshape(rows, num_kv_heads, width * heads, head_dim)  # row j = query j // heads
    row_sinks = None  # row j of a KV head is query j // heads, query head j % heads
    if sinks is not None:
        per_row = sinks.view(num_kv_heads, 1, heads).expand(num_kv_heads, width, heads)
        row_sinks = per_row.reshape(1, num_kv_heads, width * heads, 1)
    attended = attend(q, k, v, group.mask, scale, softcap=softcap, sinks=row_sinks)
    attended = attended.view(rows, num_kv_heads, width, heads, head_dim).transpose(1, 2)
    return attended.reshape(rows * width, num_q_heads, head_dim).index_select(0, group.kept)
