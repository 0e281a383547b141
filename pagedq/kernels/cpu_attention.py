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
Prefill's plan lives in pagedq/kernels/cpu_prefill.py, the length groups and the call over gathered K/V (SDPA, or a
manual softmax for soft-cap and sinks) in pagedq/kernels/cpu_gathered.py; this module re-exports their names.
SDPA and the native kernel accumulate in fp32 for bf16 inputs, as the reference does; only the summation order
differs. torch.compile (inductor's C++) over a gather-reduce formulation was tried before the native kernel:
106 s to compile on 2 cores and no faster than the gather (docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedq.kernels import cpu_native, reference
from pagedq.kernels.cpu_gathered import (
    GROUP_COST_TOKENS,
    MANUAL_SCORES_PER_SLICE,
    MAX_LENGTH_GROUPS,
    attend,
    length_groups,
)
from pagedq.kernels.cpu_prefill import (
    MAX_BATCHED_QUERY_TOKENS,
    PrefillChunk,
    PrefillPlan,
    ShortChunkGroup,
    plan_prefill,
    planned_prefill,
)


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


__all__ = [
    "GROUP_COST_TOKENS",
    "MANUAL_SCORES_PER_SLICE",
    "MAX_BATCHED_QUERY_TOKENS",
    "MAX_LENGTH_GROUPS",
    "DecodeGroup",
    "DecodePlan",
    "PrefillChunk",
    "PrefillPlan",
    "ShortChunkGroup",
    "attend",
    "length_groups",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_decode",
    "plan_prefill",
    "planned_decode",
    "planned_prefill",
    "use_native",
]
