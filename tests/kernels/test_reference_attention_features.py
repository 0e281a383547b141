"""The reference's window, softcap and sinks against transformers' own definitions: its sliding-window mask
(masking_utils.sliding_window_overlay, the one Mistral, Qwen2, Gemma and gpt-oss use), Gemma 2's eager attention
(soft-capping) and gpt-oss's eager attention (sinks). Every other backend is tested against the reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from paged_cases import make_paged_kv
from transformers.masking_utils import sliding_window_overlay
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from pagedq.kernels import reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 8


def _oracle_mask(q_positions: list[int], context_len: int, window: int) -> torch.Tensor:
    """transformers' causal (+ sliding) mask as an additive [1, 1, Q, K] fp32 tensor."""
    overlay = sliding_window_overlay(window) if window else None
    rows = [
        [0.0 if k <= q and (overlay is None or overlay(0, 0, q, k)) else float("-inf") for k in range(context_len)]
        for q in q_positions
    ]
    return torch.tensor(rows)[None, None]


def _oracle(kind: str, query, keys, values, mask, scale, softcap, sinks) -> torch.Tensor:
    """query [Q, Hq, D], keys/values [K, Hkv, D] -> [Q, Hq, D] by transformers' eager attention."""
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, training=False, head_dim=HEAD_DIM, sinks=sinks)
    q, k, v = (x.transpose(0, 1)[None] for x in (query, keys, values))
    if kind == "gpt_oss":
        out, _ = gpt_oss_eager(module, q, k, v, mask, scale)
    else:
        out, _ = gemma2_eager(module, q, k, v, mask, scaling=scale, softcap=softcap or None)
    return out[0]


@pytest.mark.parametrize(
    "kind,window,softcap",
    [
        ("gemma2", 0, 0.0),
        ("gemma2", 5, 0.0),
        ("gemma2", 11, 2.5),
        ("gemma2", 0, 1.5),
        ("gpt_oss", 0, 0.0),
        ("gpt_oss", 7, 0.0),
        ("gpt_oss", 16, 0.0),
    ],
)
def test_reference_matches_transformers(kind, window, softcap):
    context_lens = [1, 7, 16, 30]
    k_cache, v_cache, tables, lens = make_paged_kv(context_lens, KV_HEADS, HEAD_DIM, BLOCK, torch.float32, "cpu")
    sinks = torch.randn(HEADS) * 2 if kind == "gpt_oss" else None
    scale = 0.7  # large enough that the soft-cap bends the scores
    q_lens = [1, 3, 16, 9]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), HEADS, HEAD_DIM)
    kwargs = {"window": window, "softcap": softcap, "sinks": sinks}
    prefill = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, lens, scale, **kwargs)
    decode_query = torch.randn(len(context_lens), HEADS, HEAD_DIM)
    decode = reference.paged_decode_attention(decode_query, k_cache, v_cache, tables, lens, scale, **kwargs)
    for seq, (context_len, q_len) in enumerate(zip(context_lens, q_lens, strict=True)):
        keys = reference.gather_kv(k_cache, tables[seq], context_len)
        values = reference.gather_kv(v_cache, tables[seq], context_len)
        positions = list(range(context_len - q_len, context_len))
        mask = _oracle_mask(positions, context_len, window)
        expected = _oracle(kind, query[cu[seq] : cu[seq + 1]], keys, values, mask, scale, softcap, sinks)
        torch.testing.assert_close(prefill[cu[seq] : cu[seq + 1]], expected, atol=1e-6, rtol=1e-5)
        last = _oracle_mask([context_len - 1], context_len, window)
        expected = _oracle(kind, decode_query[seq : seq + 1], keys, values, last, scale, softcap, sinks)
        torch.testing.assert_close(decode[seq : seq + 1], expected, atol=1e-6, rtol=1e-5)


def test_window_sees_exactly_window_keys():
    """A query at position p with window w attends to p - w + 1 .. p: only those keys move its output."""
    context_len, window = 20, 6
    k_cache, v_cache, tables, lens = make_paged_kv([context_len], 1, HEAD_DIM, BLOCK, torch.float32, "cpu")
    query = torch.randn(1, 1, HEAD_DIM)
    before = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.5, window=window)
    for position, moves in ((context_len - window - 1, False), (context_len - window, True)):
        changed = v_cache.clone()
        block, offset = tables[0, position // BLOCK], position % BLOCK
        changed[block, offset] += 10.0
        after = reference.paged_decode_attention(query, k_cache, changed, tables, lens, 0.5, window=window)
        assert bool((after - before).abs().max() > 1e-3) == moves, position
