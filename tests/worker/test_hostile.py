"""Hostile input never stops a worker: whatever bytes a job entry holds, it gets exactly one final record
(`rejected`, naming the problem) or, if even that cannot be written, a raw dead letter; the jobs around it
stay exact. Oracles: the stub engine's offline output, Redis state, the limits of pagedq/worker/protocol/limits.py."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from pagedq.engine import SamplingParams
from pagedq.worker import AsyncClient, Client, JobRejected
from pagedq.worker.protocol.limits import (
    MAX_ENTRY_BYTES,
    MAX_JSON_DEPTH,
    MAX_METADATA_BYTES,
    entry_problem,
    json_depth,
)
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, assert_clean_queue, finals_by_id, offline, run_burst


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (raw job field bytes, the id its rejection is addressed to (None: the stream entry id), words in the reason)
HOSTILE = [
    (f'{{"id": "deep-300", "prompt": "x", "metadata": {{"a": {nested(300)}}}}}', "deep-300", "nested"),
    (f'{{"id": "deep-1500", "prompt": "x", "metadata": {{"a": {nested(1500)}}}}}', None, "nested"),
    (nested(5000), None, "nested"),
    ('{"id": "brackets-in-text", "prompt": "' + "[" * 100 + '", "max_tokens": "x"}', "brackets-in-text", "max_tokens"),
    ('{"id": "top-k", "prompt": "x", "top_k": 9223372036854775808}', "top-k", "top_k"),
    ('{"id": "max-tokens", "prompt": "x", "max_tokens": 1000000000000000000000000000000}', "max-tokens", "max_tokens"),
    ('{"id": "seed", "prompt": "x", "seed": 1180591620717411303424}', "seed", "seed"),
    ('{"id": "token-ids", "prompt_token_ids": [5, 18446744073709551616]}', "token-ids", "prompt_token_ids"),
    ('{"id": "stop-ids", "prompt": "x", "stop_token_ids": [9223372036854775808]}', "stop-ids", "stop_token_ids"),
    ('{"id": "priority", "prompt": "x", "priority": 100000000000000000000}', "priority", "priority"),
    ('{"id": "deadline", "prompt": "x", "deadline": 1e300}', "deadline", "deadline"),
    ('{"id": "temperature", "prompt": "x", "temperature": 1e300}', "temperature", "temperature"),
    ('{"id": "inf", "prompt": "x", "temperature": Infinity}', "inf", "temperature"),
    ('{"id": "many-stops", "prompt": "x", "stop": [' + ",".join(['"s"'] * 100) + "]}", "many-stops", "stop"),
    (
        '{"id": "big-meta", "prompt": "x", "metadata": {"a": "' + "m" * (MAX_METADATA_BYTES + 1) + '"}}',
        "big-meta",
        "metadata",
    ),
    ('{"id": "too-big", "prompt": "' + "p" * MAX_ENTRY_BYTES + '"}', None, "bytes"),
    (b'{"id": "bin-1", "prompt": "\xff\xfe"}', None, "unicode"),
    (b"\x80\x81\xfe not json at all", None, "json"),
    ("null", None, "job"),
    ("42", None, "job"),
    ('{"id": "meta-list", "prompt": "x", "metadata": [1]}', "meta-list", "metadata"),
    ('{"id": "stop-str", "prompt": "x", "stop": "s"}', "stop-str", "stop"),
    ('{"id": 5, "prompt": "x"}', None, "id"),
    ('{"id": "bad\\nid", "prompt": "x"}', None, "id"),
]


def test_every_hostile_entry_gets_one_rejection_and_the_good_jobs_around_it_stay_exact(redis_url, r):
    client = Client(redis_url)
    good, entry_of = {}, {}
    for i, (raw, _job_id, _) in enumerate(HOSTILE):
        good[client.submit(prompt=f"good {i}", max_tokens=3 + i % 4, temperature=0.0)] = (f"good {i}", 3 + i % 4)
        entry_of[i] = r.xadd(KEYS.jobs, {"job": raw}).decode()
    good[client.submit(prompt="last", max_tokens=5, temperature=0.0)] = ("last", 5)
    worker = run_burst(StubEngine(), redis_url)
    finals = finals_by_id(r)
    assert all(len(records) == 1 for records in finals.values())
    for i, (_raw, job_id, word) in enumerate(HOSTILE):
        record = finals[job_id or entry_of[i]][0]
        assert record["status"] == "rejected" and word in record["error"].lower(), (i, record["error"][:200])
        assert len(record["error"]) <= 2000
    for job_id, (prompt, max_tokens) in good.items():
        res = client.result(job_id, timeout=1)
        assert (res.status, res.text) == ("completed", offline(prompt, max_tokens=max_tokens, temperature=0.0)[0])
    assert worker.stats["rejected"] == len(HOSTILE) and worker.stats["completed"] == len(good)
    assert r.xlen(KEYS.dead) == 0
    assert_clean_queue(r)


def test_limits_are_exactly_the_documented_ones(redis_url, r):
    """At the limit is accepted, one past it is rejected (JSON depth counts the job object as level 1)."""

    def meta(depth_of_job: int) -> dict:  # metadata whose innermost list sits at depth_of_job of the job
        value: object = []
        for _ in range(depth_of_job - 3):  # job 1, metadata 2, "a" 3
            value = [value]
        return {"a": value}

    ok = dict(id="at-limit", prompt="x", max_tokens=2, temperature=0.0, metadata=meta(MAX_JSON_DEPTH))
    r.xadd(KEYS.jobs, {"job": json.dumps(ok)})
    r.xadd(KEYS.jobs, {"job": json.dumps({**ok, "id": "past-limit", "metadata": meta(MAX_JSON_DEPTH + 1)})})
    run_burst(StubEngine(), redis_url)
    client = Client(redis_url)
    assert client.result("at-limit", timeout=1).metadata == ok["metadata"]
    assert client.result("past-limit", timeout=1).status == "rejected"
    with pytest.raises(JobRejected, match="nested"):
        client.submit(prompt="x", metadata=meta(MAX_JSON_DEPTH + 1))


def test_an_entry_that_cannot_even_be_rejected_is_dead_lettered_raw(redis_url, r, monkeypatch):
    import pagedq.worker.service.admission as admission

    def broken_record(**fields):
        raise RuntimeError("cannot build the record")

    monkeypatch.setattr(admission, "FinalRecord", broken_record)
    raw = b'{"id": "doomed", "prompt": "x", "top_k": "\xff"}'
    entry = r.xadd(KEYS.jobs, {"job": raw}).decode()
    after = Client(redis_url).submit(prompt="after the doomed one", max_tokens=4, temperature=0.0)
    worker = run_burst(StubEngine(), redis_url)
    letters = r.xrange(KEYS.dead)
    assert len(letters) == 1 and letters[0][1][b"raw"] == raw and letters[0][1][b"id"].decode() == entry
    data = json.loads(letters[0][1][b"data"])
    assert data["job"] is None and data["entry_id"] == entry and "cannot build the record" in data["error"]
    assert r.get(KEYS.final("doomed")) is None and r.get(KEYS.final(entry)) is None
    assert (
        Client(redis_url).result(after, timeout=1).text
        == offline("after the doomed one", max_tokens=4, temperature=0.0)[0]
    )
    assert worker.stats["completed"] == 1
    assert_clean_queue(r)


class Opaque:
    pass


def self_referencing() -> dict:
    d: dict = {}
    d["me"] = d
    return d


@pytest.mark.parametrize(
    "metadata, reason",
    [
        ({"a": Opaque()}, "not a json value"),
        ({"a": float("nan")}, "not a json number"),
        ({1: "x"}, "metadata"),
        (self_referencing(), "nested"),
        ({"a": "m" * (MAX_METADATA_BYTES + 1)}, "bytes"),
    ],
)
def test_client_refuses_metadata_that_is_not_bounded_json(redis_url, r, metadata, reason):
    client = Client(redis_url)
    with pytest.raises(JobRejected, match="metadata") as info:
        client.submit(prompt="x", metadata=metadata)
    assert reason in str(info.value).lower()
    assert r.xlen(KEYS.jobs) == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**63),
        ("max_tokens", 10**20),
        ("seed", 2**70),
        ("temperature", float("inf")),
        ("stop_token_ids", [2**63]),
        ("prompt_token_ids", [2**64]),
        ("priority", 10**20),
        ("deadline", float("nan")),
    ],
)
def test_client_refuses_out_of_range_numbers_naming_the_field(redis_url, r, field, value):
    fields = {"prompt": "x", field: value} if field != "prompt_token_ids" else {field: value}
    with pytest.raises(JobRejected, match=field):
        Client(redis_url).submit(**fields)
    assert r.xlen(KEYS.jobs) == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**63),
        ("max_tokens", 2**63),
        ("n", 2**40),
        ("seed", 2**70),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("repetition_penalty", 1e300),
        ("stop_token_ids", [2**63]),
        ("logprobs", 2**63),
    ],
)
def test_sampling_params_bound_every_number(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_cancel_of_an_unknown_id_is_false_and_leaves_nothing(redis_url, r):
    client = Client(redis_url)
    assert client.cancel("never-submitted") is False
    assert asyncio.run(_acancel(redis_url, "never-either")) is False
    assert r.zcard(KEYS.cancelled) == 0 and r.exists(KEYS.ids) == 0
    queued = client.submit(prompt="queued", max_tokens=3)
    raw_id = "raw-read-by-a-worker"
    assert client.cancel(queued) is True
    run_burst(StubEngine(), redis_url)
    assert client.result(queued, timeout=1).status == "cancelled"
    assert client.cancel(queued) is False  # final
    assert r.zcard(KEYS.cancelled) == 0 and r.hlen(KEYS.ids) == 0  # settled jobs leave the index
    assert client.cancel(raw_id) is False


async def _acancel(url: str, job_id: str) -> bool:
    async with AsyncClient(url) as client:
        return await client.cancel(job_id)


def _parsed_depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_parsed_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_parsed_depth, value), default=0)
    return 0


@pytest.mark.timeout(60)
def test_the_entry_depth_scan_agrees_with_the_parser_and_stays_linear_on_unterminated_strings():
    """json_depth against json.loads on documents whose strings hold brackets, quotes and escapes (exact past
    MAX_JSON_DEPTH brackets; below, their count is the bound it gives); then an entry of escaped quotes after an
    unclosed one, which a backtracking scan takes hours over (the test's timeout)."""
    texts = ["[", "]", "{", "}", '\\"', "\\\\", "a", '"']
    rng = random.Random(0)
    for _ in range(300):
        doc = {"s": "".join(rng.choice(texts) for _ in range(rng.randrange(40))), "v": [[["x"]] * rng.randrange(3)]}
        for _ in range(rng.randrange(2 * MAX_JSON_DEPTH)):
            doc = {"k": [doc, "]]}"]}
        raw = json.dumps(doc).encode()
        depth, brackets = _parsed_depth(doc), raw.count(b"[") + raw.count(b"{")
        assert json_depth(raw) == (depth if brackets > MAX_JSON_DEPTH else brackets), raw
    hostile = b'{"id": "x", "metadata": ' + b"[" * (MAX_JSON_DEPTH + 1) + b'"' + b'\\"' * 1_000_000
    assert f"nested {MAX_JSON_DEPTH + 2} levels" in (entry_problem(hostile) or "")
