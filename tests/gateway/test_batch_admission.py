"""How a batch's lines become jobs (issue 34): as the tenant of the caller's API key (a line may not choose one),
within the caller's queue limits (fed as room frees up: a big batch waits, it never fails, and another tenant's
requests still get in); lines split on "\\n" only; a batch resumed after its results expired runs them again.
Oracles: the jobs in the Redis streams as the batch runs, the stub engine's own answers, the official SDK."""

from __future__ import annotations

import json
import threading

import openai
import pytest
from redis import Redis

from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.testing.stub_engine import StubEngine

from ..worker.helpers import offline, run_burst
from .conftest import gateway_thread, wait_for, worker_thread

KEYS = QueueKeys()
TENANTS = {"key-a": "acme", "key-b": "globex"}


def _line(custom_id: str, prompt: str, max_tokens: int = 2, **body: object) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "stub", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body},
        },
        ensure_ascii=False,
    )


class BulkBandWatch:
    """Samples the bulk band's stream while a batch runs: its greatest depth and the tenants its jobs carry."""

    def __init__(self, redis_url: str) -> None:
        self.r, self.most, self.tenants = Redis.from_url(redis_url), 0, set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.stop.is_set():
            entries = self.r.xrange(KEYS.jobs_of("bulk"))
            self.most = max(self.most, len(entries))
            self.tenants |= {json.loads(fields[b"job"]).get("tenant") for _, fields in entries}
            self.stop.wait(0.002)

    def __enter__(self) -> BulkBandWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def _finished(sdk: openai.OpenAI, batch_id: str, timeout: float = 60):
    return wait_for(
        lambda: (b := sdk.batches.retrieve(batch_id)).status == "completed" and b,
        timeout=timeout,
        interval=0.1,
        what="batch completed",
    )


def _lines(sdk: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(x) for x in sdk.files.content(file_id).text.split("\n") if x]


@pytest.mark.abuse
def test_a_big_batch_runs_as_its_callers_tenant_within_its_limits_and_others_still_get_in(redis_url):
    lines = [_line(f"r{i}", f"prompt {i}") for i in range(200)]
    lines.insert(
        50, json.dumps({"custom_id": "plain-forged", "prompt": "as globex", "max_tokens": 2, "tenant": "globex"})
    )
    lines.insert(150, _line("body-forged", "as globex", tenant="globex"))
    with (
        worker_thread(StubEngine(), redis_url, model="stub"),
        gateway_thread(redis_url, api_key_tenants=TENANTS, max_queue_depth=5, max_tenant_queued=2) as base,
    ):
        acme = openai.OpenAI(base_url=base, api_key="key-a", max_retries=0)
        globex = openai.OpenAI(base_url=base, api_key="key-b", max_retries=0)
        wait_for(lambda: acme.models.list().data, what="a live worker")
        upload = acme.files.create(file=("big.jsonl", "\n".join(lines).encode()), purpose="batch")
        with BulkBandWatch(redis_url) as watch:
            batch = acme.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
            wait_for(lambda: watch.tenants, what="the batch's first jobs")
            others = [globex.completions.create(model="stub", prompt=f"meanwhile {i}", max_tokens=2) for i in range(5)]
            running = acme.batches.retrieve(batch.id).status
            done = _finished(acme, batch.id)
        errors = _lines(acme, done.error_file_id)
        output = {line["custom_id"]: line for line in _lines(acme, done.output_file_id)}
    assert running == "in_progress"  # the plain requests got in while the batch ran
    assert all(o.usage.completion_tokens == 2 for o in others)
    assert watch.most <= 2  # acme's limit (below the band's 5): never more queued at once
    assert watch.tenants == {"acme"}  # every line's job ran as the key's tenant
    assert done.request_counts.total == 202 and done.request_counts.completed == 200
    assert sorted(e["custom_id"] for e in errors) == ["body-forged", "plain-forged"]
    assert all(e["error"]["code"] == "invalid_request" and "tenant" in e["error"]["message"] for e in errors)
    want = offline("prompt 7", max_tokens=2, temperature=0.0)[0]
    assert output["r7"]["response"]["body"]["choices"][0]["text"] == want


@pytest.mark.abuse
def test_a_batch_of_a_key_without_tenant_keeps_to_the_queue_depth(redis_url):
    lines = [_line(f"r{i}", f"prompt {i}") for i in range(40)]
    with (
        worker_thread(StubEngine(step_delay_s=0.01), redis_url, model="stub"),
        gateway_thread(redis_url, api_keys=["plain"], max_queue_depth=5) as base,
    ):
        sdk = openai.OpenAI(base_url=base, api_key="plain", max_retries=0)
        wait_for(lambda: sdk.models.list().data, what="a live worker")
        upload = sdk.files.create(file=("some.jsonl", "\n".join(lines).encode()), purpose="batch")
        with BulkBandWatch(redis_url) as watch:
            batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
            done = _finished(sdk, batch.id)
    assert 0 < watch.most <= 5 and watch.tenants == {None}  # never past the limit
    assert done.request_counts.completed == 40 and done.request_counts.failed == 0


def test_lines_split_on_newline_only(redis_url):
    prompts = {
        f"sep{i}": f"before{sep}after" for i, sep in enumerate(["\u2028", "\u2029", "\x85", "\x1c", "\x1d", "\x1e"])
    }
    content = "\r\n".join(_line(cid, p, max_tokens=3) for cid, p in prompts.items()) + "\n"
    assert len(content.splitlines()) > len(prompts)  # what str.splitlines made of it
    with worker_thread(StubEngine(), redis_url, model="stub"), gateway_thread(redis_url) as base:
        sdk = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        upload = sdk.files.create(file=("seps.jsonl", content.encode()), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        done = _finished(sdk, batch.id)
        output = {line["custom_id"]: line for line in _lines(sdk, done.output_file_id)}
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(prompts), len(prompts), 0)
    for cid, prompt in prompts.items():
        assert (
            output[cid]["response"]["body"]["choices"][0]["text"] == offline(prompt, max_tokens=3, temperature=0.0)[0]
        )


def test_a_batch_resumed_after_its_results_expired_runs_them_again(redis_url):
    prompts = {"a": "first", "b": "second", "c": "third"}
    content = "\n".join(_line(cid, p) for cid, p in prompts.items()) + "\n"
    r = Redis.from_url(redis_url)
    with gateway_thread(redis_url) as first:  # no worker yet: the jobs wait
        sdk = openai.OpenAI(base_url=first, api_key="x", max_retries=0)
        upload = sdk.files.create(file=("r.jsonl", content.encode()), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        wait_for(lambda: r.xlen(KEYS.jobs_of("bulk")) == 3, what="batch jobs enqueued")
    wait_for(lambda: not r.exists(KEYS.batch_runner(batch.id)), timeout=45, what="the batch lease released")
    run_burst(StubEngine(), redis_url)  # they finish while no gateway watches the batch
    finals = r.keys(KEYS.final("*"))
    assert len(finals) == 3
    r.delete(*finals, *r.keys(KEYS.result("*")))  # what the worker's result TTL does a day later
    with worker_thread(StubEngine(), redis_url, model="stub"), gateway_thread(redis_url) as second:
        sdk = openai.OpenAI(base_url=second, api_key="x", max_retries=0)
        done = _finished(sdk, batch.id, timeout=30)
        output = {line["custom_id"]: line for line in _lines(sdk, done.output_file_id)}
    assert sorted(output) == sorted(prompts) and done.request_counts.failed == 0
    for cid, prompt in prompts.items():
        assert (
            output[cid]["response"]["body"]["choices"][0]["text"] == offline(prompt, max_tokens=2, temperature=0.0)[0]
        )
