"""store_kv_cache against the reference."""

from __future__ import annotations

import pytest
import torch
from paged_cases import assert_close

from pagedq.kernels import reference


def _store_inputs(num_tokens, num_kv_heads, head_dim, block_size, dtype, device, cache_dtype=None):
    num_blocks = 6
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype or dtype).to(device)
    v_cache = torch.randn_like(k_cache)
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(device)
    # Distinct slots scattered over the pool, with some padding tokens (-1) mixed in.
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.randperm(num_tokens)[: num_tokens // 3]] = -1
    return key, value, k_cache, v_cache, slots.to(device)


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,block_size,dtype,slot_dtype",
    [
        (2, 64, 16, torch.float32, torch.int64),
        (1, 128, 32, torch.bfloat16, torch.int32),
        (8, 128, 16, torch.float16, torch.int64),
        (3, 80, 16, torch.bfloat16, torch.int64),
    ],
)
def test_store_matches_reference(ops, device, num_kv_heads, head_dim, block_size, dtype, slot_dtype):
    key, value, k_cache, v_cache, slots = _store_inputs(13, num_kv_heads, head_dim, block_size, dtype, device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(key, value, expected_k, expected_v, slots)
    ops.store_kv_cache(key, value, k_cache, v_cache, slots.to(slot_dtype))
    # Same dtype in and out: a pure copy, so exact (untouched slots included).
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_store_casts_to_cache_dtype_and_reads_strided_views(ops, device):
    """fp32 key/value sliced out of a fused qkv tensor, stored into a bf16 cache."""
    num_tokens, heads, dim = 9, 2, 64
    qkv = torch.randn(num_tokens, (4 + 2 * heads) * dim, device=device)
    key = qkv[:, 4 * dim : (4 + heads) * dim].view(num_tokens, heads, dim)
    value = qkv[:, (4 + heads) * dim :].view(num_tokens, heads, dim)
    _, _, k_cache, v_cache, slots = _store_inputs(num_tokens, heads, dim, 16, torch.float32, device, torch.bfloat16)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(key, value, expected_k, expected_v, slots)
    ops.store_kv_cache(key, value, k_cache, v_cache, slots)
    assert_close(k_cache, expected_k)
    assert_close(v_cache, expected_v)
    untouched = torch.ones(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(k_cache.flatten(0, 1)[untouched], expected_k.flatten(0, 1)[untouched])


def test_store_all_padding_and_empty(ops, device):
    key, value, k_cache, v_cache, _ = _store_inputs(4, 2, 64, 16, torch.float32, device)
    before = k_cache.clone()
    ops.store_kv_cache(key, value, k_cache, v_cache, torch.full((4,), -1, device=device))
    ops.store_kv_cache(key[:0], value[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.long, device=device))
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(key=a["key"][:, :1]), r"key must be \[T, 2, 64\] to match the cache, got \(4, 1, 64\)"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"][:3]), r"slot_mapping has 3 entries for 4 tokens"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), r"slot_mapping must be int32 or int64"),
        (lambda a: a.update(value=a["value"].int()), r"value must be float32, float16 or bfloat16"),
        (lambda a: a.update(k_cache=a["k_cache"][0]), r"k_cache must be \[num_blocks, block_size, num_kv_heads"),
    ],
)
def test_store_rejects_bad_arguments(ops, device, mutate, message):
    key, value, k_cache, v_cache, slots = _store_inputs(4, 2, 64, 16, torch.float32, device)
    args = dict(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    mutate(args)
    with pytest.raises(ValueError, match="^store_kv_cache: " + message):
        ops.store_kv_cache(**args)
