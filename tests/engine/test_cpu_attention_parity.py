"""The CPU attention path (kernels.cpu_attention, the CPU default) end to end: greedy parity with transformers on
decode, chunked prefill and mixed steps, with and without the prefix cache, and the same log-probabilities as the
reference kernels (the oracle, PAGEDQ_KERNELS=reference) on the same traffic."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedq.engine import LLM, SamplingParams
from tests.conftest import VOCAB_SIZE
from tests.engine.parity import assert_greedy_parity, hf_greedy

NEW_TOKENS = 20


def _shared_prefix_prompts() -> list[list[int]]:
    """A 37-token shared prefix (two full 16-token blocks to reuse), then tails of 1..30 tokens."""
    rng = random.Random(3)
    prefix = [rng.randrange(3, VOCAB_SIZE) for _ in range(37)]
    return [prefix + [rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (1, 9, 16, 30)]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_cpu_path_matches_transformers_with_and_without_prefix_cache(tiny_llama_dir, monkeypatch, prefix_caching):
    monkeypatch.delenv("PAGEDQ_KERNELS", raising=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    # A 24-token budget chunks every prompt and mixes prefill chunks with the running requests' decodes.
    llm = LLM(tiny_llama_dir, block_size=16, max_num_batched_tokens=24, enable_prefix_caching=prefix_caching)
    assert llm.llm_engine.model_runner.kernels.backend == "cpu"
    prompts = _shared_prefix_prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:1], params)  # then the rest: their prefix blocks are cached by now
    outputs = first + llm.generate(prompts[1:], params)
    hit_rate = llm.stats()["prefix_cache_hit_rate"]
    assert hit_rate > 0 if prefix_caching else hit_rate == 0
    ties = 0
    for prompt, output in zip(prompts, outputs):
        expected, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        ties += assert_greedy_parity(output.outputs[0].token_ids, expected, logits)
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"


def _logprob_run(folder, backend: str, monkeypatch) -> list:
    monkeypatch.setenv("PAGEDQ_KERNELS", backend)
    llm = LLM(folder, block_size=16, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    return llm.generate(_shared_prefix_prompts(), params)


def test_cpu_path_logprobs_equal_the_reference_kernels(tiny_llama_dir, monkeypatch):
    fast = _logprob_run(tiny_llama_dir, "cpu", monkeypatch)
    oracle = _logprob_run(tiny_llama_dir, "reference", monkeypatch)
    for ours, theirs in zip(fast, oracle):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].logprobs and ours.prompt_logprobs and theirs.outputs[0].logprobs
        pairs = [*zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs)]
        pairs += zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:] or [])
        for got, want in pairs:
            assert got is not None and want is not None and got.keys() == want.keys()
            for token, value in want.items():
                assert abs(got[token] - value) < 1e-4
