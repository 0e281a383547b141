"""pagedq.kernels.cpu_attention's batched short prefill chunks (verify rows: the last token plus drafts over a paged
context) against kernels.reference, per dtype: mixed steps of decode rows, verify rows of varying q_len and
prefill chunks, with and without cached prefixes, through the engine's layer dispatch (one plan a step)."""

from __future__ import annotations

import pytest
import torch
from paged_cases import assert_close, make_paged_kv

from pagedq import kernels
from pagedq.engine.layers import AttentionMetadata, paged_attention
from pagedq.kernels import cpu_attention, reference

NUM_KV_HEADS = 3
DTYPES = [torch.float32, torch.bfloat16]


def _step(decode_lens, chunks, group, head_dim, block_size, dtype):
    """Caches and metadata of a step: decode rows of decode_lens, then prefill chunks (cached prefix, q_len)."""
    all_lens = decode_lens + [prefix + q_len for prefix, q_len in chunks]
    k_cache, v_cache, tables, lens = make_paged_kv(all_lens, NUM_KV_HEADS, head_dim, block_size, dtype, "cpu")
    num = len(decode_lens)
    q_lens = torch.tensor([q_len for _, q_len in chunks], dtype=torch.long)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32)
    meta = AttentionMetadata(torch.zeros(0), num, tables[:num], lens[:num], tables[num:], cu_seqlens, lens[num:])
    query = torch.randn(num + int(q_lens.sum()), NUM_KV_HEADS * group, head_dim).to(dtype)
    return query, k_cache, v_cache, meta


def _expected(query, k_cache, v_cache, meta, scale):
    num = meta.num_decode_tokens
    decode = reference.paged_decode_attention(
        query[:num], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
    )
    prefill = reference.paged_prefill_attention(
        query[num:],
        k_cache,
        v_cache,
        meta.prefill_block_tables,
        meta.prefill_cu_seqlens_q,
        meta.prefill_context_lens,
        scale,
    )
    return torch.cat([decode, prefill])


@pytest.mark.parametrize("native", [False, True], ids=["sdpa", "native"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,head_dim,block_size", [(3, 64, 16), (1, 32, 8), (4, 64, 32)])
def test_mixed_step_matches_reference(dtype, group, head_dim, block_size, native, monkeypatch):
    """Decode rows, verify rows of 2..6 queries over short and long contexts (several length groups, rows ending
    mid-block and on a block edge), a one-token chunk, a fresh prompt and a chunk after a cached prefix; by the
    short groups (PAGEDQ_CPU_NATIVE=0) and by the native kernel, which takes the short chunks instead."""
    monkeypatch.setenv("PAGEDQ_CPU_NATIVE", "1" if native else "0")
    torch.manual_seed(5)
    verify = [(block_size - 2, 2), (3, 5), (300, 5), (4 * block_size - 6, 6), (7, 3), (280, 4), (1, 1), (150, 2)]
    prefill = [(0, 40), (2 * block_size + 3, 25)]  # longer than the batched bound: one call each
    chunks = verify[:4] + prefill[:1] + verify[4:] + prefill[1:]
    query, k_cache, v_cache, meta = _step([5, 200, 17], chunks, group, head_dim, block_size, dtype)
    out = paged_attention(kernels.bind("cpu"), query, k_cache, v_cache, meta, head_dim**-0.5)
    assert_close(out, _expected(query, k_cache, v_cache, meta, head_dim**-0.5))
    plan = meta.derived["cpu_prefill_plan"]
    if native:
        assert len(plan.chunks) == 2 and len(plan.native_short.q_lens) == len(verify) and not plan.short_groups
        return
    assert len(plan.chunks) == 2 and sum(g.rows for g in plan.short_groups) == len(verify)
    assert len(plan.short_groups) > 1  # contexts 3..305 split into length groups


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_verify_only_step_matches_reference(dtype):
    """A speculative step at batch 16: every row a verify row (k = 4), contexts 300-1000, no decode part."""
    torch.manual_seed(6)
    chunks = [(int(n), 5) for n in torch.randint(295, 996, (16,))]
    query, k_cache, v_cache, meta = _step([], chunks, 3, 64, 16, dtype)
    out = paged_attention(kernels.bind("cpu"), query, k_cache, v_cache, meta, 0.125)
    assert_close(out, _expected(query, k_cache, v_cache, meta, 0.125))
    assert not meta.derived["cpu_prefill_plan"].chunks


def test_short_chunks_read_only_their_own_keys():
    """Keys past a verify row's context (in its last block, or in blocks gathered for a longer row of its group)
    and past each query's own position never reach the output."""
    torch.manual_seed(7)
    query, k_cache, v_cache, meta = _step([], [(5, 3), (60, 4)], 3, 64, 16, torch.float32)
    before = paged_attention(kernels.bind("cpu"), query, k_cache, v_cache, meta, 0.125)
    first = meta.prefill_block_tables[0, 0]
    k_cache[first, 8:], v_cache[first, 8:] = 1e3, 1e3  # past row 0's 8 tokens, inside its block
    meta.derived.clear()
    after = paged_attention(kernels.bind("cpu"), query, k_cache, v_cache, meta, 0.125)
    assert_close(after, before)
    k_cache[first, 7], v_cache[first, 7] = 1e3, 1e3  # row 0's last query's own key: its output moves, no other
    meta.derived.clear()
    moved = paged_attention(kernels.bind("cpu"), query, k_cache, v_cache, meta, 0.125)
    assert_close(moved[:2], before[:2])
    assert_close(moved[3:], before[3:])
    assert not torch.allclose(moved[2], before[2])


def test_a_plan_for_other_heads_is_refused():
    query, k_cache, v_cache, meta = _step([], [(9, 3)], 3, 64, 16, torch.float32)
    plan = cpu_attention.plan_prefill(
        meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, 16, heads_per_kv=2
    )
    with pytest.raises(ValueError, match="query heads per KV head"):
        cpu_attention.planned_prefill(query, k_cache, v_cache, plan, 0.125)
