"""The queue layer against the stub engine, worker in-process: protocol, bad input, cancel, deadlines,
priorities, queue limits, poison jobs. Oracles: the stub engine's own offline output and Redis state."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from pagedq.worker import Client, JobRejected, QueueFullError
from pagedq.worker.testing.faults import FaultyEngine
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import (
    KEYS,
    assert_clean_queue,
    fast_settings,
    finals_by_id,
    offline,
    result_stream,
    run_burst,
    wait_for,
    worker_thread,
)


def test_results_match_offline_and_deltas_concatenate(redis_url, r):
    client = Client(redis_url)
    jobs = [
        dict(
            prompt=f"hello {i}",
            max_tokens=3 + i % 5,
            temperature=0.0,
            stream=i % 2 == 0,
            metadata={"i": i, "tags": ["a", {"b": None}]},
        )
        for i in range(30)
    ]
    jobs += [dict(prompt_token_ids=[5, 6, 7 + i], max_tokens=4, temperature=0.7, seed=i, stream=True) for i in range(5)]
    ids = client.submit_many(jobs)
    worker = run_burst(StubEngine(), redis_url)
    assert worker.stats["completed"] == len(jobs)
    for job_id, job in zip(ids, jobs):
        res = client.result(job_id, timeout=1)
        sampling = {k: v for k, v in job.items() if k in ("max_tokens", "temperature", "seed")}
        text, tokens = offline(job.get("prompt") or job["prompt_token_ids"], **sampling)
        assert (res.status, res.text, res.token_ids) == ("completed", text, tokens)
        assert res.metadata == job.get("metadata")
        assert res.usage.completion_tokens == len(tokens) and res.usage.prompt_tokens > 0
        assert res.timings.total >= res.timings.ttft >= res.timings.queue_wait >= 0
        records = result_stream(r, job_id)
        assert [kind for kind, _ in records].count("final") == 1 and records[-1][0] == "final"
        deltas = [d for kind, d in records if kind == "delta"]
        if job["stream"]:
            assert "".join(d["text"] for d in deltas) == text
            assert [t for d in deltas for t in d["token_ids"]] == tokens
            assert [d.text for d in client.stream(job_id, timeout=1)] == [d["text"] for d in deltas]
        else:
            assert deltas == []
        assert 0 < r.ttl(KEYS.result(job_id)) <= 86_400 and 0 < r.ttl(KEYS.final(job_id)) <= 86_400
    assert set(finals_by_id(r)) == set(ids)
    assert_clean_queue(r)


def test_stream_is_resumable_from_an_offset(redis_url):
    client = Client(redis_url)
    job_id = client.submit(prompt="resume me", max_tokens=8, temperature=0.0, stream=True)
    run_burst(StubEngine(), redis_url)
    deltas = list(client.stream(job_id, timeout=1))
    rest = list(client.stream(job_id, offset=deltas[2].offset, timeout=1))
    assert [d.text for d in rest] == [d.text for d in deltas[3:]]
    assert "".join(d.text for d in deltas) == client.result(job_id, timeout=1).text


def test_raw_xadd_with_redis_cli(redis_url, r):
    """A producer in any language: plain XADD of a JSON job, results read back with plain commands."""
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    job = json.dumps(
        {
            "id": "cli-job-1",
            "prompt": "from the shell",
            "max_tokens": 5,
            "temperature": 0,
            "metadata": {"from": "redis-cli"},
        }
    )
    subprocess.run(["redis-cli", "-p", port, "XADD", KEYS.jobs, "*", "job", job], check=True, capture_output=True)
    run_burst(StubEngine(), redis_url)
    out = subprocess.run(
        ["redis-cli", "-p", port, "GET", KEYS.final("cli-job-1")], check=True, capture_output=True, text=True
    ).stdout
    final = json.loads(out)
    text, tokens = offline("from the shell", max_tokens=5, temperature=0.0)
    assert (final["status"], final["text"], final["token_ids"], final["metadata"]) == (
        "completed",
        text,
        tokens,
        {"from": "redis-cli"},
    )
    assert result_stream(r, "cli-job-1")[-1][1]["text"] == text


BAD_JOBS = [
    ("not json at all", "invalid json"),
    (json.dumps(["a", "list"]), "should be an object"),
    (json.dumps({"id": "unknown-field", "prompt": "x", "max_tokenz": 3}), "max_tokenz"),
    (json.dumps({"id": "mistyped", "prompt": "x", "max_tokens": "5"}), "max_tokens"),
    (json.dumps({"id": "float-int", "prompt": "x", "max_tokens": 5.0}), "max_tokens"),
    (json.dumps({"id": "empty-prompt", "prompt": "   "}), "prompt must not be empty"),
    (json.dumps({"id": "no-prompt", "max_tokens": 3}), "exactly one of prompt"),
    (json.dumps({"id": "both", "prompt": "x", "prompt_token_ids": [1]}), "exactly one of prompt"),
    (json.dumps({"id": "bad-temp", "prompt": "x", "temperature": -1}), "temperature"),
    (json.dumps({"id": "bad-top-p", "prompt": "x", "top_p": 0}), "top_p"),
    (json.dumps({"id": "bad-stop", "prompt": "x", "stop": [""]}), "stop"),
    (json.dumps({"id": "too-long", "prompt": "y" * 3000}), "maximum context length"),
    (json.dumps({"id": "oov", "prompt_token_ids": [5, 100000]}), "vocab"),
    (json.dumps({"id": "bad-priority", "prompt": "x", "priority": "high"}), "priority"),
]


def test_bad_input_is_rejected_with_its_reason_and_the_worker_keeps_serving(redis_url, r):
    client = Client(redis_url)
    for raw, _ in BAD_JOBS:
        r.xadd(KEYS.jobs, {"job": raw})
    r.xadd(KEYS.jobs, {"payload": "{}"})  # no "job" field
    good = client.submit(prompt="still fine", max_tokens=4, temperature=0.0)
    worker = run_burst(StubEngine(), redis_url)
    finals = finals_by_id(r)
    assert all(len(v) == 1 for v in finals.values())
    for raw, reason in BAD_JOBS:
        job_id = json.loads(raw).get("id") if raw.startswith("{") else None
        record = (
            finals[job_id][0]
            if job_id
            else next(v[0] for v in finals.values() if v[0]["status"] == "rejected" and reason in v[0]["error"].lower())
        )
        assert record["status"] == "rejected" and reason in record["error"].lower(), (raw[:40], record)
    assert any("no 'job' field" in v[0]["error"] for v in finals.values() if v[0]["error"])
    assert client.result(good, timeout=1).text == offline("still fine", max_tokens=4, temperature=0.0)[0]
    assert worker.stats["rejected"] == len(BAD_JOBS) + 1 and worker.stats["completed"] == 1
    assert_clean_queue(r)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt=""), "prompt"),
        (dict(), "exactly one"),
        (dict(prompt="x", max_tokens=0), "max_tokens"),
        (dict(prompt="x", temperature=-0.5), "temperature"),
        (dict(prompt="x", top_p=1.5), "top_p"),
        (dict(prompt="x", bogus=1), "bogus"),
        (dict(prompt="x", max_tokens="3"), "max_tokens"),
        (dict(prompt="x", job_id="has space"), "id"),
        (dict(prompt_token_ids=[-1]), "prompt_token_ids"),
    ],
)
def test_client_rejects_bad_parameters_before_enqueuing(redis_url, r, kwargs, field):
    client = Client(redis_url)
    with pytest.raises(JobRejected, match=field):
        client.submit(**kwargs)
    with pytest.raises(JobRejected):
        client.submit_many([dict(prompt="fine"), kwargs])
    assert r.xlen(KEYS.jobs) == 0


def test_queue_full_error(redis_url, r):
    client = Client(redis_url, max_queue_depth=5)
    ids = [client.submit(prompt=f"p{i}") for i in range(5)]
    with pytest.raises(QueueFullError, match="5 jobs queued, limit 5"):
        client.submit(prompt="one too many")
    with pytest.raises(QueueFullError):
        Client(redis_url, max_queue_depth=7).submit_many([dict(prompt="a"), dict(prompt="b"), dict(prompt="c")])
    assert r.xlen(KEYS.jobs) == 5
    run_burst(StubEngine(), redis_url)
    assert set(finals_by_id(r)) == set(ids)
    client.submit(prompt="room again")  # finished jobs leave the queue, so it accepts more
    assert r.xlen(KEYS.jobs) == 1


def test_priority_orders_admission(redis_url, r):
    client = Client(redis_url)
    priorities = [0, 5, -3, 9, 1, 5, 2, -1]
    ids = [
        client.submit(prompt=f"job {i}", max_tokens=2, temperature=0.0, priority=p) for i, p in enumerate(priorities)
    ]
    run_burst(StubEngine(max_num_seqs=1), redis_url)
    order = list(finals_by_id(r))
    expected = [ids[i] for i in sorted(range(len(ids)), key=lambda i: (-priorities[i], i))]
    assert order == expected


def test_cancel_queued_and_running_frees_blocks(redis_url, r):
    engine = StubEngine(max_num_seqs=2, step_delay_s=0.01, num_kv_blocks=64)
    client = Client(redis_url)
    running = client.submit(prompt="long one", max_tokens=1000, temperature=0.0, stream=True)
    other = client.submit(prompt="long two", max_tokens=1000, temperature=0.0)
    queued = client.submit(prompt="never runs", max_tokens=5, temperature=0.0)
    with worker_thread(engine, redis_url):
        wait_for(lambda: r.xlen(KEYS.result(running)) >= 3, what="3 deltas of the running job")
        assert client.cancel(queued) and client.cancel(running)
        res = client.result(running, timeout=5)
        assert res.status == "cancelled" and res.finish_reason == "abort"
        assert (
            3 <= len(res.token_ids) < 1000
            and res.text == offline("long one", max_tokens=len(res.token_ids), temperature=0.0)[0]
        )
        q = client.result(queued, timeout=5)
        assert q.status == "cancelled" and q.token_ids == [] and q.timings.ttft is None
        assert client.cancel(other)
        assert client.result(other, timeout=5).status == "cancelled"
        wait_for(lambda: engine.num_free_blocks == engine.num_total_blocks, what="blocks freed")
        assert not engine.has_unfinished_requests()
        assert client.cancel(running) is False  # already final
    assert r.zcard(KEYS.cancelled) == 0
    assert all(len(v) == 1 for v in finals_by_id(r).values())


def test_deadlines(redis_url, r):
    client = Client(redis_url)
    past = client.submit(prompt="too late", max_tokens=5, deadline=time.time() - 1)
    soon = client.submit(prompt="runs out", max_tokens=10_000, temperature=0.0, deadline=time.time() + 1.0)
    fine = client.submit(prompt="in time", max_tokens=3, temperature=0.0, deadline=time.time() + 60)
    engine = StubEngine(step_delay_s=0.005, max_model_len=20_000, num_kv_blocks=4096)
    run_burst(engine, redis_url)
    p, s, f = (client.result(j, timeout=1) for j in (past, soon, fine))
    assert p.status == "expired" and p.token_ids == [] and "before the job started" in p.error
    assert s.status == "expired" and 0 < len(s.token_ids) < 10_000 and "while running" in s.error
    assert s.timings.total >= 0.9
    assert f.status == "completed"
    assert engine.num_free_blocks == engine.num_total_blocks


def test_poison_job_is_dead_lettered_and_its_batch_completes(redis_url, r):
    client = Client(redis_url)
    ids = [client.submit(prompt=f"fine {i}", max_tokens=6, temperature=0.0) for i in range(6)]
    poison = client.submit(prompt="this is POISON", max_tokens=6, metadata={"k": 1})
    ids += [client.submit(prompt=f"fine late {i}", max_tokens=6, temperature=0.0) for i in range(4)]
    engine = FaultyEngine(StubEngine(), "POISON")
    worker = run_burst(engine, redis_url, max_attempts=3)
    res = client.result(poison, timeout=1)
    assert res.status == "failed" and res.attempts == 3 and "injected fault" in res.error  # runs: batch + 2 alone
    assert "attempts 3, max_attempts 3" in res.error
    assert res.metadata == {"k": 1}
    dead = r.xrange(KEYS.dead)
    assert len(dead) == 1 and dead[0][1][b"id"].decode() == poison
    assert json.loads(dead[0][1][b"data"])["job"]["prompt"] == "this is POISON"
    for job_id in ids:
        out = client.result(job_id, timeout=1)
        assert out.status == "completed"
    assert worker.stats == {"completed": 10, "failed": 1, "cancelled": 0, "expired": 0, "rejected": 0}
    assert all(len(v) == 1 for v in finals_by_id(r).values())
    assert_clean_queue(r)


def test_broken_engine_stops_the_worker_and_dead_letters_nothing(redis_url, r):
    """Every job failing alone means the engine is broken, not the jobs: stop, leave them for a healthy worker."""
    from pagedq.worker.assembly import Worker
    from pagedq.worker.service.recovery import EXIT_ENGINE_BROKEN

    client = Client(redis_url)
    prompts = [f"job {i}" for i in range(8)]
    prompts[3] = "the job that BREAKS the gpu"  # after it, every step fails, whatever the batch holds
    ids = [client.submit(prompt=p, max_tokens=4, temperature=0.0) for p in prompts]
    settings = fast_settings(name="w-broken", burst=True, max_attempts=3, engine_failure_limit=3)
    broken = Worker(FaultyEngine(StubEngine(), "BREAKS", mode="break"), r, settings)
    assert broken.run() == EXIT_ENGINE_BROKEN
    assert r.xlen(KEYS.dead) == 0 and finals_by_id(r) == {}
    assert r.xpending(KEYS.jobs, "workers")["pending"] == len(ids)  # unacknowledged: redelivered after the lease
    assert broken.stats == {"completed": 0, "failed": 0, "cancelled": 0, "expired": 0, "rejected": 0}
    time.sleep(1.1)  # past the 1 s lease
    healthy = run_burst(StubEngine(), redis_url, max_attempts=3)
    assert healthy.stats["completed"] == len(ids)
    attempts = []
    for job_id, prompt in zip(ids, prompts):
        res = client.result(job_id, timeout=1)
        assert res.status == "completed"
        assert (res.text, res.token_ids) == offline(prompt, max_tokens=4, temperature=0.0)
        attempts.append(res.attempts)
    # the failed batch, the lost run (charged on recovery), one run alone here; the 3 that also failed alone
    # on the broken worker have one run more
    assert sorted(attempts) == [2] * (len(ids) - 3) + [3] * 3
    assert_clean_queue(r)


def test_several_poison_jobs_at_once_are_dead_lettered_not_taken_for_a_broken_engine(redis_url, r):
    """Three poison jobs each fail alone in a row, as on a broken engine; the canary shows the engine works."""
    client = Client(redis_url)
    prompts = [f"fine {i}" if i % 3 else f"POISON {i}" for i in range(12)]
    ids = [client.submit(prompt=p, max_tokens=5, temperature=0.0) for p in prompts]
    worker = run_burst(FaultyEngine(StubEngine(), "POISON"), redis_url, max_attempts=2, engine_failure_limit=3)
    assert worker.exit_code == 0
    for job_id, prompt in zip(ids, prompts):
        res = client.result(job_id, timeout=1)
        if prompt.startswith("POISON"):
            assert res.status == "failed" and "injected fault" in res.error
        else:
            assert (res.status, res.text) == ("completed", offline(prompt, max_tokens=5, temperature=0.0)[0])
    assert r.xlen(KEYS.dead) == 4
    assert_clean_queue(r)


def test_max_attempts_counts_runs_and_never_condemns_a_job_for_deliveries_alone(redis_url, r):
    """max_attempts N: at most N runs. Deliveries to workers that died while the job only waited (or sat in a
    batch) are not held against it; runs alone that killed their worker (the runs hash) are."""
    client = Client(redis_url)
    waited = client.submit(prompt="only waited", max_tokens=3, temperature=0.0)
    killer = client.submit(prompt="killed two workers alone", max_tokens=3, temperature=0.0)
    r.xgroup_create(KEYS.jobs, "workers", id="0")
    entries = [e for e, _ in r.xreadgroup("workers", "dead-worker", {KEYS.jobs: ">"})[0][1]]
    for _ in range(4):  # four more deliveries to dead consumers
        r.xclaim(KEYS.jobs, "workers", "dead-worker", 0, entries)
    r.hset(KEYS.runs, killer, 2)  # it was started alone twice, and its worker died both times
    time.sleep(1.1)  # past the 1 s lease
    worker = run_burst(StubEngine(), redis_url, max_attempts=3)
    ok = client.result(waited, timeout=1)
    assert (ok.status, ok.text) == ("completed", offline("only waited", max_tokens=3, temperature=0.0)[0])
    assert ok.attempts == 2  # the lost run, charged on recovery, and this one
    res = client.result(killer, timeout=1)
    assert res.status == "failed" and res.attempts == 3 and "attempts 3, max_attempts 3" in res.error
    assert "died each time it ran alone" in res.error and res.token_ids == []
    assert worker.stats["completed"] == 1 and worker.stats["failed"] == 1
    assert r.xlen(KEYS.dead) == 1 and r.hlen(KEYS.runs) == 0
    assert_clean_queue(r)


def test_heartbeat_reports_the_worker(redis_url, r):
    client = Client(redis_url)
    client.submit(prompt="slow", max_tokens=300, temperature=0.0)
    engine = StubEngine(step_delay_s=0.01)
    with worker_thread(engine, redis_url, device="cpu", model="stub-model"):

        def beat():
            raw = r.get(KEYS.heartbeat("w-test"))
            return json.loads(raw) if raw and json.loads(raw)["running"] == 1 else None

        hb = wait_for(beat, timeout=5)
        assert hb["device"] == "cpu" and hb["model"] == "stub-model" and hb["queue"] == "default"
        assert 0 < hb["kv_utilization"] <= 1 and hb["total_blocks"] == engine.num_total_blocks
        assert 0 < r.ttl(KEYS.heartbeat("w-test")) <= 3
        assert r.zscore(KEYS.workers, "w-test") is not None
    assert r.get(KEYS.heartbeat("w-test")) is None  # removed on a clean stop


def test_a_raw_job_without_an_id_is_answered_under_its_stream_entry_id(redis_url, r):
    """What the wire protocol promises a producer in another language: XADD's reply is the id to wait on."""
    entry = r.xadd(KEYS.jobs, {"job": json.dumps({"prompt": "no id given", "max_tokens": 4, "temperature": 0})})
    entry = entry.decode()
    cancelled = r.xadd(KEYS.jobs, {"job": json.dumps({"prompt": "cancel me", "max_tokens": 4})}).decode()
    r.zadd(KEYS.cancelled, {cancelled: time.time()})  # the raw way to cancel, by the same id
    run_burst(StubEngine(), redis_url)
    record = json.loads(r.get(KEYS.final(entry)))
    assert record["id"] == entry and record["status"] == "completed"
    assert record["text"] == offline("no id given", max_tokens=4, temperature=0.0)[0]
    assert json.loads(r.get(KEYS.final(cancelled)))["status"] == "cancelled"
    assert set(finals_by_id(r)) == {entry, cancelled}
    assert_clean_queue(r)


def test_scripts_are_reloaded_after_redis_forgets_them(redis_url, r):
    """SCRIPT FLUSH is what a restarted Redis looks like: every script call reloads and goes on (scripts.call)."""
    client = Client(redis_url, max_queue_depth=10)
    r.script_flush()
    job_id = client.submit(prompt="after a flush", max_tokens=3, temperature=0.0)
    r.script_flush()
    assert client.cancel(job_id) is True
    r.script_flush()
    run_burst(StubEngine(), redis_url)
    assert client.result(job_id, timeout=1).status == "cancelled"
    r.script_flush()
    assert client.cancel(job_id) is False
