"""stream: true through the openai SDK: chunks add up to LLM.generate's output, include_usage, [DONE];
a client that goes away cancels its job and the worker's engine gets its KV blocks back; a gateway killed
mid-stream loses nothing (the job finishes and its record is read under its id)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedq.engine import LLM, LLMEngine, SamplingParams
from pagedq.worker import Client

from .conftest import AS_IDS, gateway_thread, llm_tokens, start_gateway_process, wait_for, wait_live, worker_thread

PROMPT = "The quick brown fox"


def test_streamed_completion_and_chat_add_up_to_llm_generate(redis_url, chat_llama_dir):
    messages = [{"role": "user", "content": "Redis streams?"}]
    llm = LLM(str(chat_llama_dir), device="cpu", num_kv_blocks=64)
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))[0]
    engine = LLMEngine(str(chat_llama_dir), device="cpu", num_kv_blocks=64)
    with worker_thread(engine, redis_url), gateway_thread(redis_url) as base:
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="unused")
        model = sdk.models.list().data[0].id
        chunks = list(
            sdk.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        with_logprobs = list(
            sdk.completions.create(
                model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True, logprobs=1, extra_body=AS_IDS
            )
        )
        chat_chunks = list(
            sdk.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, stream=True)
        )
        chat_whole = sdk.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        with httpx.stream(
            "POST", base + "/completions", json=dict(model=model, prompt=PROMPT, max_tokens=3, stream=True)
        ) as raw:
            lines = [line for line in raw.iter_lines() if line]
    out = ref.outputs[0]
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == out.text
    assert len(text_chunks) > 2  # streamed piece by piece, not in one
    assert text_chunks[-1].choices[0].finish_reason == out.finish_reason
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(out.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    streamed_tokens = [t for c in with_logprobs if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert llm_tokens(streamed_tokens) == out.token_ids
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_whole.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == chat_whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chat_chunks)
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_client_disconnect_cancels_the_job_and_frees_its_kv_blocks(redis_url, tiny_llama_dir):
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    total = engine.num_total_blocks
    with worker_thread(engine, redis_url), gateway_thread(redis_url) as base:
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="unused")
        model = sdk.models.list().data[0].id
        stream = sdk.completions.create(
            model=model, prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        first = [next(iter(stream)) for _ in range(3)]
        used_while_streaming = total - engine.num_free_blocks
        stream.close()
        job_id = first[0].id.removeprefix("cmpl-")
        record = Client(redis_url).result(job_id, timeout=30)
        wait_for(lambda: engine.num_free_blocks == total, timeout=10, what="KV blocks back in the pool")
    assert used_while_streaming > 0
    assert record.status == "cancelled" and len(record.token_ids) < 400


@pytest.mark.slow
def test_gateway_killed_mid_stream_loses_nothing(redis_url, tiny_llama_dir, tmp_path):
    ref = (
        LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
        .generate(PROMPT, SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))[0]
        .outputs[0]
    )
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    with worker_thread(engine, redis_url):
        proc, base = start_gateway_process(redis_url, tmp_path / "gateway.log")
        try:
            wait_live(base)
            sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            model = sdk.models.list().data[0].id
            stream = sdk.completions.create(
                model=model, prompt=PROMPT, max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
            first = next(iter(stream))
            proc.kill()
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
        record = Client(redis_url).result(first.id.removeprefix("cmpl-"), timeout=60)
    assert record.status == "completed"
    assert record.token_ids == ref.token_ids and record.text == ref.text


def test_a_non_streamed_client_that_gives_up_cancels_its_job(redis_url, tiny_llama_dir):
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    total = engine.num_total_blocks
    with worker_thread(engine, redis_url), gateway_thread(redis_url) as base:
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=0.5)
        model = sdk.models.list().data[0].id
        with pytest.raises(openai.APITimeoutError):  # the client stops waiting and closes its connection
            sdk.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=480,
                temperature=0,
                extra_body={"ignore_eos": True},
                user="gives-up",
            )
        client = Client(redis_url)
        record = wait_for(
            lambda: next(
                (
                    json.loads(f[b"data"])
                    for _, f in client.r.xrange(client.keys.completions)
                    if json.loads(f[b"data"])["metadata"] == {"user": "gives-up"}
                ),
                None,
            ),
            timeout=30,
            what="the job's final record",
        )
        wait_for(lambda: engine.num_free_blocks == total, timeout=10, what="KV blocks back in the pool")
    assert record["status"] == "cancelled" and len(record["token_ids"]) < 480
