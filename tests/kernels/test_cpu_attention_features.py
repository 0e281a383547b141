"""Sliding window, logit soft-cap and sinks on the CPU paths (the native kernel, index_select + SDPA, and the
manual softmax path for soft-cap and sinks) against kernels.reference, per dtype: contexts much longer than the
window, windows that are not a multiple of the block size, decode, long and short prefill chunks."""

from __future__ import annotations

import pytest
import torch
from paged_cases import assert_close, make_paged_kv

from pagedq import kernels
from pagedq.engine.layers.attention import paged_attention
from pagedq.engine.layers.metadata import AttentionMetadata
from pagedq.kernels import cpu_attention, cpu_gathered, cpu_native, reference

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK = 2, 3, 64, 16
# (window, softcap, sinks): each feature, and all of them together; windows off the block size and on it
VARIANTS = [(24, 0.0, False), (7, 0.0, False), (16, 1.5, False), (0, 0.0, True), (37, 2.0, True)]
# every dtype; fp16 never takes the native kernel
PATHS = [(torch.float32, "native"), (torch.bfloat16, "native"), (torch.float32, "sdpa"), (torch.bfloat16, "sdpa")]
PATHS += [(torch.float16, "sdpa")]
DECODE_LENS = [1, 6, 7, 8, 24, 25, 40, 100, 161]  # around and far past every window


def _native(monkeypatch, path: str) -> None:
    if path == "sdpa":
        monkeypatch.setenv("PAGEDQ_CPU_NATIVE", "0")
    else:
        monkeypatch.delenv("PAGEDQ_CPU_NATIVE", raising=False)
        assert cpu_native.available(), cpu_native.failure()


def _variant(window, softcap, with_sinks):
    sinks = torch.randn(NUM_KV_HEADS * GROUP) * 2 if with_sinks else None
    return {"window": window, "softcap": softcap, "sinks": sinks}


@pytest.mark.parametrize("dtype,path", PATHS)
@pytest.mark.parametrize("window,softcap,with_sinks", VARIANTS)
def test_decode_matches_reference(monkeypatch, dtype, path, window, softcap, with_sinks):
    _native(monkeypatch, path)
    torch.manual_seed(window)
    k_cache, v_cache, tables, lens = make_paged_kv(DECODE_LENS, NUM_KV_HEADS, HEAD_DIM, BLOCK, dtype, "cpu")
    query = torch.randn(len(DECODE_LENS), NUM_KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    variant = _variant(window, softcap, with_sinks)
    args = (query, k_cache, v_cache, tables, lens, 0.3)
    out = cpu_attention.paged_decode_attention(*args, **variant)
    assert_close(out, reference.paged_decode_attention(*args, **variant))


@pytest.mark.parametrize("dtype,path", PATHS)
@pytest.mark.parametrize("window,softcap,with_sinks", VARIANTS)
def test_prefill_matches_reference(monkeypatch, dtype, path, window, softcap, with_sinks):
    """Long chunks from token 0 and after cached prefixes far past the window (the gather starts at the first
    query's window), and short chunks (the native kernel's, or SDPA's batched groups)."""
    _native(monkeypatch, path)
    torch.manual_seed(window + 1)
    chunks = [(0, 40), (70, 33), (5, 20), (90, 3), (0, 5), (30, 17), (2, 1)]  # (cached prefix, chunk)
    lens = [prefix + q_len for prefix, q_len in chunks]
    k_cache, v_cache, tables, context_lens = make_paged_kv(lens, NUM_KV_HEADS, HEAD_DIM, BLOCK, dtype, "cpu")
    cu = torch.tensor([0, *torch.tensor([q for _, q in chunks]).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), NUM_KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    variant = _variant(window, softcap, with_sinks)
    args = (query, k_cache, v_cache, tables, cu, context_lens, 0.3)
    out = cpu_attention.paged_prefill_attention(*args, **variant)
    assert_close(out, reference.paged_prefill_attention(*args, **variant))


def test_window_skips_blocks_before_it(monkeypatch):
    """The native kernel and the long-chunk gather never read a block wholly before every query's window: blocks
    full of NaN there leave the output as it is."""
    torch.manual_seed(5)
    window, context = 20, 100
    k_cache, v_cache, tables, lens = make_paged_kv([context], NUM_KV_HEADS, HEAD_DIM, BLOCK, torch.float32, "cpu")
    query = torch.randn(1, NUM_KV_HEADS * GROUP, HEAD_DIM)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.3, window=window)
    before_window = tables[0, : (context - window) // BLOCK].long()  # blocks 0..4 end at token 79 < 80
    k_cache[before_window], v_cache[before_window] = float("nan"), float("nan")
    _native(monkeypatch, "native")
    out = cpu_attention.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.3, window=window)
    assert_close(out, expected)
    chunk = torch.randn(30, NUM_KV_HEADS * GROUP, HEAD_DIM)  # positions 70..99: the window starts at 51 (block 3)
    cu = torch.tensor([0, 30], dtype=torch.int32)
    k_cache[tables[0, 3:].long()] = torch.randn_like(k_cache[tables[0, 3:].long()])
    v_cache[tables[0, 3:].long()] = torch.randn_like(v_cache[tables[0, 3:].long()])
    k_cache[tables[0, :3].long()], v_cache[tables[0, :3].long()] = float("nan"), float("nan")
    out = cpu_attention.paged_prefill_attention(chunk, k_cache, v_cache, tables, cu, lens, 0.3, window=window)
    assert not out.isnan().any()
    clean_k, clean_v = k_cache.nan_to_num(), v_cache.nan_to_num()
    expected = reference.paged_prefill_attention(chunk, clean_k, clean_v, tables, cu, lens, 0.3, window=window)
    assert_close(out, expected)


def test_layers_with_different_windows_share_a_step(monkeypatch):
    """A mixed local/global model's layers run one step's metadata with different windows: each gets the plan for
    its own window (the plans are kept per window), and each output equals the reference's."""
    monkeypatch.setenv("PAGEDQ_CPU_NATIVE", "0")
    torch.manual_seed(6)
    decode_lens, prefill = [3, 150, 40], [(0, 30), (60, 20)]
    num = len(decode_lens)
    all_lens = decode_lens + [prefix + q_len for prefix, q_len in prefill]
    k_cache, v_cache, tables, lens = make_paged_kv(all_lens, NUM_KV_HEADS, HEAD_DIM, BLOCK, torch.float32, "cpu")
    cu = torch.tensor([0, 30, 50], dtype=torch.int32)
    meta = AttentionMetadata(torch.zeros(0), num, tables[:num], lens[:num], tables[num:], cu, lens[num:])
    query = torch.randn(num + 50, NUM_KV_HEADS * GROUP, HEAD_DIM)
    ops = kernels.bind("cpu")
    for window in (0, 24, 0, 24):
        out = paged_attention(ops, query, k_cache, v_cache, meta, 0.2, window=window)
        decode = reference.paged_decode_attention(query[:num], k_cache, v_cache, tables[:num], lens[:num], 0.2,
                                                  window=window)  # fmt: skip
        chunks = reference.paged_prefill_attention(query[num:], k_cache, v_cache, tables[num:], cu, lens[num:], 0.2,
                                                   window=window)  # fmt: skip
        assert_close(out, torch.cat([decode, chunks]))
    assert len(meta.derived) == 4  # a decode and a prefill plan per window


def test_manual_path_slices_rows(monkeypatch):
    """The manual softmax path scores a bounded slice of query rows at a time; slicing changes nothing."""
    monkeypatch.setenv("PAGEDQ_CPU_NATIVE", "0")
    monkeypatch.setattr(cpu_gathered, "MANUAL_SCORES_PER_SLICE", 200)
    torch.manual_seed(7)
    k_cache, v_cache, tables, lens = make_paged_kv([90], NUM_KV_HEADS, HEAD_DIM, BLOCK, torch.float32, "cpu")
    query = torch.randn(50, NUM_KV_HEADS * GROUP, HEAD_DIM)
    cu = torch.tensor([0, 50], dtype=torch.int32)
    variant = _variant(30, 1.0, True)
    out = cpu_attention.paged_prefill_attention(query, k_cache, v_cache, tables, cu, lens, 0.3, **variant)
    assert_close(out, reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, lens, 0.3, **variant))


def test_native_rejects_bad_variants():
    query, k_cache, v_cache = torch.randn(1, 4, 64), torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    assert cpu_native.available(), cpu_native.failure()
    with pytest.raises(ValueError, match="sinks"):
        cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.1, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="window"):
        cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.1, window=-1)
