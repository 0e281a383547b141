"""The completions API as evaluation harnesses, RAG and batch frameworks use it (issue 20), through the openai SDK
and plain HTTP against Redis and one worker on SmolLM2: echo with prompt logprobs, max_tokens 0, token strings and
text_offset, prompt arrays (plain, streamed, cancelled, counted by backpressure), logit_bias, best_of and the stop
string on the last allowed token. Oracles: LLM.generate on the same model, transformers' own log-softmax, and the
same requests sent one prompt at a time."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
from redis import Redis
from transformers import AutoModelForCausalLM

from pagedq.engine import LLM, SamplingParams
from pagedq.worker.protocol.job import FinalRecord
from pagedq.worker.protocol.keys import DATA_FIELD, QueueKeys

from .conftest import AS_IDS, gateway_thread, served_model, wait_for

PROMPT = "The capital of France is"
PROMPTS = [PROMPT, "Paged attention stores the", "Redis streams carry jobs to"]
pytestmark = pytest.mark.slow  # SmolLM2

QUESTION = "Question: 34 + 30 = ?\nAnswer:"  # SmolLM2 answers " 34 + 30 = 64\n": 12 tokens, "\n" the 12th


@pytest.fixture(scope="module")
def served(demo_model_dir):
    """One Redis, one worker on SmolLM2 and one gateway for the module."""
    with served_model(demo_model_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(str(demo_model_dir), num_kv_blocks=256)


def _offsets(tokens: list[str], start: int = 0) -> list[int]:
    offsets = []
    for token in tokens:
        offsets.append(start)
        start += len(token)
    return offsets


def test_echo_with_logprobs_equals_the_engines_prompt_logprobs(served, llm):
    k = 2
    response = served.sdk.completions.create(
        model=served.model, prompt=PROMPT, echo=True, logprobs=k, max_tokens=1, temperature=0
    )
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, logprobs=k))[0]
    tokenizer = llm.get_tokenizer()
    ids = ref.prompt_token_ids + ref.outputs[0].token_ids
    entries = ref.prompt_logprobs + ref.outputs[0].logprobs
    choice = response.choices[0]
    assert choice.text == PROMPT + ref.outputs[0].text
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([i]) for i in ids] and "".join(lp.tokens) == choice.text
    assert lp.text_offset == _offsets(lp.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(entries[j][ids[j]], abs=1e-5)
        want = {tokenizer.decode([t]): v for t, v in entries[j].items()}
        assert lp.top_logprobs[j] == pytest.approx(want, abs=1e-5)
        assert next(iter(lp.top_logprobs[j])) == lp.tokens[j]  # the token itself first, as vLLM
    assert response.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_scoring_a_continuation_with_max_tokens_0_equals_transformers(served, llm, demo_model_dir):
    """What evaluation harnesses send: the context and one answer choice, echo, logprobs 0, max_tokens 0."""
    context, continuation = "Question: what is the capital of France?\nAnswer:", " Paris"
    body = dict(model=served.model, prompt=context + continuation, echo=True, logprobs=0, max_tokens=0)
    reply = httpx.post(served.base + "/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] == context + continuation  # the prompt only: the sampled token is not shown
    logprobs = choice["logprobs"]
    first = sum(offset < len(context) for offset in logprobs["text_offset"])  # the continuation's first token
    got = sum(logprobs["token_logprobs"][first:])
    ids = llm.get_tokenizer().encode(context + continuation)
    assert len(logprobs["tokens"]) == len(ids) and "".join(logprobs["tokens"]) == choice["text"]
    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    want = sum(reference[j - 1, ids[j]].item() for j in range(first, len(ids)))
    assert got == pytest.approx(want, abs=1e-4)
    assert first < len(ids)


def test_token_strings_join_to_the_text_and_token_ids_on_request(served, llm):
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, logprobs=2))[0].outputs[0]
    named = served.sdk.completions.create(model=served.model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2)
    as_ids = served.sdk.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2, extra_body=AS_IDS
    )
    lp = named.choices[0].logprobs
    assert "".join(lp.tokens) == named.choices[0].text == ref.text
    assert lp.text_offset == _offsets(lp.tokens)
    assert as_ids.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ref.token_ids]
    assert all(
        set(top) == {llm.get_tokenizer().decode([t]) for t in e} for top, e in zip(lp.top_logprobs, ref.logprobs)
    )
    chat = served.sdk.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 2 for t in content)
    streamed = list(
        served.sdk.completions.create(
            model=served.model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2, stream=True
        )
    )
    pieces = [c.choices[0] for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.logprobs.tokens] == lp.tokens
    assert [o for p in pieces for o in p.logprobs.text_offset] == lp.text_offset  # offsets run across chunks


def _texts(response) -> list[tuple[int, str, str]]:
    return [(c.index, c.text, c.finish_reason) for c in response.choices]


def _streamed(chunks) -> tuple[list[tuple[int, str, str]], list[int]]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    order = []
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            order.append(c.index)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return [(i, texts[i], finish[i]) for i in sorted(texts)], order


def test_prompt_arrays_equal_separate_requests_plain_and_streamed(served, llm):
    sdk, model = served.sdk, served.model
    sampled = dict(max_tokens=8, temperature=0.8, seed=5, n=2)
    one_by_one = [sdk.completions.create(model=model, prompt=p, **sampled) for p in PROMPTS]
    together = sdk.completions.create(model=model, prompt=PROMPTS, **sampled)
    want = [(i * 2 + c.index, c.text, c.finish_reason) for i, r in enumerate(one_by_one) for c in r.choices]
    assert _texts(together) == want  # choice prompt_index * n + sample_index
    assert together.usage.completion_tokens == sum(r.usage.completion_tokens for r in one_by_one)
    streamed, order = _streamed(sdk.completions.create(model=model, prompt=PROMPTS, stream=True, **sampled))
    assert streamed == want
    assert order.index(2) < len(order) - 1 - order[::-1].index(0)  # prompt 1 streamed before prompt 0 ended
    single = sdk.completions.create(model=model, prompt=[PROMPT], **sampled)
    assert _texts(single) == _texts(one_by_one[0])

    tokenizer = llm.get_tokenizer()
    many = [tokenizer.encode(f"Item {i}: the number {i * 7} is") for i in range(40)]
    greedy = dict(max_tokens=5, temperature=0)

    async def separately():
        async with openai.AsyncOpenAI(base_url=served.base, api_key="unused") as client:
            return await asyncio.gather(*[client.completions.create(model=model, prompt=p, **greedy) for p in many])

    alone = [(i, r.choices[0].text, r.choices[0].finish_reason) for i, r in enumerate(asyncio.run(separately()))]
    assert _texts(sdk.completions.create(model=model, prompt=many, **greedy)) == alone
    assert _streamed(sdk.completions.create(model=model, prompt=many, stream=True, **greedy))[0] == alone


def test_echo_of_a_prompt_array_streamed_brings_each_prompt_first(served):
    sdk, model = served.sdk, served.model
    whole = sdk.completions.create(model=model, prompt=PROMPTS, echo=True, max_tokens=4, temperature=0, logprobs=1)
    chunks = list(
        sdk.completions.create(model=model, prompt=PROMPTS, echo=True, max_tokens=4, temperature=0, stream=True)
    )
    firsts = {}
    for chunk in chunks:
        for c in chunk.choices:
            firsts.setdefault(c.index, c.text)
    assert [firsts[i].startswith(p) for i, p in enumerate(PROMPTS)] == [True] * 3
    assert _streamed(chunks)[0] == [(c.index, c.text, c.finish_reason) for c in whole.choices]
    assert all(c.text.startswith(p) for c, p in zip(whole.choices, PROMPTS))
    assert all(c.logprobs.token_logprobs[0] is None and "".join(c.logprobs.tokens) == c.text for c in whole.choices)


def test_logit_bias_forces_and_bans_a_token(served, llm):
    sdk, model = served.sdk, served.model
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    forced = tokenizer.encode(" banana")[0]
    up = sdk.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logit_bias={str(forced): 100},
        extra_body=AS_IDS,
        logprobs=0,
    )
    assert up.choices[0].logprobs.tokens == [f"token_id:{forced}"] * 6
    banned = greedy.token_ids[0]
    down = sdk.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logit_bias={str(banned): -100},
        extra_body=AS_IDS,
        logprobs=0,
    )
    ids = [int(t.split(":")[1]) for t in down.choices[0].logprobs.tokens]
    assert banned not in ids
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, logit_bias={banned: -100.0}))[0]
    assert ids == ref.outputs[0].token_ids


def test_best_of_returns_the_most_likely_sample(served, llm):
    params = dict(max_tokens=8, temperature=1.0, seed=3)
    got = served.sdk.completions.create(model=served.model, prompt=PROMPT, best_of=4, n=2, **params)
    ref = llm.generate(PROMPT, SamplingParams(best_of=4, n=2, **params))[0]
    assert [c.text for c in got.choices] == [o.text for o in ref.outputs]


def test_a_stop_string_on_the_last_allowed_token_is_cut_plain_and_streamed(served):
    sdk, model = served.sdk, served.model
    plain = sdk.completions.create(model=model, prompt=QUESTION, max_tokens=12, temperature=0, stop=["\n"])
    assert (plain.choices[0].text, plain.choices[0].finish_reason) == (" 34 + 30 = 64", "stop")
    chunks = list(
        sdk.completions.create(
            model=model,
            prompt=QUESTION,
            max_tokens=12,
            temperature=0,
            stop=["\n"],
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # vLLM's: accepted
            user="harness-1",
        )
    )
    assert _streamed(chunks)[0] == [(0, " 34 + 30 = 64", "stop")]
    assert chunks[-1].usage.completion_tokens == 12


def test_a_client_that_leaves_a_prompt_array_cancels_every_job(served):
    keys, redis = QueueKeys(), Redis.from_url(served.url)
    long = dict(model=served.model, prompt=PROMPTS, max_tokens=400, temperature=0, extra_body={"ignore_eos": True})

    def cancelled_after(before: int) -> list[str]:
        wait_for(lambda: redis.xlen(keys.completions) >= before + 3, timeout=30, what="three final records")
        entries = redis.xrange(keys.completions)[before:]
        return [FinalRecord.model_validate_json(fields[DATA_FIELD.encode()]).status for _, fields in entries]

    before = redis.xlen(keys.completions)
    stream = served.sdk.completions.create(stream=True, **long)
    next(iter(stream))
    stream.close()
    assert cancelled_after(before) == ["cancelled"] * 3
    before = redis.xlen(keys.completions)
    impatient = openai.OpenAI(base_url=served.base, api_key="unused", max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):  # a non-streamed request whose client stops waiting
        impatient.completions.create(**long)
    assert cancelled_after(before) == ["cancelled"] * 3
    wait_for(lambda: not served.engine.has_unfinished_requests(), timeout=10, what="the engine emptied")


def test_backpressure_counts_every_prompt_and_the_prompt_cap_is_a_400(served):
    with gateway_thread(served.url, max_queue_depth=2, max_prompts=3) as base:
        sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            sdk.completions.create(model=served.model, prompt=PROMPTS, max_tokens=2)
        with pytest.raises(openai.BadRequestError) as too_many:
            sdk.completions.create(model=served.model, prompt=[*PROMPTS, "four"], max_tokens=2)
        assert "4 prompts" in too_many.value.body["message"]
        assert sdk.completions.create(model=served.model, prompt=PROMPTS[:2], max_tokens=2).choices[1].index == 1
    reply = httpx.post(served.base + "/completions", json=dict(model=served.model, prompt=["x"] * 257), timeout=30)
    assert reply.status_code == 400 and "256" in json.loads(reply.text)["error"]["message"]


def test_tokenize_and_detokenize_in_vllms_shape(served, llm):
    root, tokenizer = served.base.removesuffix("/v1"), llm.get_tokenizer()
    ids = tokenizer.encode(PROMPT)
    got = httpx.post(root + "/tokenize", json=dict(model=served.model, prompt=PROMPT, return_token_strs=True)).json()
    assert got == {
        "count": len(ids),
        "max_model_len": llm.llm_engine.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = httpx.post(root + "/tokenize", json=dict(model=served.model, messages=messages)).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    answered = served.sdk.chat.completions.create(model=served.model, messages=messages, max_tokens=1)
    assert answered.usage.prompt_tokens == chat["count"]  # what the worker fed the engine
    back = httpx.post(root + "/detokenize", json=dict(model=served.model, tokens=ids))
    assert back.json() == {"prompt": PROMPT}
    bad = httpx.post(root + "/detokenize", json=dict(model=served.model, tokens=[10**9]))
    both = httpx.post(root + "/tokenize", json=dict(model=served.model))
    assert (bad.status_code, both.status_code) == (400, 400)
