"""Paged attention for the CPU: decode and short prefill chunks by a native kernel that reads the blocks in place
(pagedq/kernels/cpu_native.c); else, and for longer chunks, gather the blocks with `index_select`, then torch's SDPA.

Same signatures and semantics as `kernels.reference.paged_decode_attention` / `paged_prefill_attention` (the
oracle these are tested against). Why this shape, measured on the 2-core CPU (docs/kernels.md has the figures):
  - decode, when `cpu_native.available()` (a C compiler, PAGEDQ_CPU_NATIVE not 0) and the tensors suit it (fp32
    or bf16, contiguous caches): one OpenMP task per (sequence, KV head) walks the sequence's blocks where they
    lie, with an online softmax, reading each K/V row once for all the head's query heads. The gather below
    copies K and V once more before SDPA reads them, which made that path ~2-3x SDPA over contiguous K/V of the
    same shape; the native kernel is within ~1x of it (and below it on spread contexts, having no padding).
    Prefill's short chunks (verify rows) go to the same kernel, each query with its causal limit;
  - otherwise `cache.index_select(0, blocks)` copies a sequence's blocks ~4x faster than `cache[tables]`
    (advanced indexing), at the speed of a plain copy of the same bytes;
  - the gathered [S, L, Hkv, D] buffer is handed to SDPA as a transposed view: SDPA's CPU flash kernel reads it
    strided as fast as contiguous, and a `.contiguous()` copy would cost more than it saves;
  - a boolean length mask (a float -inf mask made SDPA 4x slower), and for decode each KV head's query heads
    folded into query rows, so K/V are never repeated per query head nor read once per query head;
  - decode sorts the sequences by context length and gathers a few length groups, each up to its own longest
    context, never the step's widest table;
  - what every layer would recompute the same (the groups, the flat block list, the masks; prefill's chunks) is a
    plan built once a step (`plan_decode`, `plan_prefill`; pagedq/engine/layers/attention.py keeps it on the step's
    metadata), and each layer then gathers all its blocks with one index_select per cache. The native path's
    plan is only the tables and lengths as contiguous int32.
SDPA and the native kernel accumulate in fp32 for bf16 inputs, as the reference does; only the summation order
differs. torch.compile (inductor's C++) over a gather-reduce formulation was tried before the native kernel:
106 s to compile on 2 cores and no faster than the gather (docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from pagedq.kernels import cpu_native, reference


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences [start, end) of the plan's order, each gathered and padded to the same num_blocks blocks."""

    start: int
    end: int
    num_blocks: int
    mask: torch.Tensor | None  # [n, 1, 1, num_blocks * block_size] bool, True = attend; None: every slot is valid


@dataclass(frozen=True)
class DecodePlan:
    """What a decode step's attention needs beyond the layer's tensors, the same in every layer: built once a step.

    blocks: every group's table blocks, group after group (one index_select per cache and layer gathers them all);
    order: the sequences sorted by context length (None when one group covers them in the step's order), inverse
    its inverse permutation. A plan for the native kernel has no groups, only `tables` [S, M] and `lens` [S]
    (contiguous int32; None in an SDPA plan).
    """

    blocks: torch.Tensor
    groups: tuple[DecodeGroup, ...]
    order: torch.Tensor | None
    inverse: torch.Tensor | None
    tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None


def use_native(k_cache: torch.Tensor) -> bool:
    """Whether decode over this cache runs the native kernel: it is available (built, not PAGEDQ_CPU_NATIVE=0) and
    takes the cache (fp32 or bf16, contiguous, on the CPU). What plan_decode's `native` is told."""
    return k_cache.dtype in (torch.float32, torch.bfloat16) and k_cache.is_contiguous() and cpu_native.available()


def plan_decode(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    native: bool = False,
    *,
    window: int = 0,
) -> DecodePlan:
    """The step's plan for block_tables [S, M] int32 and context_lens [S] int32 (CPU tensors: no device sync to
    pay). native (callers pass use_native(k_cache)): a plan for the native kernel, just the tables and lengths as
    contiguous int32; else the length groups (length_groups), the blocks each gathers and its length mask (and
    window mask: the SDPA path gathers the blocks before a window too, and masks them)."""
    if native:
        int_tables, int_lens = block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
        return DecodePlan(torch.zeros(0, dtype=torch.long), (), None, None, int_tables, int_lens)
    lens = context_lens.numpy()
    groups = length_groups(lens, block_size) if len(lens) else []
    order = inverse = None
    tables, sorted_lens = block_tables, context_lens
    if len(groups) > 1:
        permutation = np.argsort(lens, kind="stable")
        order = torch.from_numpy(permutation)
        inverse = torch.from_numpy(np.argsort(permutation, kind="stable"))
        tables, sorted_lens = block_tables[order], context_lens[order]
    blocks, planned = [], []
    for start, end, longest in groups:
        num_blocks = -(-longest // block_size)
        blocks.append(tables[start:end, :num_blocks].reshape(-1))
        group_lens = sorted_lens[start:end]
        mask = None
        slides = window and int(group_lens.max()) > window
        if slides or int(group_lens.min()) < num_blocks * block_size:  # some row ends before its last slot
            positions = torch.arange(num_blocks * block_size)[None, :]
            lens_column = group_lens[:, None].long()
            visible = (positions < lens_column) & (positions >= reference.window_start(lens_column - 1, window))
            mask = visible[:, None, None, :]
        planned.append(DecodeGroup(start, end, num_blocks, mask))
    flat = torch.cat(blocks).long() if blocks else torch.zeros(0, dtype=torch.long)
    return DecodePlan(flat, tuple(planned), order, inverse)


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
    """One query per sequence at position context_len-1 over its context_len cached tokens.

    query [S, Hq, D]; block_tables [S, M] int32; context_lens [S] int32 -> [S, Hq, D].
    Plans the step (plan_decode) and runs it; the engine's layers plan once a step and call planned_decode.
    """
    plan = plan_decode(block_tables, context_lens, k_cache.shape[1], use_native(k_cache), window=window)
    return planned_decode(query, k_cache, v_cache, plan, scale, window=window, softcap=softcap, sinks=sinks)


def planned_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention as `plan` lays it out: one index_select per cache gathers every group's blocks, then one
    SDPA per group over its part of them.

    Each KV head's query heads go to SDPA as that many query rows of one head ([S, Hkv, group, D], no
    enable_gqa): SDPA then reads each head's K/V once for all its queries, not once per query head (faster:
    docs/benchmarks-log.md#figures-moved-from-code-comments). The length mask is the
    same for every row of a head, so folding the queries changes nothing else.
    A native plan runs the native kernel, or, for tensors it does not take (cpu_native.supports), is planned again
    for SDPA.
    """
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if plan.tables is not None and plan.lens is not None:
        if cpu_native.supports(query, k_cache, v_cache):
            return cpu_native.run_decode(
                query, k_cache, v_cache, plan.tables, plan.lens, scale, window=window, softcap=softcap, sinks=sinks
            )
        plan = plan_decode(plan.tables, plan.lens, block_size, native=False, window=window)
    if num_seqs == 0:
        return torch.empty_like(query)
    keys, values = k_cache.index_select(0, plan.blocks), v_cache.index_select(0, plan.blocks)
    if plan.order is not None:
        query = query.index_select(0, plan.order)
    query = query.reshape(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    row_sinks = None if sinks is None else sinks.view(1, num_kv_heads, num_q_heads // num_kv_heads, 1)
    outs, offset = [], 0
    for group in plan.groups:
        rows, width = group.end - group.start, group.num_blocks
        part = slice(offset, offset + rows * width)
        offset += rows * width
        k = keys[part].view(rows, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
        v = values[part].view(rows, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
        q = query[group.start : group.end]
        outs.append(attend(q, k, v, group.mask, scale, softcap=softcap, sinks=row_sinks))
    out = (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(num_seqs, num_q_heads, head_dim)
    return out if plan.inverse is None else out.index_select(0, plan.inverse)


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
    """Causal attention for a packed batch of query chunks whose K/V are already in the cache.

    query [T, Hq, D]; cu_seqlens_q [S+1] int32; context_lens [S] int32 (cached prefix + this chunk).
    Query i of sequence s sits at position context_len - q_len + i and sees positions <= its own.
    Plans the step (plan_prefill) and runs it; the engine's layers plan once a step and call planned_prefill.
    """
    _, block_size, num_kv_heads, _ = k_cache.shape
    heads = query.shape[1] // num_kv_heads
    plan = plan_prefill(block_tables, cu_seqlens_q, context_lens, block_size, heads, use_native(k_cache), window=window)
    return planned_prefill(query, k_cache, v_cache, plan, scale, window=window, softcap=softcap, sinks=sinks)


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


# The manual path (soft-cap or sinks, which SDPA cannot take) scores this many query rows x keys at once, at most.
MANUAL_SCORES_PER_SLICE = 1 << 22


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, R, D] over k, v [B, H, L, D] with a bool mask broadcastable to [B, H, R, L] (True =
    attend; None: all): by SDPA, or, with a soft-cap or sinks (broadcastable to [B, H, R, 1]), by scores and
    reference.attention_probs in fp32, R sliced so no slice's scores pass MANUAL_SCORES_PER_SLICE per head."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    keys, values = k.float(), v.float()
    visible = torch.ones(1, 1, 1, 1, dtype=torch.bool) if mask is None else mask
    rows = max(1, MANUAL_SCORES_PER_SLICE // max(1, k.shape[2] * q.shape[0]))
    for start in range(0, q.shape[2], rows):
        part = slice(start, start + rows)
        scores = torch.matmul(q[:, :, part].float(), keys.transpose(-1, -2)) * scale
        row_mask = visible[:, :, part] if visible.shape[2] > 1 else visible
        row_sinks = None if sinks is None else (sinks[:, :, part] if sinks.shape[2] > 1 else sinks)
        probs = reference.attention_probs(scores, row_mask, softcap, row_sinks)
        out[:, :, part] = torch.matmul(probs, values).to(q.dtype)
    return out
