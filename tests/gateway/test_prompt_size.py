"""The gateway refuses a prompt too long by its size alone before queuing it (gateway/prompt_limits.py): 400 in
OpenAI's and vLLM's shape, code `context_length_exceeded`, "maximum context length" and the limit in its message, and
no job is ever written. Oracles: the real openai SDK,
and the queue's completions stream in a real Redis (a queued job always ends with a record there)."""

from __future__ import annotations

import openai
import pytest
from redis import Redis

from pagedq.worker.gateway.prompt_limits import prompt_too_long
from pagedq.worker.protocol.job import Job
from pagedq.worker.testing.stub_engine import StubEngine

from ..worker.helpers import finals_by_id
from .conftest import gateway_thread, wait_for, worker_thread

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
SHAPE = {"message", "type", "param", "code"}


def _tool(i: int, size: int) -> dict:
    schema = {"type": "object", "properties": {"x": {"type": "string", "description": "d" * size}}}
    return {"type": "function", "function": {"name": f"f{i}", "parameters": schema}}


@pytest.mark.abuse
def test_prompts_too_long_by_their_size_are_refused_before_queuing(redis_url):
    with (
        worker_thread(StubEngine(chat_template=TEMPLATE), redis_url, model="stub"),
        gateway_thread(redis_url) as base,
    ):
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        wait_for(lambda: client.models.list().data, what="a live worker")
        refused = []
        with pytest.raises(openai.BadRequestError) as text:
            client.completions.create(model="stub", prompt="y" * 1_000_000, max_tokens=4)
        refused.append(text.value)
        with pytest.raises(openai.BadRequestError) as ids:
            client.completions.create(model="stub", prompt=[5] * 3000, max_tokens=4)
        refused.append(ids.value)
        with pytest.raises(openai.BadRequestError) as tools:
            client.chat.completions.create(
                model="stub",
                messages=[{"role": "user", "content": "hi"}],
                tools=[_tool(i, 2000) for i in range(20)],
                max_tokens=4,
            )
        refused.append(tools.value)
        fits = client.completions.create(model="stub", prompt="y" * 2000, max_tokens=48)
        queued = finals_by_id(Redis.from_url(redis_url))
    for error in refused:
        assert set(error.body) == SHAPE and error.body["code"] == "context_length_exceeded", error.body
        assert error.body["message"].startswith("This model's maximum context length is 2048 tokens. However, ")
    assert [e.body["param"] for e in refused] == ["prompt", "prompt", "messages"]
    assert (
        "at least 1000004 tokens (at least 1000000 in the prompt, counted from 1000000 characters, 4 in the"
        in (refused[0].body["message"])
    )
    assert "you requested 3004 tokens (3000 in the prompt, 4 in the completion)" in refused[1].body["message"]
    assert fits.choices[0].finish_reason == "length"
    (only,) = queued.values()  # the one that fits is the only job ever queued
    assert [record["status"] for record in only] == ["completed"]


def test_a_conversation_is_measured_by_what_every_template_writes():
    long_answer = {"role": "assistant", "content": "r" * 10_000}  # a template may drop earlier reasoning
    turns = [{"role": "user", "content": "q"}, long_answer, {"role": "user", "content": "again"}]
    assert prompt_too_long(Job(messages=turns, max_tokens=8), 2048, 1) is None
    too_long = Job(messages=[{"role": "user", "content": "u" * 3000}], max_tokens=8)
    assert "at least 3000 in the messages, counted from 3000 characters" in str(prompt_too_long(too_long, 2048, 1))
    assert prompt_too_long(too_long, 2048, None) is None  # no provable bound: not checked here
    assert prompt_too_long(Job(prompt_token_ids=[1] * 2041, max_tokens=8), 2048, None) is not None
    assert prompt_too_long(Job(prompt_token_ids=[1] * 2040, max_tokens=8), 2048, None) is None
    # no max_tokens (chat's default: the rest of the context): the prompt must leave one token
    assert prompt_too_long(Job(prompt_token_ids=[1] * 2047, max_tokens=None), 2048, None) is None
    refusal = prompt_too_long(Job(prompt_token_ids=[1] * 2048, max_tokens=None), 2048, None)
    assert str(refusal).endswith(
        "However, your prompt resulted in 2048 tokens. Please reduce the length of the prompt."
    )
