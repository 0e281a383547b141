"""LoRA adapters against transformers + PEFT's PeftModel (fp32, CPU): greedy tokens exact, logprobs within 1e-4; a
batch mixing adapters and the base model equals each request run alone, under chunked prefill and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from pagedq.engine import LLM, LoRARequest, SamplingParams
from pagedq.engine.runner import model_runner
from pagedq.kernels.lora import LoRAIndex
from tests.conftest import VOCAB_SIZE
from tests.engine.lora_adapters import ALL, ATTENTION, MLP, peft_model, write_adapter
from tests.engine.parity import assert_greedy_parity, hf_greedy

NEW_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4


def _prompts(seed: int, lengths=(5, 17, 33)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in lengths]


# (architecture, targets, rank, alpha, rsLoRA): attention only, MLP only, all seven; ranks below, at and (qwen2,
# with q/k/v biases) between; rsLoRA's alpha / sqrt(r)
CASES = [
    ("llama", ATTENTION, 4, 8.0, False),
    ("llama", MLP, 16, 32.0, True),
    ("llama", ALL, 8, 16.0, False),
    ("qwen2", ALL, 6, 12.0, True),
    ("qwen3", ("q_proj", "v_proj", "down_proj"), 8, 8.0, False),
]


@pytest.mark.parametrize("architecture,targets,rank,alpha,rslora", CASES, ids=lambda c: str(c))
def test_greedy_tokens_and_prompt_logprobs_match_peft(
    checkpoint_factory, tmp_path, architecture, targets, rank, alpha, rslora
):
    checkpoint = checkpoint_factory(architecture)
    adapter = write_adapter(checkpoint, tmp_path / "adapter", targets, rank, alpha, rslora, seed=rank)
    oracle = peft_model(checkpoint, adapter)
    prompts = _prompts(seed=rank)
    llm = LLM(checkpoint, enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=32)
    lora = LoRARequest("tuned", str(adapter))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, lora_request=lora)

    ties = 0
    for prompt, output in zip(prompts, outputs):
        expected, logits = hf_greedy(oracle, prompt, NEW_TOKENS)
        ties += assert_greedy_parity(output.outputs[0].token_ids, expected, logits)
        with torch.no_grad():
            prompt_logits = oracle(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        for position in range(1, len(prompt)):
            ours = output.prompt_logprobs[position][prompt[position]]
            theirs = float(prompt_logits[position - 1, prompt[position]])
            assert abs(ours - theirs) < LOGPROB_TOLERANCE, (position, ours, theirs)
        for step, (token, entry) in enumerate(zip(output.outputs[0].token_ids, output.outputs[0].logprobs)):
            theirs = float(logits[step].float().log_softmax(-1)[token])
            assert abs(entry[token] - theirs) < LOGPROB_TOLERANCE
    assert ties == 0
    # the adapter changed what the model says: the base model's greedy tokens differ
    with oracle.disable_adapter():
        base_tokens = [hf_greedy(oracle, p, NEW_TOKENS)[0] for p in prompts]
    assert base_tokens != [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def four_adapters(checkpoint_factory, tmp_path_factory):
    checkpoint = checkpoint_factory("llama")
    folder = tmp_path_factory.mktemp("adapters")
    shapes = [(ALL, 8, False), (ATTENTION, 4, True), (MLP, 16, False), (("q_proj", "down_proj"), 2, False)]
    adapters = [
        LoRARequest(f"a{i}", str(write_adapter(checkpoint, folder / f"a{i}", t, r, 2.0 * r, rs, seed=10 + i)))
        for i, (t, r, rs) in enumerate(shapes)
    ]
    return checkpoint, adapters


def _record_step_slots(monkeypatch) -> list[set[int]]:
    """The set of slots (-1: base model) of each step's tokens, as the runner indexes them."""
    seen: list[set[int]] = []
    build = LoRAIndex.build

    def recording(token_slots, num_slots, device=None):
        seen.append(set(token_slots.tolist()))
        return build(token_slots, num_slots, device)

    monkeypatch.setattr(model_runner.LoRAIndex, "build", recording)
    return seen


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_batch_mixing_four_adapters_and_the_base_model_equals_each_alone(
    four_adapters, async_scheduling, monkeypatch
):
    checkpoint, adapters = four_adapters
    prompts = _prompts(seed=3, lengths=(5, 17, 33, 9, 21, 14, 40, 3, 26, 12))
    loras = [None if i % 5 == 4 else adapters[i % 5] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)

    alone_llm = LLM(checkpoint, enable_lora=True, max_loras=1, num_kv_blocks=64, async_scheduling=async_scheduling)
    alone = [alone_llm.generate([p], params, lora_request=lora)[0] for p, lora in zip(prompts, loras)]
    # one step holds all four adapters and base-model tokens; 10 blocks of 16 cannot hold ten requests of up to
    # 52 tokens: preemption; 24 tokens a step: prompts in chunks next to decodes
    mixed_llm = LLM(
        checkpoint,
        enable_lora=True,
        max_loras=4,
        num_kv_blocks=10,
        max_num_batched_tokens=24,
        async_scheduling=async_scheduling,
    )
    step_slots = _record_step_slots(monkeypatch)
    mixed = mixed_llm.generate(prompts, params, lora_request=loras)
    assert mixed_llm.stats()["num_preemptions"] > 0
    assert {-1, 0, 1, 2, 3} in step_slots  # a step held all four adapters and base-model tokens
    for a, b in zip(alone, mixed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < LOGPROB_TOLERANCE for t in x)
    # and the adapters differ from each other and from the base model on the same prompt
    same = [alone_llm.generate([prompts[0]], params, lora_request=lora)[0].outputs[0].token_ids for lora in loras[:5]]
    assert len({tuple(t) for t in same}) == 5


def test_swap_preemption_with_adapters_equals_roomy(four_adapters):
    checkpoint, adapters = four_adapters
    prompts = _prompts(seed=5, lengths=(30, 18, 25, 9, 33, 12))
    loras = [adapters[i % 4] if i % 3 else None for i in range(len(prompts))]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    roomy_llm = LLM(checkpoint, enable_lora=True, max_loras=4, num_kv_blocks=64)
    roomy = roomy_llm.generate(prompts, params, lora_request=loras)
    tight_llm = LLM(checkpoint, enable_lora=True, max_loras=4, num_kv_blocks=8, preemption_mode="swap")
    tight = tight_llm.generate(prompts, params, lora_request=loras)
    assert tight_llm.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
