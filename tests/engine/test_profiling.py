"""The GPU block-count profiler, exercised on CPU with torch.cuda's memory counters replaced by fakes."""

from __future__ import annotations

import types

import pytest
import torch

from pagedq.engine.llm_engine import LLMEngine
from pagedq.engine.runner.profiling import profile_num_blocks


def test_blocks_fill_what_weights_and_the_step_peak_leave(tiny_llama_dir, monkeypatch):
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=8, max_num_batched_tokens=64)
    runner = engine.model_runner
    gib = 2**30
    fake = types.SimpleNamespace(total_memory=10 * gib)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: fake)
    scratch = (
        2
        * engine.model_config.num_layers
        * 4
        * 16
        * engine.model_config.num_kv_heads
        * engine.model_config.head_dim
        * 4
    )  # 64 tokens = 4 blocks of 16, fp32
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * gib + scratch)
    blocks = profile_num_blocks(runner)
    assert blocks == int((10 * gib * 0.9 - 3 * gib) // runner.bytes_per_block)

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 12 * gib)
    with pytest.raises(RuntimeError, match="no room for the KV cache"):
        profile_num_blocks(runner)
