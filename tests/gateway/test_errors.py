"""Errors in OpenAI's shape through the SDK: 401 (bad bearer token), 429 with Retry-After (full queue),
503 (no live worker), a request's timeout as the job's deadline (504, the job expired); /v1/models from the
live workers' heartbeats. Queue-level behaviour runs on the stub engine (pagedq/worker/testing/stub_engine.py)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from pagedq.worker import Client
from pagedq.worker.testing.stub_engine import StubEngine

from .conftest import gateway_thread, wait_for, wait_live, worker_thread

SHAPE = {"message", "type", "param", "code"}


def test_bad_or_missing_bearer_token_is_401(redis_url):
    with (
        worker_thread(StubEngine(), redis_url, model="stub"),
        gateway_thread(redis_url, api_keys=["key-1", "key-2"]) as base,
    ):
        good = openai.OpenAI(base_url=base, api_key="key-2", max_retries=0)
        wait_for(lambda: good.models.list().data, what="a live worker")
        answer = good.completions.create(model="stub", prompt="hello", max_tokens=3, temperature=0)
        with pytest.raises(openai.AuthenticationError) as bad:
            openai.OpenAI(base_url=base, api_key="key-3", max_retries=0).models.list()
        bare = httpx.post(base + "/completions", json={"model": "stub", "prompt": "x"})
        health = httpx.get(base.removesuffix("/v1") + "/health")
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 3
    assert bad.value.status_code == 401 and set(bad.value.body) == SHAPE
    assert bad.value.body["type"] == "authentication_error" and bad.value.body["code"] == "invalid_api_key"
    assert bare.status_code == 401 and set(bare.json()["error"]) == SHAPE
    assert health.status_code == 200 and health.json()["live_workers"] == 1


def test_full_queue_is_429_with_retry_after(redis_url):
    engine = StubEngine(step_delay_s=0.05)
    with worker_thread(engine, redis_url, model="stub"), gateway_thread(redis_url, max_queue_depth=2) as base:
        wait_live(base)
        client = Client(redis_url)
        held = [client.submit(prompt="long", max_tokens=2000, ignore_eos=True) for _ in range(2)]
        sdk = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as full:
            sdk.completions.create(model="stub", prompt="one more", max_tokens=2)
        depth_after = client.queue_depth()
        for job_id in held:
            client.cancel(job_id)
        wait_for(lambda: client.queue_depth() == 0, what="queue drained")
        ok = sdk.completions.create(model="stub", prompt="now it fits", max_tokens=2)
    assert full.value.status_code == 429 and full.value.response.headers["retry-after"] == "1"
    assert set(full.value.body) == SHAPE and full.value.body["code"] == "queue_full"
    assert depth_after == 2  # nothing was enqueued by the refused request
    assert ok.usage.completion_tokens == 2


def test_no_live_worker_is_503_and_models_follow_heartbeats(redis_url, tiny_llama_dir):
    with gateway_thread(redis_url) as base:
        sdk = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as none:
            sdk.completions.create(model="m", prompt="hello")
        assert sdk.models.list().data == []
        with worker_thread(StubEngine(), redis_url, model=str(tiny_llama_dir)):
            models = wait_for(lambda: sdk.models.list().data, what="a live worker")
            by_path = sdk.completions.create(model=str(tiny_llama_dir), prompt="hello", max_tokens=2)
        with pytest.raises(openai.InternalServerError) as gone:  # the stopped worker removed its heartbeat
            sdk.chat.completions.create(model=models[0].id, messages=[{"role": "user", "content": "hi"}])
        assert Client(redis_url).queue_depth() == 0  # refused requests enqueue nothing
    assert none.value.status_code == 503 == gone.value.status_code
    assert set(none.value.body) == SHAPE and none.value.body["code"] == "no_live_worker"
    assert [m.id for m in models] == [tiny_llama_dir.name] and models[0].owned_by == "pagedq"
    assert by_path.usage.completion_tokens == 2


def test_request_timeout_becomes_the_job_deadline(redis_url):
    engine = StubEngine(step_delay_s=0.02)
    with worker_thread(engine, redis_url, model="stub"), gateway_thread(redis_url) as base:
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as late:
            sdk.completions.create(
                model="stub", prompt="slow", max_tokens=1500, extra_body={"timeout": 0.5, "ignore_eos": True}
            )
        waited = time.monotonic() - start
        quick = sdk.completions.create(model="stub", prompt="quick", max_tokens=3, extra_body={"timeout": 30})
        with pytest.raises(openai.BadRequestError):
            sdk.completions.create(model="stub", prompt="x", extra_body={"timeout": 10**6})
    assert late.value.status_code == 504 and late.value.body["code"] == "expired"
    assert "deadline" in late.value.body["message"]
    assert 0.5 <= waited < 10  # the worker stopped it at the deadline (1500 steps would take 30 s)
    assert quick.usage.completion_tokens == 3
