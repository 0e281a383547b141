"""The chat fields current SDKs and client libraries send (issue 35, item 7): accepted, bounded as OpenAI bounds
them, and ignored where they carry no meaning here; reasoning_effort refused with a 400 naming it (no model here
reasons). The openai SDK and raw HTTP against a stub worker, a gateway and a real Redis."""

from __future__ import annotations

import httpx
import openai
import pytest

from pagedq.worker.testing.stub_engine import StubEngine

from .conftest import CHAT_TEMPLATE, gateway_thread, wait_for, worker_thread

MESSAGES = [{"role": "user", "content": "hi"}]


# What current SDKs and libraries send with a chat request; none of it changes the answer here
CLIENT_FIELDS = {
    "metadata": {"k" * 64: "v" * 512, **{f"key{i}": "value" for i in range(15)}},  # OpenAI's bounds, at the edge
    "store": False,
    "service_tier": "auto",
    "prompt_cache_key": "conversation-42",
    "safety_identifier": "user-hash-0123",
    "user": "someone",
    "verbosity": "low",
}


def test_chat_accepts_the_fields_clients_send_and_refuses_reasoning_effort(redis_url):
    with (
        worker_thread(StubEngine(chat_template=CHAT_TEMPLATE), redis_url, model="stub"),
        gateway_thread(redis_url) as base,
    ):
        sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        wait_for(lambda: sdk.models.list().data, timeout=20, what="a live worker")
        plain = sdk.chat.completions.create(model="stub", messages=MESSAGES, max_tokens=4, seed=1)
        answer = sdk.chat.completions.create(model="stub", messages=MESSAGES, max_tokens=4, seed=1, **CLIENT_FIELDS)
        assert answer.choices[0].message.content == plain.choices[0].message.content
        assert answer.usage.completion_tokens == 4
        store_true = {**CLIENT_FIELDS, "store": True, "service_tier": "flex"}
        sdk.chat.completions.create(model="stub", messages=MESSAGES, max_tokens=2, **store_true)

        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(model="stub", messages=MESSAGES, reasoning_effort="low")
        error = caught.value
        assert error.status_code == 400 and error.param == "reasoning_effort"
        assert "model 'stub' does not reason" in error.message and "leave reasoning_effort out" in error.message
        with pytest.raises(openai.BadRequestError) as caught:  # streamed: the same 400, before any byte
            sdk.chat.completions.create(model="stub", messages=MESSAGES, reasoning_effort="high", stream=True)
        assert caught.value.param == "reasoning_effort"
        unset = {"reasoning_effort": None}  # what a library sends for "not set": accepted
        sdk.chat.completions.create(model="stub", messages=MESSAGES, max_tokens=2, extra_body=unset)

        for field, value in (
            ("metadata", {f"key{i}": "v" for i in range(17)}),
            ("metadata", {"k" * 65: "v"}),
            ("metadata", {"k": "v" * 513}),
            ("metadata", {"k": 1}),
            ("safety_identifier", "s" * 65),
            ("prompt_cache_key", "p" * 1025),
            ("service_tier", "fastest"),
            ("verbosity", "loud"),
            ("store", "yes"),
        ):
            response = httpx.post(
                base + "/chat/completions",
                json={"model": "stub", "messages": MESSAGES, field: value},
                timeout=10,
            )
            assert response.status_code == 400, (field, response.text)
            error_body = response.json()["error"]
            assert error_body["param"].split(".")[0] == field, (field, error_body)
            assert set(error_body) == {"message", "type", "param", "code"}  # OpenAI's shape
