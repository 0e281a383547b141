"""n > 1 through ONE job, served by the engine's own parallel sampling: the samples (non-streamed and
streamed, by index) equal LLM.generate's with the same SamplingParams; old consumers still read sample 0
at the record's top level."""

from __future__ import annotations

import openai

from pagedq.engine import LLM, LLMEngine, SamplingParams
from pagedq.worker import Client
from pagedq.worker.protocol.keys import QueueKeys

from .conftest import AS_IDS, gateway_thread, llm_tokens, wait_for, wait_live, worker_thread

PROMPT = "Redis streams carry jobs"


def test_n3_seeded_samples_equal_the_engines(redis_url, chat_llama_dir):
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=10, logprobs=0)
    ref = LLM(str(chat_llama_dir), device="cpu", num_kv_blocks=64).generate(PROMPT, params)[0].outputs
    assert len({tuple(o.token_ids) for o in ref}) > 1  # the samples differ: the test can tell them apart
    engine = LLMEngine(str(chat_llama_dir), device="cpu", num_kv_blocks=64)
    with worker_thread(engine, redis_url), gateway_thread(redis_url) as base:
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="x")
        model = sdk.models.list().data[0].id
        whole = sdk.completions.create(
            model=model, prompt=PROMPT, n=3, temperature=0.8, seed=11, max_tokens=10, logprobs=0, extra_body=AS_IDS
        )
        chunks = list(
            sdk.completions.create(
                model=model, prompt=PROMPT, n=3, temperature=0.8, seed=11, max_tokens=10, stream=True
            )
        )
        chat = sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], n=3, temperature=0.8, seed=11, max_tokens=6
        )
        job_id = whole.id.removeprefix("cmpl-")
        record = Client(redis_url).final(job_id)
        jobs_enqueued = Client(redis_url).r.xlen(QueueKeys().completions)  # one final record per job
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [llm_tokens(c.logprobs.tokens) for c in whole.choices] == [o.token_ids for o in ref]
    assert [c.text for c in whole.choices] == [o.text for o in ref]
    assert whole.usage.completion_tokens == sum(len(o.token_ids) for o in ref)
    streamed = {
        i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)
    }
    assert streamed == {i: o.text for i, o in enumerate(ref)}
    assert len(chat.choices) == 3 and len({c.message.content for c in chat.choices}) > 1
    assert jobs_enqueued == 3  # one job per request, not one per sample
    assert record.token_ids == ref[0].token_ids and [c.token_ids for c in record.choices] == [o.token_ids for o in ref]


def test_cancelled_n2_stream_frees_the_blocks_and_keeps_both_samples(redis_url, tiny_llama_dir):
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    total = engine.num_total_blocks
    with worker_thread(engine, redis_url), gateway_thread(redis_url) as base:
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="x")
        model = sdk.models.list().data[0].id
        stream = sdk.completions.create(
            model=model,
            prompt=PROMPT,
            n=2,
            temperature=1.0,
            seed=5,
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = {c.choices[0].index for c in (next(iter(stream)) for _ in range(6))}
        job_id = next(iter(stream)).id.removeprefix("cmpl-")
        stream.close()
        record = Client(redis_url).result(job_id, timeout=30)
        wait_for(lambda: engine.num_free_blocks == total, timeout=10, what="KV blocks back in the pool")
    assert seen == {0, 1}
    assert record.status == "cancelled" and [c.index for c in record.choices] == [0, 1]
    assert all(0 < len(c.token_ids) < 400 and c.finish_reason == "abort" for c in record.choices)
    assert record.token_ids == record.choices[0].token_ids
