"""The Batch API through the openai SDK: upload, create, poll, download. Output lines are OpenAI's, their
bodies equal LLM.generate's greedy outputs; bad lines land in the error file; batch jobs run at the batch
priority; a cancelled batch stops and keeps what finished."""

from __future__ import annotations

import json
import time

import openai
import pytest

from pagedq.engine import LLM, LLMEngine, SamplingParams
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.testing.stub_engine import StubEngine

from .conftest import gateway_thread, wait_for, worker_thread

PROMPTS = {"a": "The quick brown fox", "b": "Paged attention stores", "c": "Redis streams carry"}


def _line(custom_id: str, prompt: str, **body) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "any", "prompt": prompt, "max_tokens": 6, "temperature": 0, **body},
        }
    )


def test_batch_round_trip_with_bad_lines(redis_url, tiny_llama_dir):
    good = [_line(cid, p) for cid, p in PROMPTS.items()]
    bad = [
        '{"custom_id": "broken", ',
        _line("d", "x", bogus=1),
        _line("a", "duplicate"),
        _line("e", "x", temperature=-3),
    ]
    content = "\n".join(good[:2] + bad[:2] + good[2:] + bad[2:]) + "\n"
    ref = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64).generate(
        list(PROMPTS.values()), SamplingParams(max_tokens=6, temperature=0.0)
    )
    r = None
    with gateway_thread(redis_url) as base:
        sdk = openai.OpenAI(base_url=base, api_key="x")
        upload = sdk.files.create(file=("requests.jsonl", content.encode()), purpose="batch")
        batch = sdk.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h", metadata={"run": "t"}
        )
        from redis import Redis

        r = Redis.from_url(redis_url)
        queued = wait_for(lambda: r.xrange(QueueKeys().jobs_of("bulk")), what="batch jobs enqueued")  # no worker yet
        engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
        with worker_thread(engine, redis_url, model=str(tiny_llama_dir)):
            done = wait_for(
                lambda: (b := sdk.batches.retrieve(batch.id)).status == "completed" and b,
                timeout=60,
                interval=0.1,
                what="batch completed",
            )
        output = [json.loads(x) for x in sdk.files.content(done.output_file_id).text.splitlines()]
        errors = [json.loads(x) for x in sdk.files.content(done.error_file_id).text.splitlines()]
    assert upload.purpose == "batch" and upload.bytes == len(content.encode())
    assert batch.status in ("validating", "in_progress") and done.metadata == {"run": "t"}
    assert {json.loads(f[b"job"])["priority"] for _, f in queued} == {-100}
    assert done.request_counts.total == 7 and done.request_counts.completed == 3
    assert done.request_counts.failed == 4
    by_id = {line["custom_id"]: line for line in output}
    for (cid, _), want in zip(PROMPTS.items(), ref):
        line = by_id[cid]
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert set(line["response"]) == {"status_code", "request_id", "body"}
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == tiny_llama_dir.name
        assert body["choices"][0]["text"] == want.outputs[0].text
        assert body["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)
    codes = sorted(e["error"]["code"] for e in errors)
    assert codes == ["duplicate_custom_id", "invalid_json", "invalid_request", "invalid_request"]
    assert all(set(e) == {"id", "custom_id", "response", "error"} for e in errors)
    ids = [e["id"] for e in errors]  # line-level rows too: named after their line, never null
    assert all(isinstance(i, str) and i.startswith("batch_req_") for i in ids) and len(set(ids)) == len(ids)


def test_cancel_a_batch_keeps_what_finished(redis_url):
    content = "\n".join(_line(f"r{i}", "slow", max_tokens=400) for i in range(6)) + "\n"
    with (
        worker_thread(StubEngine(step_delay_s=0.02, max_num_seqs=1), redis_url, model="stub", max_waiting=1),
        gateway_thread(redis_url, batch_window=2) as base,
    ):
        sdk = openai.OpenAI(base_url=base, api_key="x")
        upload = sdk.files.create(file=("slow.jsonl", content.encode()), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        time.sleep(0.5)
        cancelling = sdk.batches.cancel(batch.id)
        done = wait_for(
            lambda: (b := sdk.batches.retrieve(batch.id)).status == "cancelled" and b,
            timeout=30,
            what="batch cancelled",
        )
        errors = [json.loads(x) for x in sdk.files.content(done.error_file_id).text.splitlines()]
        depth = QueueKeys().jobs_of("bulk")
        from redis import Redis

        left = Redis.from_url(redis_url).xlen(depth)
    assert cancelling.status in ("cancelling", "cancelled")
    assert done.request_counts.completed + done.request_counts.failed < 6  # the rest never ran
    assert all(e["error"]["code"] == "cancelled" for e in errors) and errors
    assert left == 0


def test_a_batch_whose_gateway_went_away_is_finished_by_another(redis_url, tiny_llama_dir):
    content = "\n".join(_line(cid, p) for cid, p in PROMPTS.items()) + "\n"
    from redis import Redis

    r = Redis.from_url(redis_url)
    with gateway_thread(redis_url) as first:
        sdk = openai.OpenAI(base_url=first, api_key="x")
        upload = sdk.files.create(file=("requests.jsonl", content.encode()), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        wait_for(lambda: r.xlen(QueueKeys().jobs_of("bulk")) == 3, what="batch jobs enqueued")  # no worker yet
    # the stopped gateway gives its lease up as its batch task is cancelled (the lifespan's shutdown), which on
    # a loaded machine can finish a moment after the server thread is joined
    wait_for(lambda: not r.exists(QueueKeys().batch_runner(batch.id)), timeout=20, what="the batch lease released")
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    with worker_thread(engine, redis_url, model=str(tiny_llama_dir)), gateway_thread(redis_url) as second:
        sdk = openai.OpenAI(base_url=second, api_key="x")
        done = wait_for(
            lambda: (b := sdk.batches.retrieve(batch.id)).status == "completed" and b,
            timeout=60,
            interval=0.1,
            what="batch completed by the second gateway",
        )
        output = [json.loads(x) for x in sdk.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(PROMPTS)  # each once
    assert r.xlen(QueueKeys().completions) == 3  # no job enqueued (or run) twice


def test_a_batch_of_a_file_that_is_not_text_fails_with_the_reason(redis_url):
    with gateway_thread(redis_url) as base:
        sdk = openai.OpenAI(base_url=base, api_key="x")
        upload = sdk.files.create(file=("bin.jsonl", b"\xff\xfe\x00 not utf-8\n"), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        failed = wait_for(lambda: (b := sdk.batches.retrieve(batch.id)).status == "failed" and b, what="failed")
        with pytest.raises(openai.BadRequestError) as wrong_purpose:
            sdk.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert failed.errors.data[0].code == "invalid_file" and "UTF-8" in failed.errors.data[0].message
    assert wrong_purpose.value.body["param"] == "purpose"
