"""POST /v1/completions and /v1/chat/completions through the official openai SDK (sync and async) against
`pagedq serve` + Redis + a worker on a tiny checkpoint. Oracle: the engine's own LLM.generate on the same
checkpoint with the same SamplingParams (greedy, and seeded sampling with the extras)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from transformers import AutoTokenizer

from pagedq.engine import LLM, LLMEngine, SamplingParams

from ..conftest import random_tokens
from .conftest import AS_IDS, gateway_thread, llm_tokens, wait_live, worker_thread

PROMPT = "The quick brown fox"


def test_completions_greedy_token_identical_to_llm_generate(redis_url, tiny_llama_dir):
    ids_prompt = random_tokens(20, seed=3)
    expected = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64).generate(
        [PROMPT, ids_prompt], SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)
    )
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    with worker_thread(engine, redis_url), gateway_thread(redis_url) as base:
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="unused")
        model = sdk.models.list().data[0].id
        got = [
            sdk.completions.create(model=model, prompt=p, max_tokens=12, temperature=0, logprobs=1, extra_body=AS_IDS)
            for p in (PROMPT, ids_prompt)
        ]
        wrapped = [
            sdk.completions.create(model=model, prompt=[p], max_tokens=12, temperature=0, logprobs=1, extra_body=AS_IDS)
            for p in (PROMPT, ids_prompt)
        ]  # OpenAI's list-of-one-prompt forms
    assert [w.choices[0].logprobs.tokens for w in wrapped] == [g.choices[0].logprobs.tokens for g in got]
    for response, want in zip(got, expected):
        choice, ref = response.choices[0], want.outputs[0]
        assert llm_tokens(choice.logprobs.tokens) == ref.token_ids
        assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
        assert choice.logprobs.token_logprobs == pytest.approx(
            [d[t] for t, d in zip(ref.token_ids, ref.logprobs)], abs=1e-4
        )
        assert response.usage.prompt_tokens == len(want.prompt_token_ids)
        assert response.usage.completion_tokens == len(ref.token_ids)
        assert response.object == "text_completion" and response.id.startswith("cmpl-")


def test_sampling_fields_and_extras_reach_the_engine(redis_url, tiny_llama_dir):
    """OpenAI's and vLLM's (extra_body) sampling fields reach the engine's SamplingParams: each request equals
    LLM.generate with the same parameters, and differs from what the engine gives without the field tested."""
    llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)

    def engine_tokens(**params) -> list[int]:
        return llm.generate(PROMPT, SamplingParams(**params))[0].outputs[0].token_ids

    greedy = dict(max_tokens=20, temperature=0)
    plain = engine_tokens(**greedy)
    seeded = dict(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, stop=["zz"])
    cases = [
        ({"presence_penalty": 1.5}, {}),
        ({"frequency_penalty": 1.5}, {}),
        ({}, {"repetition_penalty": 1.5}),
        ({}, {"min_tokens": 6, "stop_token_ids": [plain[1]]}),
        ({}, {"stop_token_ids": [plain[1]]}),
    ]
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    with worker_thread(engine, redis_url), gateway_thread(redis_url) as base:
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="unused")
        model = sdk.models.list().data[0].id

        def gateway_tokens(params: dict, extra: dict) -> list[int]:
            response = sdk.completions.create(
                model=model, prompt=PROMPT, logprobs=0, user="u-1", extra_body={**extra, **AS_IDS}, **params
            )
            return llm_tokens(response.choices[0].logprobs.tokens)

        got = [gateway_tokens({**greedy, **openai_fields}, extra) for openai_fields, extra in cases]
        extras = dict(top_k=40, min_p=0.01, ignore_eos=True, priority=3)
        sampled = gateway_tokens(seeded, extras)
    for (openai_fields, extra), tokens in zip(cases, got):
        want = engine_tokens(**greedy, **openai_fields, **extra)
        assert tokens == want, (openai_fields, extra)
        assert tokens != plain, (openai_fields, extra)  # the field made a difference, so it was not dropped
    assert len(got[3]) >= 6 and len(got[4]) == 2  # min_tokens held the stop token back
    assert sampled == engine_tokens(**seeded, top_k=40, min_p=0.01, ignore_eos=True)
    assert sampled != engine_tokens(**seeded, min_p=0.01, ignore_eos=True)  # top_k mattered


def test_chat_sync_and_async_sdk_equal_llm_generate(redis_url, chat_llama_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paged attention?"}]
    tokenizer = AutoTokenizer.from_pretrained(str(chat_llama_dir))
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(rendered, add_special_tokens=False).input_ids
    ref = LLM(str(chat_llama_dir), device="cpu", num_kv_blocks=64).generate(
        [prompt_ids], SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    )[0]
    engine = LLMEngine(str(chat_llama_dir), device="cpu", num_kv_blocks=64)
    with worker_thread(engine, redis_url), gateway_thread(redis_url) as base:
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="unused")
        model = sdk.models.list().data[0].id
        sync = sdk.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body=AS_IDS,
        )

        async def both_async():
            async with openai.AsyncOpenAI(base_url=base, api_key="unused") as client:
                return await asyncio.gather(
                    *[
                        client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
                        for _ in range(3)
                    ]
                )

        many = asyncio.run(both_async())
    out = ref.outputs[0]
    assert sync.object == "chat.completion" and sync.choices[0].message.role == "assistant"
    assert sync.choices[0].message.content == out.text
    assert llm_tokens([t.token for t in sync.choices[0].logprobs.content]) == out.token_ids
    assert all(len(t.top_logprobs) == 2 for t in sync.choices[0].logprobs.content)
    assert sync.usage.prompt_tokens == len(prompt_ids)
    assert [r.choices[0].message.content for r in many] == [out.text] * 3


def test_unknown_and_out_of_range_fields_are_400(redis_url, tiny_llama_dir):
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    with worker_thread(engine, redis_url), gateway_thread(redis_url) as base:
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        model = sdk.models.list().data[0].id
        cases = [
            dict(extra_body={"bogus": 1}),
            dict(temperature=-1),
            dict(extra_body={"top_k": -5}),
            dict(n=100),
            dict(best_of=1, n=2),  # best_of must be at least n
            dict(best_of=3, stream=True),  # best_of > n cannot stream
            dict(suffix="x"),
            dict(max_tokens=0),  # only with echo
            dict(logit_bias={"1": 101}),
            dict(prompt=[]),
            dict(extra_body={"min_tokens": 50}, max_tokens=5),
        ]
        errors = []
        for case in cases:
            kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 4, **case}
            with pytest.raises(openai.BadRequestError) as info:
                sdk.completions.create(**kwargs)
            errors.append(info.value.body)
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                tools=[{"type": "function", "function": {"name": "f"}}],
            )
        errors.append(info.value.body)
        with pytest.raises(openai.NotFoundError) as missing:
            sdk.completions.create(model="no-such-model", prompt=PROMPT)
    for body in errors:
        assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert "bogus" in errors[0]["message"] and "unsupported" in errors[0]["message"]
    assert "min_tokens" in errors[-2]["message"]
    assert "best_of" in errors[4]["message"] and "suffix" in errors[6]["message"]
    assert missing.value.body["code"] == "model_not_found"
