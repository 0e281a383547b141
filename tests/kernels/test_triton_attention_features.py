"""Sliding window, logit soft-cap and sinks in the Triton paged attention kernels against the reference, per dtype:
contexts much longer than the window, windows not a multiple of the block size, the decode kernel in one
partition and split (sinks in the reduction; partitions before the window skipped), prefill chunks after cached
prefixes far past the window (query tiles whose first rows see none of a K/V tile)."""

from __future__ import annotations

import pytest
import torch
from paged_cases import assert_close, make_paged_kv

from pagedq.kernels import reference
from pagedq.kernels.decode_attention import paged_decode_attention_with_partition

NUM_KV_HEADS, HEAD_DIM, BLOCK = 2, 64, 16
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (window, softcap, sinks): each feature, and all together; windows off the block size and on it
VARIANTS = [(20, 0.0, False), (16, 1.5, False), (0, 0.0, True), (37, 2.0, True)]


def _variant(window, softcap, with_sinks, num_q_heads, device):
    sinks = (torch.randn(num_q_heads) * 2).to(device) if with_sinks else None
    return {"window": window, "softcap": softcap, "sinks": sinks}


@pytest.mark.parametrize(
    "dtype,partition_size", [(torch.float32, 512), (torch.bfloat16, 512)] + [(d, 32) for d in DTYPES]
)
@pytest.mark.parametrize("window,softcap,with_sinks", VARIANTS)
def test_decode_matches_reference(device, dtype, window, softcap, with_sinks, partition_size):
    """Partitions of 32 split every context past 32 tokens; 512 keeps each in one."""
    torch.manual_seed(window + partition_size)
    lens = [1, 19, 21, 40, 100, 130]
    group = 4
    k_cache, v_cache, tables, context_lens = make_paged_kv(lens, NUM_KV_HEADS, HEAD_DIM, BLOCK, dtype, device)
    query = torch.randn(len(lens), NUM_KV_HEADS * group, HEAD_DIM).to(dtype).to(device)
    variant = _variant(window, softcap, with_sinks, NUM_KV_HEADS * group, device)
    args = (query, k_cache, v_cache, tables, context_lens, 0.3)
    out = paged_decode_attention_with_partition(*args, partition_size, **variant)
    assert_close(out, reference.paged_decode_attention(*args, **variant))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap,with_sinks", VARIANTS)
def test_prefill_matches_reference(ops, device, dtype, window, softcap, with_sinks):
    torch.manual_seed(window + 1)
    group = 2
    chunks = [(0, 45), (70, 33), (3, 1), (50, 5)]  # (cached prefix, chunk length)
    lens = [prefix + q_len for prefix, q_len in chunks]
    k_cache, v_cache, tables, context_lens = make_paged_kv(lens, NUM_KV_HEADS, HEAD_DIM, BLOCK, dtype, device)
    q_lens = [q_len for _, q_len in chunks]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).to(device)
    query = torch.randn(sum(q_lens), NUM_KV_HEADS * group, HEAD_DIM).to(dtype).to(device)
    variant = _variant(window, softcap, with_sinks, NUM_KV_HEADS * group, device)
    args = (query, k_cache, v_cache, tables, cu, context_lens, 0.3)
    out = ops.paged_prefill_attention(*args, **variant)
    assert_close(out, reference.paged_prefill_attention(*args, **variant))


def test_window_never_reads_blocks_before_it(ops, device):
    """Blocks wholly before every query's window may hold anything (NaN here): decode (split, so whole partitions
    are skipped) and prefill read none of them."""
    torch.manual_seed(3)
    window, context = 20, 130
    k_cache, v_cache, tables, lens = make_paged_kv([context], NUM_KV_HEADS, HEAD_DIM, BLOCK, torch.float32, device)
    query = torch.randn(1, NUM_KV_HEADS * 2, HEAD_DIM).to(device)
    chunk = torch.randn(16, NUM_KV_HEADS * 2, HEAD_DIM).to(device)  # positions 114..129: windows from 95 (block 5)
    cu = torch.tensor([0, 16], dtype=torch.int32).to(device)
    decode = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.3, window=window)
    prefill = reference.paged_prefill_attention(chunk, k_cache, v_cache, tables, cu, lens, 0.3, window=window)
    stale = tables[0, :5].long()
    k_cache[stale], v_cache[stale] = float("nan"), float("nan")
    out = paged_decode_attention_with_partition(query, k_cache, v_cache, tables, lens, 0.3, 32, window=window)
    assert_close(out, decode)
    assert_close(ops.paged_prefill_attention(chunk, k_cache, v_cache, tables, cu, lens, 0.3, window=window), prefill)


def test_bad_variants_are_refused(ops, device):
    k_cache, v_cache, tables, lens = make_paged_kv([5], NUM_KV_HEADS, HEAD_DIM, BLOCK, torch.float32, device)
    query = torch.randn(1, 4, HEAD_DIM).to(device)
    with pytest.raises(ValueError, match="sinks must be"):
        ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.3, sinks=torch.zeros(3).to(device))
    with pytest.raises(ValueError, match="window must be"):
        ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.3, window=-2)
    with pytest.raises(ValueError, match="softcap must be"):
        ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.3, softcap=float("inf"))


def test_sliding_engine_on_triton_kernels_matches_reference(tmp_path, monkeypatch):
    """End to end on the Triton path (interpreted here): a Mistral whose every layer slides through a window of
    10 (block 8) serves a prompt and output past it, its blocks before the window given back, with the reference
    backend's greedy tokens."""
    import random

    import transformers

    from pagedq.engine import LLM, SamplingParams
    from tests.conftest import VOCAB_SIZE, build_tokenizer

    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=10, tie_word_embeddings=False,
        initializer_range=0.2,
    )  # fmt: skip
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (27, 4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine_kwargs = dict(num_kv_blocks=8, block_size=8, max_num_batched_tokens=12)
    monkeypatch.setenv("PAGEDQ_KERNELS", "reference")
    expected = LLM(tmp_path, **engine_kwargs).generate(prompts, params)
    monkeypatch.setenv("PAGEDQ_KERNELS", "triton")
    llm = LLM(tmp_path, **engine_kwargs)
    got = llm.generate(prompts, params)
    assert llm.llm_engine.block_manager.sliding_window == 10
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
