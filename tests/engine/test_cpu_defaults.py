"""CPU defaults: the KV pool zeroed by the OS page by page (resident only where written), async scheduling, logits
only for the rows that sample."""

from __future__ import annotations

import torch

from pagedq.engine import LLM
from pagedq.engine.runner.model_runner import _lazily_zeroed


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


def test_async_scheduling_defaults_per_device(monkeypatch, tiny_llama_dir):
    """On for both, CPU as measured (pagedq/engine/config/engine.py); an explicit choice always wins."""
    import pagedq.engine.config.engine as engine_config
    from pagedq.engine.config.engine import EngineConfig

    monkeypatch.setattr(engine_config, "DEFAULT_ASYNC_SCHEDULING", None)  # as outside the tests
    assert EngineConfig(model=str(tiny_llama_dir), device="cpu").async_scheduling is True
    monkeypatch.setitem(engine_config.ASYNC_SCHEDULING_BY_DEVICE, "cpu", False)
    assert EngineConfig(model=str(tiny_llama_dir), device="cpu").async_scheduling is False
    assert EngineConfig(model=str(tiny_llama_dir), device="cpu", async_scheduling=True).async_scheduling is True
    assert engine_config.ASYNC_SCHEDULING_BY_DEVICE["cuda"] is True


def test_logits_only_for_the_rows_that_sample(tiny_llama_dir, monkeypatch):
    """The LM head sees one row per draw: none for a prefill chunk that does not finish its prompt, one per beam,
    and the prompt-logprob rows only for the request that asked."""
    from pagedq.engine import SamplingParams
    from pagedq.engine.beam_search import BeamSearchParams

    llm = LLM(tiny_llama_dir, max_num_batched_tokens=16, block_size=16)
    model = llm.llm_engine.model_runner.model
    rows: list[int] = []
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden: (rows.append(hidden.shape[0]), real(hidden))[1])
    prompts = [[5 + i % 50 for i in range(n)] for n in (40, 50, 5)]  # the first two take several chunks
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert sum(rows) == sum(len(o.outputs[0].token_ids) for o in outputs) == 18
    rows.clear()
    llm.generate([prompts[2]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1))
    assert sum(rows) == 3 + len(prompts[2]) - 1  # the draws, then one row per prompt position but the last
    rows.clear()
    beams = llm.beam_search([prompts[2]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert beams and max(rows) <= 2  # one row per live beam at most
