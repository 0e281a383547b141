"""paged_decode_attention (flash-decoding) against the reference."""

from __future__ import annotations

import pytest
import torch
from paged_cases import assert_close, edge_context_lens, make_paged_kv

from pagedq.kernels import reference
from pagedq.kernels.decode_attention import paged_decode_attention_with_partition

NUM_KV_HEADS = 2

# (query heads per KV head, head_dim, block_size, dtype): GQA 1/4/8, head dims 64/128 (+96), pages 16/32,
# every dtype, without the full cross product (the interpreter is slow).
CASES = [
    (1, 64, 16, torch.float32),
    (4, 128, 16, torch.float32),
    (8, 64, 32, torch.float32),
    (2, 96, 16, torch.float32),
    (4, 128, 32, torch.bfloat16),
    (1, 64, 16, torch.bfloat16),
    (8, 128, 16, torch.float16),
    (4, 64, 32, torch.float16),
]


def _decode_inputs(context_lens, group, head_dim, block_size, dtype, device, num_kv_heads=NUM_KV_HEADS):
    k_cache, v_cache, tables, lens = make_paged_kv(context_lens, num_kv_heads, head_dim, block_size, dtype, device)
    query = torch.randn(len(context_lens), num_kv_heads * group, head_dim).to(dtype).to(device)
    return query, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("group,head_dim,block_size,dtype", CASES)
def test_decode_matches_reference_single_partition(ops, device, group, head_dim, block_size, dtype):
    context_lens = edge_context_lens(block_size, extra_random=2)
    query, k_cache, v_cache, tables, lens = _decode_inputs(context_lens, group, head_dim, block_size, dtype, device)
    scale = head_dim**-0.5
    out = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    assert_close(out, expected)


@pytest.mark.parametrize(
    "group,head_dim,block_size,dtype,partition_size",
    [
        (4, 64, 16, torch.float32, 16),
        (8, 128, 32, torch.float32, 32),
        (1, 128, 16, torch.bfloat16, 32),
        (4, 64, 32, torch.float16, 64),
    ],
)
def test_decode_split_into_partitions(device, group, head_dim, block_size, dtype, partition_size):
    """Small partitions make short contexts span many of them, exercising the reduction kernel."""
    context_lens = [*edge_context_lens(block_size, extra_random=1, max_len=6 * block_size), 5 * block_size + 3]
    query, k_cache, v_cache, tables, lens = _decode_inputs(context_lens, group, head_dim, block_size, dtype, device)
    out = paged_decode_attention_with_partition(query, k_cache, v_cache, tables, lens, 0.3, partition_size)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.3)
    assert_close(out, expected)


def test_decode_long_context_default_partitions(ops, device):
    """Contexts past the default 512-token partition go through the real split path, including a sequence
    whose last partition holds a single token and one that needs no split while its neighbours do."""
    context_lens = [1100, 513, 300]
    query, k_cache, v_cache, tables, lens = _decode_inputs(context_lens, 4, 64, 16, torch.float32, device, 1)
    out = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    assert_close(out, expected)


def test_decode_strided_query_view(ops, device):
    """A query sliced out of a fused qkv tensor (row stride != Hq * D) is read through its strides."""
    context_lens = [7, 20]
    _, k_cache, v_cache, tables, lens = _decode_inputs(context_lens, 2, 64, 16, torch.float32, device)
    qkv = torch.randn(2, 4 * 64 + 2 * 2 * 64, device=device)
    query = qkv[:, : 4 * 64].view(2, 4, 64)
    assert not query.is_contiguous()
    out = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    expected = reference.paged_decode_attention(query.contiguous(), k_cache, v_cache, tables, lens, 0.125)
    assert_close(out, expected)


def test_decode_ignores_cache_beyond_context(ops, device):
    """Poisoning every cached token past context_len (and unused table entries) must not change the output."""
    context_lens = [5, 17]
    query, k_cache, v_cache, tables, lens = _decode_inputs(context_lens, 4, 64, 16, torch.float32, device)
    expected = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    for seq, length in enumerate(context_lens):
        for pos in range(length, tables.shape[1] * 16):
            block, offset = tables[seq, pos // 16], pos % 16
            if pos // 16 >= -(-length // 16):
                continue  # a block past the context may be shared with other sequences
            k_cache[block, offset] = float("nan")
            v_cache[block, offset] = float("nan")
    out = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(query=a["query"][:, :, :32]), r"query must be \[S, Hq, D\] with D = 64"),
        (lambda a: a.update(query=a["query"][:, :3]), r"Hq a multiple of the cache's 2 KV heads"),
        (lambda a: a.update(query=a["query"].half()), r"query dtype torch.float16 must match the cache dtype"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), r"block_tables must be int32"),
        (lambda a: a.update(context_lens=a["context_lens"][:1]), r"one row per query sequence \(2\)"),
        (lambda a: a.update(k_cache=a["k_cache"][:, :, :, :32]), r"v_cache shape .* != k_cache shape"),
        (lambda a: a.update(query=a["query"][0]), r"query must be \[S, Hq, D\], got shape \(4, 64\)"),
    ],
)
def test_decode_rejects_bad_arguments(ops, device, mutate, message):
    query, k_cache, v_cache, tables, lens = _decode_inputs([5, 9], 2, 64, 16, torch.float32, device)
    args = dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=tables, context_lens=lens)
    mutate(args)
    with pytest.raises(ValueError, match="^paged_decode_attention: .*" + message):
        ops.paged_decode_attention(**args, scale=0.125)
