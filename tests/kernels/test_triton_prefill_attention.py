"""paged_prefill_attention (packed varlen chunks over a cached prefix) against the reference."""

from __future__ import annotations

import pytest
import torch
from paged_cases import assert_close, make_paged_kv

from pagedq.kernels import reference

NUM_KV_HEADS = 2

CASES = [
    (1, 64, 16, torch.float32),
    (4, 128, 16, torch.float32),
    (8, 64, 32, torch.float32),
    (2, 96, 16, torch.float32),
    (8, 128, 16, torch.bfloat16),
    (4, 64, 32, torch.bfloat16),
    (1, 128, 32, torch.float16),
    (8, 64, 16, torch.float16),
]


def _chunk_plan(block_size: int) -> list[tuple[int, int]]:
    """(cached prefix, chunk length) per sequence: a fresh prompt, chunks that end on and around page edges,
    a single-token chunk after a prefix, and a chunk long enough to span several query tiles (BLOCK_Q is
    64 / GQA for every dtype: 8 for GQA 8, 16 for GQA 4) and several 32-token (16-bit) or 16-token (fp32) KV tiles."""
    return [
        (0, 5),
        (block_size, block_size + 1),
        (3, 2 * block_size - 3),
        (block_size - 1, 1),
        (0, 1),
        (int(torch.randint(1, 2 * block_size, ())), int(torch.randint(17, 50, ()))),
    ]


def _prefill_inputs(plan, group, head_dim, block_size, dtype, device):
    context_lens = [prefix + q_len for prefix, q_len in plan]
    k_cache, v_cache, tables, lens = make_paged_kv(context_lens, NUM_KV_HEADS, head_dim, block_size, dtype, device)
    q_lens = torch.tensor([q_len for _, q_len in plan])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).to(device)
    query = torch.randn(int(q_lens.sum()), NUM_KV_HEADS * group, head_dim).to(dtype).to(device)
    return query, k_cache, v_cache, tables, cu_seqlens, lens


@pytest.mark.parametrize("group,head_dim,block_size,dtype", CASES)
def test_prefill_matches_reference(ops, device, group, head_dim, block_size, dtype):
    inputs = _prefill_inputs(_chunk_plan(block_size), group, head_dim, block_size, dtype, device)
    scale = head_dim**-0.5
    out = ops.paged_prefill_attention(*inputs, scale)
    expected = reference.paged_prefill_attention(*inputs, scale)
    assert_close(out, expected)


def test_prefill_empty_chunks_and_single_sequence(ops, device):
    """Zero-length chunks (sequences only decoding elsewhere) own a query tile that must exit cleanly."""
    for plan in ([(4, 0), (0, 20), (7, 0), (2, 3)], [(0, 33)]):
        inputs = _prefill_inputs(plan, 4, 64, 16, torch.float32, device)
        out = ops.paged_prefill_attention(*inputs, 0.2)
        assert_close(out, reference.paged_prefill_attention(*inputs, 0.2))


def test_prefill_is_causal(ops, device):
    """Changing the last chunk token's K/V must not change any earlier query's output."""
    query, k_cache, v_cache, tables, cu_seqlens, lens = _prefill_inputs([(6, 10)], 2, 64, 16, torch.float32, device)
    before = ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens, lens, 0.2)
    last = int(lens[0]) - 1
    block, offset = tables[0, last // 16], last % 16
    k_cache[block, offset] += 5.0
    v_cache[block, offset] -= 5.0
    after = ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens, lens, 0.2)
    assert torch.equal(after[:-1], before[:-1])
    assert not torch.allclose(after[-1], before[-1])


def test_prefill_strided_query_view(ops, device):
    plan = [(3, 9), (0, 4)]
    query, k_cache, v_cache, tables, cu_seqlens, lens = _prefill_inputs(plan, 2, 64, 16, torch.float32, device)
    qkv = torch.cat([query.flatten(1), torch.randn(query.shape[0], 2 * NUM_KV_HEADS * 64, device=device)], 1)
    view = qkv[:, : query.shape[1] * 64].view(query.shape)
    assert not view.is_contiguous()
    out = ops.paged_prefill_attention(view, k_cache, v_cache, tables, cu_seqlens, lens, 0.2)
    assert_close(out, reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens, lens, 0.2))


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(query=a["query"][:, :, :16]), r"query must be \[T, Hq, D\] with D = 64"),
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:-1]), r"cu_seqlens_q \[3\]"),
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), r"cu_seqlens_q must be int32"),
        (lambda a: a.update(query=a["query"].bfloat16()), r"query dtype torch.bfloat16 must match"),
        (lambda a: a.update(v_cache=a["v_cache"].half()), r"v_cache dtype torch.float16 != k_cache dtype"),
        (lambda a: a.update(k_cache=a["k_cache"].transpose(1, 2)), r"v_cache shape"),
    ],
)
def test_prefill_rejects_bad_arguments(ops, device, mutate, message):
    inputs = _prefill_inputs([(0, 3), (2, 2)], 2, 64, 16, torch.float32, device)
    query, k_cache, v_cache, tables, cu_seqlens, lens = inputs
    args = dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=tables, cu_seqlens_q=cu_seqlens,
                context_lens=lens)  # fmt: skip
    mutate(args)
    with pytest.raises(ValueError, match="^paged_prefill_attention: .*" + message):
        ops.paged_prefill_attention(**args, scale=0.2)


def test_caches_must_be_contiguous(ops, device):
    query, k_cache, v_cache, tables, cu_seqlens, lens = _prefill_inputs([(0, 3)], 2, 64, 16, torch.float32, device)
    k_strided = torch.empty(k_cache.shape[0], k_cache.shape[1], 2, 2, 64, device=device)[:, :, 0]
    with pytest.raises(ValueError, match=r"^paged_prefill_attention: k_cache must be contiguous"):
        ops.paged_prefill_attention(query, k_strided, v_cache, tables, cu_seqlens, lens, 0.2)
