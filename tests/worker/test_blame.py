"""Whose fault a failure to take a job in is: RequestRejected from the engine is the caller's (the job is rejected
with the engine's message); any other exception, a plain ValueError included, is the engine's (the job is retried,
and dead-lettered only after max_attempts runs). Against a real Redis; oracles: the stub engine's offline output
and the final records and dead letters in Redis."""

from __future__ import annotations

import json
import math

from pagedq.engine import RequestRejected
from pagedq.worker import Client
from pagedq.worker.testing.stub_engine import StubEngine, StubTokenizer

from .helpers import KEYS, assert_clean_queue, finals_by_id, offline, run_burst

MARKER = "TROUBLE"


class FailingEngine(StubEngine):
    """The stub engine, except that add_request raises `error` for a prompt with MARKER in it, the first `times`
    times (math.inf: always)."""

    def __init__(self, error: Exception, times: float = math.inf) -> None:
        super().__init__()
        self.error, self.times, self.raised = error, times, 0

    def add_request(self, request_id: str, prompt: str | list[int], params, priority: int = 0) -> None:
        if isinstance(prompt, str) and MARKER in prompt and self.raised < self.times:
            self.raised += 1
            raise self.error
        super().add_request(request_id, prompt, params, priority=priority)


def submit(client: Client) -> tuple[str, dict[str, str]]:
    """One troubled job among four good ones."""
    good = {client.submit(prompt=f"good {i}", max_tokens=6, temperature=0.0): f"good {i}" for i in range(4)}
    troubled = client.submit(prompt=f"a {MARKER} job", max_tokens=6, temperature=0.0)
    return troubled, good


def check_good(client: Client, r, good: dict[str, str]) -> None:
    for job_id, prompt in good.items():
        res = client.result(job_id, timeout=1)
        assert (res.status, res.text) == ("completed", offline(prompt, max_tokens=6, temperature=0.0)[0])
    assert all(len(records) == 1 for records in finals_by_id(r).values())  # one final record per job


def test_a_plain_value_error_is_retried_not_rejected(redis_url, r):
    client = Client(redis_url)
    troubled, good = submit(client)
    engine = FailingEngine(ValueError("an engine bug"), times=1)
    worker = run_burst(engine, redis_url, max_attempts=3)
    res = client.result(troubled, timeout=1)
    assert res.status == "completed" and res.text == offline(f"a {MARKER} job", max_tokens=6, temperature=0.0)[0]
    assert res.attempts == 2 and engine.raised == 1  # the failed admission counts as a run
    assert worker.stats == {"completed": 5, "failed": 0, "cancelled": 0, "expired": 0, "rejected": 0}
    check_good(client, r, good)
    assert r.xlen(KEYS.dead) == 0
    assert_clean_queue(r)


def test_an_engine_that_keeps_failing_a_job_dead_letters_it_after_max_attempts(redis_url, r):
    client = Client(redis_url)
    troubled, good = submit(client)
    engine = FailingEngine(ValueError("an engine bug"))
    worker = run_burst(engine, redis_url, max_attempts=3)
    res = client.result(troubled, timeout=1)
    assert res.status == "failed" and res.attempts == 3 and engine.raised == 3
    assert "attempts 3, max_attempts 3" in res.error and "last error: ValueError: an engine bug" in res.error
    letters = r.xrange(KEYS.dead)
    assert [letter[1][b"id"].decode() for letter in letters] == [troubled]
    assert json.loads(letters[0][1][b"data"])["attempts"] == 3
    assert worker.stats["failed"] == 1 and worker.stats["rejected"] == 0 and worker.stats["completed"] == 4
    check_good(client, r, good)


def test_request_rejected_rejects_the_job_with_its_message(redis_url, r):
    client = Client(redis_url)
    troubled, good = submit(client)
    engine = FailingEngine(RequestRejected("prompt is too long for this model"))
    worker = run_burst(engine, redis_url, max_attempts=3)
    res = client.result(troubled, timeout=1)
    assert (res.status, res.error, res.attempts) == ("rejected", "prompt is too long for this model", 0)
    assert engine.raised == 1  # not retried
    assert worker.stats["rejected"] == 1 and worker.stats["failed"] == 0
    check_good(client, r, good)
    assert r.xlen(KEYS.dead) == 0
    assert_clean_queue(r)


class CrashingTokenizer(StubTokenizer):
    """A tokenizer whose chat template renders, and whose encode crashes the first time (a tokenizer bug)."""

    def __init__(self) -> None:
        super().__init__(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
        self.crashes = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.crashes and MARKER in text:
            self.crashes -= 1
            raise RuntimeError("tokenizer crashed")
        return super().encode(text, add_special_tokens)


def test_chat_prompts_a_template_refusal_is_the_callers_a_tokenizer_crash_is_not(redis_url, r):
    client = Client(redis_url)
    refusing = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the user speaks first') }}{% endif %}"
    # the stub's jinja has no raise_exception; an undefined call raises jinja's UndefinedError, a TemplateError
    engine = StubEngine(chat_template=refusing + "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    refused = client.submit(messages=[{"role": "assistant", "content": "hi"}], max_tokens=4)
    accepted = client.submit(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0)
    run_burst(engine, redis_url)
    res = client.result(refused, timeout=1)
    assert res.status == "rejected" and res.error.startswith("the chat template refused the messages")
    assert client.result(accepted, timeout=1).status == "completed"

    crashing = StubEngine()
    crashing.tokenizer = CrashingTokenizer()
    job_id = client.submit(messages=[{"role": "user", "content": f"a {MARKER} turn"}], max_tokens=4, temperature=0.0)
    run_burst(crashing, redis_url)
    res = client.result(job_id, timeout=1)
    assert res.status == "completed" and res.attempts == 2  # the crash was the engine's: retried
    assert res.text == offline(f"a {MARKER} turn", max_tokens=4, temperature=0.0)[0]
