"""pagedq.kernels.cpu_attention (index_select + SDPA, the CPU default) against kernels.reference, per dtype."""

from __future__ import annotations

import itertools

import pytest
import torch
from paged_cases import assert_close, edge_context_lens, make_paged_kv

from pagedq import kernels
from pagedq.kernels import cpu_attention, reference

NUM_KV_HEADS = 3
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,head_dim,block_size", [(3, 64, 16), (1, 32, 8), (4, 64, 32)])
def test_decode_matches_reference(dtype, group, head_dim, block_size):
    torch.manual_seed(0)
    lens = edge_context_lens(block_size, extra_random=3, max_len=5 * block_size)
    k_cache, v_cache, tables, context_lens = make_paged_kv(lens, NUM_KV_HEADS, head_dim, block_size, dtype, "cpu")
    query = torch.randn(len(lens), NUM_KV_HEADS * group, head_dim).to(dtype)
    args = (query, k_cache, v_cache, tables, context_lens, head_dim**-0.5)
    assert_close(cpu_attention.paged_decode_attention(*args), reference.paged_decode_attention(*args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_in_length_groups_matches_reference(dtype):
    """A step whose contexts spread widely runs in several length groups, each padded to its own longest; the
    outputs come back in the step's order."""
    torch.manual_seed(3)
    lens = torch.randint(1, 300, (24,)).tolist()
    groups = cpu_attention.length_groups(torch.tensor(lens).numpy(), 16)
    assert len(groups) > 1
    k_cache, v_cache, tables, context_lens = make_paged_kv(lens, NUM_KV_HEADS, 64, 16, dtype, "cpu")
    query = torch.randn(len(lens), NUM_KV_HEADS * 3, 64).to(dtype)
    args = (query, k_cache, v_cache, tables, context_lens, 0.125)
    assert_close(cpu_attention.paged_decode_attention(*args), reference.paged_decode_attention(*args))


def test_length_groups_cover_the_sorted_sequences_once():
    lens = torch.tensor([300, 5, 17, 290, 33, 7, 160, 150, 310, 2]).numpy()
    groups = cpu_attention.length_groups(lens, 16)
    assert groups[0][0] == 0 and groups[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups)) and len(groups) <= cpu_attention.MAX_LENGTH_GROUPS
    padded = sorted(-(-n // 16) * 16 for n in lens)
    assert [longest for _, _, longest in groups] == [padded[end - 1] for _, end, _ in groups]
    assert cpu_attention.length_groups(torch.tensor([40, 41, 45]).numpy(), 16) == [(0, 3, 48)]  # nothing to save


def test_decode_reads_only_up_to_each_context_len():
    """Table entries past a row's length, and cache slots past its context, never reach the output, however
    wide the step's table is (a long prefill row widens it)."""
    torch.manual_seed(1)
    k_cache, v_cache, tables, lens = make_paged_kv([5, 17, 40], NUM_KV_HEADS, 64, 16, torch.float32, "cpu")
    wide = torch.cat([tables, torch.randint(0, k_cache.shape[0], (3, 6), dtype=torch.int32)], dim=1)
    query = torch.randn(3, 2 * NUM_KV_HEADS, 64)
    before = cpu_attention.paged_decode_attention(query, k_cache, v_cache, wide, lens, 0.125)
    k_cache[tables[0, 0], 5:] = 1e3  # past row 0's 5 tokens, inside its block: masked, however large
    v_cache[tables[0, 0], 5:] = 1e3
    after = cpu_attention.paged_decode_attention(query, k_cache, v_cache, wide, lens, 0.125)
    assert torch.equal(after[1:], before[1:])
    assert_close(after[0], before[0])
    assert_close(after, reference.paged_decode_attention(query, k_cache, v_cache, wide, lens, 0.125))


def test_decode_with_no_rows():
    k_cache, v_cache, tables, lens = make_paged_kv([4], NUM_KV_HEADS, 64, 16, torch.float32, "cpu")
    query = torch.randn(0, NUM_KV_HEADS, 64)
    out = cpu_attention.paged_decode_attention(query, k_cache, v_cache, tables[:0], lens[:0], 0.125)
    assert out.shape == (0, NUM_KV_HEADS, 64)


def _prefill_inputs(plan, group, head_dim, block_size, dtype):
    context_lens = [prefix + q_len for prefix, q_len in plan]
    k_cache, v_cache, tables, lens = make_paged_kv(context_lens, NUM_KV_HEADS, head_dim, block_size, dtype, "cpu")
    q_lens = torch.tensor([q_len for _, q_len in plan])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32)
    query = torch.randn(int(q_lens.sum()), NUM_KV_HEADS * group, head_dim).to(dtype)
    return query, k_cache, v_cache, tables, cu_seqlens, lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,block_size", [(3, 16), (2, 8)])
def test_prefill_matches_reference(dtype, group, block_size):
    """Fresh prompts (is_causal), chunks after a cached prefix (explicit mask), empty and one-token chunks."""
    torch.manual_seed(2)
    plan = [(0, 5), (block_size, block_size + 1), (3, 2 * block_size - 3), (block_size - 1, 1), (4, 0), (0, 1), (0, 37)]
    inputs = _prefill_inputs(plan, group, 64, block_size, dtype)
    expected = reference.paged_prefill_attention(*inputs, 0.125)
    assert_close(cpu_attention.paged_prefill_attention(*inputs, 0.125), expected)


def test_prefill_strided_query_view():
    """The attention layer hands over q as a view of the packed qkv projection."""
    query, k_cache, v_cache, tables, cu_seqlens, lens = _prefill_inputs([(3, 9), (0, 4)], 2, 64, 16, torch.float32)
    qkv = torch.cat([query.flatten(1), torch.randn(query.shape[0], 2 * NUM_KV_HEADS * 64)], 1)
    view = qkv[:, : query.shape[1] * 64].view(query.shape)
    assert not view.is_contiguous()
    out = cpu_attention.paged_prefill_attention(view, k_cache, v_cache, tables, cu_seqlens, lens, 0.2)
    assert_close(out, reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens, lens, 0.2))


def test_one_step_plan_serves_every_layer(monkeypatch):
    """The engine's layers plan a step once (the first layer asks, AttentionMetadata keeps it) and every layer runs
    over the plan with its own cache: each layer's output still equals the reference's over that layer's cache."""
    from pagedq.engine.layers import AttentionMetadata, paged_attention

    torch.manual_seed(4)
    plans: list[str] = []
    monkeypatch.setattr(cpu_attention, "plan_decode", _counted(cpu_attention.plan_decode, plans))
    monkeypatch.setattr(cpu_attention, "plan_prefill", _counted(cpu_attention.plan_prefill, plans))
    decode_lens, prefill = [3, 150, 17, 260, 40, 33], [(0, 7), (16, 5)]  # prefill: (cached prefix, chunk)
    num = len(decode_lens)
    all_lens = decode_lens + [prefix + q_len for prefix, q_len in prefill]
    k_cache, v_cache, tables, lens = make_paged_kv(all_lens, NUM_KV_HEADS, 64, 16, torch.float32, "cpu")
    cu_seqlens = torch.tensor([0, 7, 12], dtype=torch.int32)
    meta = AttentionMetadata(torch.zeros(0), num, tables[:num], lens[:num], tables[num:], cu_seqlens, lens[num:])
    query = torch.randn(num + 12, NUM_KV_HEADS * 3, 64)
    ops = kernels.bind("cpu")
    for layer_k, layer_v in [(k_cache, v_cache), (torch.randn_like(k_cache), torch.randn_like(v_cache))]:
        out = paged_attention(ops, query, layer_k, layer_v, meta, 0.125)
        decode = reference.paged_decode_attention(query[:num], layer_k, layer_v, tables[:num], lens[:num], 0.125)
        chunks = reference.paged_prefill_attention(
            query[num:], layer_k, layer_v, tables[num:], cu_seqlens, lens[num:], 0.125
        )
        assert_close(out, torch.cat([decode, chunks]))
    assert sorted(plans) == ["plan_decode", "plan_prefill"]  # once each, for both layers


def _counted(fn, calls):
    def wrapper(*args, **kwargs):
        calls.append(fn.__name__)
        return fn(*args, **kwargs)

    return wrapper


def test_decode_plan_drops_the_mask_when_every_slot_is_valid():
    """Rows that fill their gathered blocks exactly need no mask; SDPA without one still matches the reference."""
    k_cache, v_cache, tables, lens = make_paged_kv([32, 32, 32], NUM_KV_HEADS, 64, 16, torch.float32, "cpu")
    plan = cpu_attention.plan_decode(tables, lens, 16)
    assert [group.mask for group in plan.groups] == [None] and plan.order is None
    query = torch.randn(3, NUM_KV_HEADS * 4, 64)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    assert_close(cpu_attention.planned_decode(query, k_cache, v_cache, plan, 0.125), expected)


def test_cpu_backend_takes_its_cpu_paths_and_the_reference_for_the_rest(monkeypatch):
    monkeypatch.delenv("PAGEDQ_KERNELS", raising=False)
    bound = kernels.bind("cpu")
    assert bound.backend == "cpu"
    assert kernels.CPU_PATHS["paged_decode_attention"] is cpu_attention
    for name in kernels.KERNEL_NAMES:
        source = kernels.CPU_PATHS.get(name, reference)
        assert getattr(bound, name) is getattr(source, name), name
    monkeypatch.setenv("PAGEDQ_KERNELS", "reference")  # the oracle stays one switch away
    assert kernels.bind("cpu").paged_decode_attention is reference.paged_decode_attention
    monkeypatch.setenv("PAGEDQ_KERNELS", "cpu")
    with pytest.raises(ValueError, match="CPU tensors only"):
        kernels.bind("cuda")  # refused when bound, not at the first decode


def test_allocator_tuning_leaves_a_users_malloc_settings_alone(monkeypatch):
    from pagedq.kernels.cpu_allocator import tune_cpu_allocator

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert tune_cpu_allocator() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    assert tune_cpu_allocator() is True  # glibc (this image): mallopt accepted both settings
