"""The CPU KV pool: zeroed by the OS page by page (resident only where written), the same numerics as before."""

from __future__ import annotations

import torch

from engine import LLM
from engine.model_runner import _lazily_zeroed


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_lazily_zeroed_pool_is_zero_writable_and_not_resident_until_written():
    before = _resident_bytes()
    pool = _lazily_zeroed((1024, 16, 8, 64), torch.bfloat16)  # 16 MiB
    assert pool.shape == (1024, 16, 8, 64) and pool.dtype == torch.bfloat16
    assert _resident_bytes() - before < 4 * 2**20  # nothing touched yet
    pool[3] = 1.5
    assert pool[3].eq(1.5).all() and pool[:3].eq(0).all() and pool[4:8].eq(0).all()


def test_cpu_engine_caches_are_lazily_zeroed_and_serve(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kv_blocks=32)
    k_cache, v_cache = llm.llm_engine.model_runner.kv_caches[0]
    assert k_cache.eq(0).all() and v_cache.eq(0).all() and k_cache.data_ptr() != v_cache.data_ptr()
    out = llm.generate([[5, 6, 7]])
    assert len(out[0].outputs[0].token_ids) > 0 and k_cache.ne(0).any()
