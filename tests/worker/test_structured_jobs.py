"""A job's structured_outputs through a real Redis and worker on a tiny checkpoint: a bad constraint is JobRejected
at the client and `rejected` at the worker (bytes that skip the client), a grammar that does not compile or misses
its time limit is `rejected` naming why, and the jobs around them complete, constrained as asked."""

from __future__ import annotations

import json
import re

import pytest

from pagedq.engine import LLMEngine
from pagedq.worker import Client, JobRejected
from pagedq.worker.protocol.job import Job

from .helpers import KEYS, worker_thread

REGEX = r"[a-z]{3,8}-[0-9]{2}"


def test_structured_jobs_are_validated_constrained_and_settled_once(redis_url, r, tiny_llama_dir):
    client = Client(redis_url)
    for bad, words in [
        ({"choice": []}, "choice must be a non-empty list"),
        ({"json": {"type": "object", "minProperties": 1}}, "minProperties"),
        ({"regex": "a", "json_object": True}, "exactly one of"),
        ({"guided_json": {}}, "unknown fields"),
    ]:
        try:
            client.submit(prompt="x", structured_outputs=bad)
        except JobRejected as error:
            assert words in str(error)
        else:
            raise AssertionError(f"{bad} was accepted")
    raw = {"id": "raw-bad", "prompt": "x", "structured_outputs": {"json": "{not json"}}
    r.xadd(KEYS.jobs, {"job": json.dumps(raw)})
    regex = client.submit(prompt="The quick brown fox", max_tokens=16, structured_outputs={"regex": REGEX})
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    as_json = client.submit(prompt="Redis streams", max_tokens=24, structured_outputs={"json": schema})
    broken = client.submit(prompt="x", max_tokens=4, structured_outputs={"regex": "([a-z"})
    plain = client.submit(prompt="Paged attention", max_tokens=4, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    with worker_thread(engine, redis_url):
        records = {job: client.result(job, timeout=60) for job in ("raw-bad", regex, as_json, broken, plain)}
    bad_raw = records["raw-bad"]
    assert bad_raw.status == "rejected" and "json must be a JSON schema, not valid JSON" in bad_raw.error
    assert records[broken].status == "rejected" and "structured_outputs regex does not compile" in records[broken].error
    assert records[regex].status == "completed"
    text = records[regex].text
    assert re.fullmatch(REGEX, text) or (
        records[regex].finish_reason == "length" and len(records[regex].token_ids) == 16
    )
    if records[as_json].finish_reason == "stop":
        assert isinstance(json.loads(records[as_json].text)["ok"], bool)
    assert records[as_json].status == records[plain].status == "completed"


def test_a_schema_that_does_not_convert_is_rejected_when_added_without_a_compile(
    redis_url, r, tiny_llama_dir, monkeypatch
):
    """Issue 35, item 10: the engine converts the schema when the job is added (as vLLM validates it at input
    processing), so the job is `rejected` there, once, naming the problem, and no compile takes a pool thread."""
    client = Client(redis_url)
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "no-such-type"}}}}
    bad = client.submit(prompt="x", max_tokens=4, structured_outputs={"json": schema})  # the client cannot tell
    after = client.submit(prompt="Paged attention", max_tokens=3, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    compiles: list[object] = []
    monkeypatch.setattr(engine.structured.pool, "submit", lambda *args: compiles.append(args))
    with worker_thread(engine, redis_url):
        record, served = client.result(bad, timeout=60), client.result(after, timeout=60)
    assert record.status == "rejected"
    assert 'structured_outputs json does not compile: Unsupported type "no-such-type"' in record.error
    assert [fields[b"type"] for _, fields in r.xrange(KEYS.result(bad))] == [b"final"]  # one record, no delta
    assert compiles == [] and served.status == "completed" and len(served.token_ids) == 3


def test_a_compile_past_its_time_limit_is_rejected(redis_url, tiny_llama_dir):
    client = Client(redis_url)
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(30)}}
    slow = client.submit(prompt="x", max_tokens=4, structured_outputs={"json": schema})
    after = client.submit(prompt="Paged attention", max_tokens=3, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, structured_outputs_compile_timeout_s=1e-6)
    with worker_thread(engine, redis_url):
        record, served = client.result(slow, timeout=60), client.result(after, timeout=60)
    assert record.status == "rejected" and "did not compile within 1e-06 s" in record.error
    assert served.status == "completed" and len(served.token_ids) == 3


def slow_grammar(tag: str) -> str:
    """A grammar xgrammar takes seconds to compile for this tokenizer (3,000 optional literals, 30 KB)."""
    return "root ::= " + " ".join(f'"{tag}{i}"?' for i in range(3000))


@pytest.mark.abuse
def test_a_tenants_timed_out_compiles_do_not_fail_another_tenants_choice(redis_url, tiny_llama_dir):
    """Issue 34, finding 5: two slow grammars of tenant "a" pass their time limit and keep compiling (xgrammar
    cannot be stopped); tenant "b"'s `choice` job, sent then, compiles on a thread of its own and completes, where it
    used to wait behind them and fail with "did not compile within"."""
    client = Client(redis_url)
    slow = [
        client.submit(prompt="x", max_tokens=4, tenant="a", structured_outputs={"grammar": slow_grammar(f"s{i}_")})
        for i in range(2)
    ]
    engine = LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, structured_outputs_compile_timeout_s=0.5)
    with worker_thread(engine, redis_url):
        for job in slow:
            record = client.result(job, timeout=60)
            assert record.status == "rejected" and "did not compile within 0.5 s" in record.error
        choice = client.submit(prompt="x", max_tokens=4, tenant="b", structured_outputs={"choice": ["yes", "no"]})
        served = client.result(choice, timeout=60)
    assert served.status == "completed" and served.text in ("yes", "no"), served


def test_the_job_tenant_is_its_compiles_source_and_no_producer_picks_one():
    job = Job(prompt="x", tenant="acme", structured_outputs={"choice": ["yes"]})
    constraint = job.to_sampling_params().structured_outputs
    assert constraint is not None and constraint.compile_source == "acme"
    keyless = Job(prompt="x", structured_outputs={"choice": ["yes"]}).to_sampling_params().structured_outputs
    assert keyless is not None and keyless.compile_source == ""
    with pytest.raises(ValueError, match="unknown fields"):
        Job(prompt="x", tenant="acme", structured_outputs={"choice": ["yes"], "compile_source": "other"})
