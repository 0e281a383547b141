"""What client libraries do by default, through the real openai SDK (and raw HTTP where the SDK hides it) against a
real gateway, Redis and a worker on the stub engine (issue 35: 1, 2, 3 and 8):

- chat without max_tokens gets the rest of the model's context (OpenAI's and vLLM's), not completions' 16;
- a prompt over the context is OpenAI's and vLLM's 400 `context_length_exceeded`, their words, the prompt's field;
- a streamed request the worker refuses before any token is the same 400, before the first byte;
- x-request-id on every answer; an expired request is not retried (x-should-retry: false); image parts and a
  temperature above 2 are refused by name.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel
from redis import Redis

from pagedq.worker.testing.stub_engine import StubEngine

from ..worker.helpers import finals_by_id
from .conftest import gateway_thread, served_model, wait_for, worker_thread

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
CONTEXT = 128  # the stub's max_model_len here: one token per character
EOS_AT = 40  # a greedy stub stream ends with EOS at this position


@pytest.fixture
def stack(redis_url):
    engine = StubEngine(chat_template=TEMPLATE, max_model_len=CONTEXT, eos_every=EOS_AT)
    with worker_thread(engine, redis_url, model="stub"), gateway_thread(redis_url) as base:
        sdk = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        wait_for(lambda: sdk.models.list().data, what="a live worker")
        yield SimpleNamespace(base=base, sdk=sdk)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_without_max_tokens_takes_the_rest_of_the_context(stack):
    sdk = stack.sdk
    greedy = sdk.chat.completions.create(model="stub", messages=_user("hi"), temperature=0)
    assert greedy.choices[0].finish_reason == "stop"  # it ended itself, long past 16 tokens
    assert greedy.usage.completion_tokens == EOS_AT - 1
    sampled = sdk.chat.completions.create(model="stub", messages=_user("hi"), temperature=1.0, seed=3)
    assert sampled.choices[0].finish_reason == "length"  # only at the context's end
    prompt_tokens = len("<user>hi")
    assert (sampled.usage.prompt_tokens, sampled.usage.completion_tokens) == (prompt_tokens, CONTEXT - prompt_tokens)
    chunks = list(
        sdk.chat.completions.create(
            model="stub", messages=_user("hi"), temperature=1.0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.completion_tokens == CONTEXT - prompt_tokens
    # completions keep OpenAI's default of 16, and a given max_tokens is kept
    legacy = sdk.completions.create(model="stub", prompt="hi", temperature=1.0)
    assert (legacy.choices[0].finish_reason, legacy.usage.completion_tokens) == ("length", 16)
    capped = sdk.chat.completions.create(model="stub", messages=_user("hi"), temperature=1.0, max_completion_tokens=5)
    assert capped.usage.completion_tokens == 5


def test_an_operator_may_cap_chat_s_default(redis_url):
    engine = StubEngine(chat_template=TEMPLATE, max_model_len=CONTEXT)
    with worker_thread(engine, redis_url, model="stub"), gateway_thread(redis_url, default_chat_max_tokens=7) as base:
        sdk = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        wait_for(lambda: sdk.models.list().data, what="a live worker")
        out = sdk.chat.completions.create(model="stub", messages=_user("hi"), temperature=1.0)
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("length", 7)


def _context_error(exc: openai.BadRequestError, param: str) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    assert exc.status_code == 400 and exc.code == "context_length_exceeded" and body.get("param") == param, exc.body
    assert f"This model's maximum context length is {CONTEXT} tokens." in exc.message
    return str(body["message"])


def test_a_prompt_over_the_context_is_context_length_exceeded(stack):
    sdk = stack.sdk
    # 120 characters pass the gateway's size check (the template's "<user>" is not counted there): the worker refuses
    # the rendered text by its characters (the stub's tokenizer makes one token of each at most)
    words = "x" * 120
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model="stub", messages=_user(words), max_tokens=5, stream=stream)
        message = _context_error(refused.value, "messages")
        assert (
            "you requested at least 131 tokens (at least 126 in the messages, counted from 126 characters, 5 in"
            in message
        )
    # no max_tokens: the rest of the context, which must hold one token at least
    with pytest.raises(openai.BadRequestError) as no_room:
        sdk.chat.completions.create(model="stub", messages=_user("x" * (CONTEXT - 6)))
    assert "However, your messages resulted in at least 128 tokens" in _context_error(no_room.value, "messages")
    # the gateway's own check, by the prompt's size, answers the same
    with pytest.raises(openai.BadRequestError) as by_size:
        sdk.completions.create(model="stub", prompt=[5] * 200, max_tokens=4)
    assert "you requested 204 tokens (200 in the prompt, 4 in the completion)" in _context_error(
        by_size.value, "prompt"
    )


def test_a_streamed_refusal_is_its_status_before_the_first_byte(stack, redis_url):
    base = stack.base
    body = {"model": "stub", "messages": _user("x" * 120), "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=30) as response:
        status, kind = response.status_code, response.headers["content-type"]
        payload = response.read()
    assert (status, kind) == (400, "application/json"), payload
    assert httpx.Response(400, content=payload).json()["error"]["code"] == "context_length_exceeded"
    (record,) = [records[0] for records in finals_by_id(Redis.from_url(redis_url)).values()]
    assert record["status"] == "rejected" and record["error_code"] == "context_length_exceeded"
    # a stream that starts is 200 and streams (the role chunk first)
    ok = {**body, "messages": _user("hi"), "temperature": 0}
    with httpx.stream("POST", f"{base}/chat/completions", json=ok, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert '"role":"assistant"' in lines[0] and lines[-1] == "data: [DONE]"


def test_every_answer_carries_a_request_id(stack, redis_url):
    base, sdk = stack.base, stack.sdk
    made = httpx.get(f"{base}/models").headers["x-request-id"]
    assert made.startswith("req_") and made != httpx.get(f"{base}/models").headers["x-request-id"]
    assert httpx.get(f"{base}/models", headers={"x-request-id": "trace-42"}).headers["x-request-id"] == "trace-42"
    for insane in (b"a b", b"x" * 500, "é".encode(), b"a\tb"):
        echoed = httpx.get(f"{base}/models", headers={"x-request-id": insane})
        assert echoed.headers["x-request-id"].startswith("req_")
    raw = sdk.chat.completions.with_raw_response.create(model="stub", messages=_user("hi"), max_tokens=2)
    assert raw.headers["x-request-id"].startswith("req_") and raw.parse().choices
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model="stub", messages=_user("hi"), max_tokens=2, temperature=2.5)
    assert refused.value.request_id and refused.value.request_id.startswith("req_")
    with gateway_thread(redis_url, api_keys=["k"]) as keyed:  # a refusal before any route runs carries one too
        assert httpx.get(f"{keyed}/models").headers["x-request-id"].startswith("req_")


def test_an_expired_request_is_not_retried(redis_url):
    engine = StubEngine(chat_template=TEMPLATE, step_delay_s=0.05)
    with worker_thread(engine, redis_url, model="stub"), gateway_thread(redis_url) as base:
        sdk = openai.OpenAI(base_url=base, api_key="none")  # the SDK's default: 2 retries
        wait_for(lambda: sdk.models.list().data, what="a live worker")
        with pytest.raises(openai.APIStatusError) as expired:
            sdk.chat.completions.create(
                model="stub", messages=_user("hi"), max_tokens=1000, temperature=1.0, extra_body={"timeout": 0.3}
            )
        assert expired.value.status_code == 504 and expired.value.response.headers["x-should-retry"] == "false"
        finals = finals_by_id(Redis.from_url(redis_url))
    assert [records[0]["status"] for records in finals.values()] == ["expired"]  # one job, not three


@pytest.mark.parametrize(
    "extra, words",
    [
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}
                ]
            },
            "messages.0.content: image input is not supported by this model",
        ),
        ({"temperature": 2.5}, "temperature: Input should be less than or equal to 2"),
    ],
)
def test_what_openai_refuses_is_refused_by_name(stack, extra, words):
    sdk = stack.sdk
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(**{"model": "stub", "messages": _user("hi"), "max_tokens": 2, **extra})
    assert refused.value.body["message"] == words and refused.value.code == "invalid_request"


class Verdict(BaseModel):
    """A structured answer as an agent library asks for one (a pydantic model through the SDK's parse)."""

    answer: Literal["yes", "no"]
    confidence: Literal["low", "high"]


def test_parse_with_a_pydantic_model_works_at_the_defaults(chat_llama_dir):
    with served_model(chat_llama_dir) as served:  # a real tiny checkpoint and its grammar: no max_tokens given
        parsed = served.sdk.chat.completions.parse(
            model=served.model, messages=_user("Is the sky blue?"), response_format=Verdict, temperature=0
        )
    (choice,) = parsed.choices
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Verdict)
    assert (
        parsed.usage.completion_tokens > 16
    )  # past completions' default, where the SDK raised LengthFinishReasonError
