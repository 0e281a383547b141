"""copy_blocks against the reference: every layer's K and V, many pairs, one launch."""

from __future__ import annotations

import pytest
import torch

from pagedq.kernels import reference


def _caches(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    keys = [torch.randn(shape).to(dtype).to(device) for _ in range(num_layers)]
    values = [torch.randn(shape).to(dtype).to(device) for _ in range(num_layers)]
    return keys, values


def _mapping(num_blocks, num_pairs, device, repeat_sources=False):
    """Distinct destinations disjoint from the sources, scattered over the pool; sources may repeat."""
    blocks = torch.randperm(num_blocks)
    dst = blocks[:num_pairs]
    src_pool = blocks[num_pairs:]
    src = src_pool[torch.randint(len(src_pool), (num_pairs,))] if repeat_sources else src_pool[:num_pairs]
    return torch.stack([src, dst], dim=1).to(device)


@pytest.mark.parametrize(
    "num_layers,block_size,num_kv_heads,head_dim,dtype,num_pairs,repeat_sources",
    [
        (3, 16, 2, 64, torch.float32, 12, False),
        (2, 32, 1, 128, torch.bfloat16, 9, True),
        (4, 16, 3, 80, torch.bfloat16, 20, False),  # 3840-element blocks: one masked chunk
        (1, 32, 8, 32, torch.float16, 5, True),
    ],
)
def test_copy_blocks_matches_reference(ops, device, num_layers, block_size, num_kv_heads, head_dim, dtype,
                                       num_pairs, repeat_sources):  # fmt: skip
    num_blocks = 2 * num_pairs + 3
    keys, values = _caches(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    mapping = _mapping(num_blocks, num_pairs, device, repeat_sources)
    before = [t.clone() for t in keys + values]
    expected_k, expected_v = [k.clone() for k in keys], [v.clone() for v in values]
    reference.copy_blocks(expected_k, expected_v, mapping)
    ops.copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, expected_k + expected_v):
        assert torch.equal(got, want)  # a copy: exact, untouched blocks included
    # Data really moved, in K and in V of every layer (so the equality above is not trivially true): each
    # destination now holds its source's block, K from K and V from V, and differs from what it held before.
    for got, old in zip(keys + values, before):
        for src, dst in mapping.tolist():
            assert torch.equal(got[dst], old[src]) and not torch.equal(got[dst], old[dst])


def test_copy_blocks_large_block_spans_several_chunks_and_int32_mapping(ops, device):
    keys, values = _caches(2, 6, 32, 4, 64, torch.float32, device)  # 8192 elements: two 4096-element chunks
    mapping = torch.tensor([[0, 5], [0, 3], [2, 1]], dtype=torch.int32, device=device)
    expected_k, expected_v = [k.clone() for k in keys], [v.clone() for v in values]
    reference.copy_blocks(expected_k, expected_v, mapping)
    ops.copy_blocks(keys, values, mapping)
    assert all(torch.equal(a, b) for a, b in zip(keys + values, expected_k + expected_v))


def test_copy_blocks_empty_mapping_is_a_no_op(ops, device):
    keys, values = _caches(2, 4, 16, 2, 32, torch.bfloat16, device)
    before = [t.clone() for t in keys + values]
    ops.copy_blocks(keys, values, torch.zeros(0, 2, dtype=torch.long, device=device))
    assert all(torch.equal(a, b) for a, b in zip(keys + values, before))


def _bad(mutate):
    def build(device):
        keys, values = _caches(2, 8, 16, 2, 32, torch.float32, device)
        args = dict(key_caches=keys, value_caches=values, block_mapping=torch.tensor([[1, 2], [3, 4]], device=device))
        mutate(args)
        return args

    return build


@pytest.mark.parametrize(
    "build,message",
    [
        (_bad(lambda a: a.update(block_mapping=torch.tensor([[1, 2], [2, 4]]))),
         r"a destination block is also a source"),
        (_bad(lambda a: a.update(block_mapping=torch.tensor([[1, 2], [3, 2]]))),
         r"destination blocks must be distinct"),
        (_bad(lambda a: a.update(block_mapping=torch.tensor([[1, 8]]))), r"block ids must be in \[0, 8\)"),
        (_bad(lambda a: a.update(block_mapping=torch.tensor([[-1, 2]]))), r"block ids must be in \[0, 8\)"),
        (_bad(lambda a: a.update(block_mapping=torch.tensor([1, 2]))), r"block_mapping must be \[N, 2\]"),
        (_bad(lambda a: a.update(block_mapping=torch.tensor([[1.0, 2.0]]))), r"block_mapping must be int64 or int32"),
        (_bad(lambda a: a.update(value_caches=a["value_caches"][:1])), r"2 key caches but 1 value caches"),
        (_bad(lambda a: a["value_caches"].__setitem__(1, a["value_caches"][1].double())), r"value_caches\[1\] is"),
        (_bad(lambda a: a["key_caches"].__setitem__(1, a["key_caches"][1][:4])),
         r"key_caches\[1\] is \(4, 16, 2, 32\)"),
        (_bad(lambda a: a.update(key_caches=[k.transpose(2, 3) for k in a["key_caches"]],
                                 value_caches=[v.transpose(2, 3) for v in a["value_caches"]])),
         r"key_caches\[0\] must be contiguous"),
    ],
)  # fmt: skip
def test_copy_blocks_rejects_bad_arguments(ops, build, message):
    args = build("cpu")  # the value checks run on host mappings only (on a GPU they would cost a sync)
    with pytest.raises(ValueError, match="^copy_blocks: " + message):
        ops.copy_blocks(**args)
