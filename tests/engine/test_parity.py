"""Greedy outputs of LLM.generate equal transformers' generate (fp32, CPU) on every supported architecture."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedq.engine import LLM, SamplingParams
from tests.conftest import ARCHITECTURES, VOCAB_SIZE
from tests.engine.parity import assert_greedy_parity, hf_greedy

NEW_TOKENS = 32
# Lengths straddle block boundaries for block_size 16: 1 short of, exactly at, and 1 past a boundary.
PROMPT_LENGTHS = (5, 15, 16, 17, 33, 47)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_parity_under_chunking_and_preemption(checkpoint_factory, architecture):
    folder = checkpoint_factory(architecture)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = _prompts(seed=len(architecture))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # 12 blocks of 16 slots cannot hold six requests of up to 79 tokens at once: preemption must happen.
    # A 24-token budget splits every prompt longer than that into chunks.
    llm = LLM(folder, block_size=16, num_kv_blocks=12, max_num_batched_tokens=24, max_num_seqs=8)
    outputs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    # each request's own count (what the worker's spans report) adds up to the scheduler's
    assert sum(output.num_preemptions for output in outputs) == llm.stats()["num_preemptions"]
    assert llm.llm_engine.num_free_blocks == 12  # everything returned

    ties = 0
    for prompt, output in zip(prompts, outputs):
        assert output.prompt_token_ids == prompt
        expected, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        ties += assert_greedy_parity(output.outputs[0].token_ids, expected, logits)
        assert output.outputs[0].finish_reason == "length"
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"


def test_pressure_does_not_change_outputs(tiny_llama_dir):
    prompts = _prompts(seed=7)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    roomy = LLM(tiny_llama_dir).generate(prompts, params)
    tight_llm = LLM(tiny_llama_dir, num_kv_blocks=8, max_num_batched_tokens=16, block_size=16)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


def test_block_size_32_and_text_prompts(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    llm = LLM(tiny_llama_dir, block_size=32)
    prompts = ["The quick brown fox", "Redis streams carry jobs to workers and results back"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    tokenizer = llm.get_tokenizer()
    ties = 0
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer.encode(prompt)
        assert output.prompt_token_ids == ids and output.prompt == prompt
        expected, logits = hf_greedy(hf, ids, NEW_TOKENS)
        ties += assert_greedy_parity(output.outputs[0].token_ids, expected, logits)
        assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"
