"""The queue on a real Redis Cluster, with the queue's slot on each master in turn and the client connected
through a node that does not own it: submit, stream, result, cancel, status, dlq; the worker in-process in
burst mode on the stub engine. Oracle: the stub engine's offline answer and what the owning node stores."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import pytest
from redis import Redis
from redis.cluster import RedisCluster, key_slot
from redis.exceptions import MovedError

from pagedq.worker.assembly import Worker
from pagedq.worker.client.sync_client import Client
from pagedq.worker.ops import dlq, status
from pagedq.worker.protocol.connection import connect
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.engine_api import RequestOutputKind, SamplingParams
from pagedq.worker.testing.faults import FaultyEngine
from pagedq.worker.testing.stub_engine import StubEngine

from ..worker.helpers import running
from .conftest import Cluster


def settings(queue: str, **overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = dict(
        queue=queue,
        name=f"w-{queue}",
        lease_ms=1000,
        block_ms=100,
        heartbeat_every_s=0.5,
        drain_timeout_s=5.0,
        burst=True,
    )
    values.update(overrides)
    return WorkerSettings(**values)


def run_burst(url: str, queue: str, engine: Any = None, **overrides: Any) -> Worker:
    worker = Worker(engine or StubEngine(), connect(url), settings(queue, **overrides))
    assert worker.run() == 0
    return worker


def offline(prompt: str, **sampling: Any) -> str:
    """The stub engine's answer for the prompt run alone (the oracle for what the worker publishes)."""
    engine = StubEngine()
    engine.add_request("x", prompt, SamplingParams(**sampling, output_kind=RequestOutputKind.CUMULATIVE))
    while True:
        for out in engine.step():
            if out.finished:
                return out.outputs[0].text


def owner(cluster: Cluster, queue: str) -> Redis:
    """A plain client of the master that owns the queue's slot (to check what is really stored there)."""
    return Redis(port=cluster.owner_of(key_slot(QueueKeys(queue).jobs.encode())))


def test_the_url_names_a_node_that_does_not_own_the_queue(cluster: Cluster, queue: str, url: str) -> None:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert port != cluster.owner_of(key_slot(QueueKeys(queue).jobs.encode()))
    with pytest.raises(MovedError):  # what a plain client gets there: the bug of issue 12
        Redis(port=port).xlen(QueueKeys(queue).jobs)


def test_submit_stream_result_through_a_node_that_does_not_own_the_slot(cluster, queue, url) -> None:
    client = Client(url, queue)
    assert isinstance(client.r, RedisCluster)
    streamed = client.submit("hello cluster", max_tokens=12, temperature=0, stream=True)
    plain = client.submit("second job", max_tokens=5, temperature=0, band="bulk")
    assert client.queue_depth() == 2
    worker = run_burst(url, queue)
    assert worker.stats["completed"] == 2
    deltas = list(client.stream(streamed, timeout=5))
    record = client.result(streamed, timeout=5)
    assert record.status == "completed" and record.text == offline("hello cluster", max_tokens=12, temperature=0)
    assert "".join(d.text for d in deltas) == record.text and len(deltas) > 1
    assert client.result(plain, timeout=5).text == offline("second job", max_tokens=5, temperature=0)
    stored = owner(cluster, queue)  # the records are on the slot's owner, every job entry acked and deleted
    assert stored.exists(QueueKeys(queue).final(streamed)) and stored.xlen(QueueKeys(queue).jobs) == 0
    assert client.queue_depth() == 0
    client.close()


def test_cancel_a_running_job(cluster, queue, url) -> None:
    client = Client(url, queue)
    job_id = client.submit("long one", max_tokens=1000, temperature=0, stream=True)
    assert not client.cancel("never-submitted")
    with running(Worker(StubEngine(step_delay_s=0.01), connect(url), settings(queue, burst=False))):
        first = next(iter(client.stream(job_id, timeout=10)))  # it runs
        assert first.token_ids
        assert client.cancel(job_id)
        record = client.result(job_id, timeout=10)
    assert record.status == "cancelled" and 0 < len(record.token_ids) < 1000
    assert record.text == offline("long one", max_tokens=len(record.token_ids), temperature=0)
    assert not client.cancel(job_id)  # finished: nothing to cancel
    client.close()


def test_status_shows_the_queue_and_its_worker(cluster, queue, url, capsys) -> None:
    client = Client(url, queue)
    client.submit("one", max_tokens=3)
    with running(Worker(StubEngine(), connect(url), settings(queue, burst=False))) as worker:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not worker.stats["completed"]:
            time.sleep(0.02)
        st = status.queue_status(client.r, queue)
        assert [w["worker"] for w in st["workers"]] == [f"w-{queue}"] and st["workers"][0]["state"] == "running"
        assert queue in status.discover_queues(client.r)  # SCAN over every master finds it
        assert status.run(argparse.Namespace(redis=url, queue=[queue], json=True)) == 0
    shown = _json_line(capsys.readouterr().out)["queues"][0]
    assert shown["queue"] == queue and shown["depth"] == 0 and shown["workers"][0]["state"] == "running"
    client.close()


def _json_line(out: str, start: str = "{") -> Any:
    """The JSON document a command printed (the worker's log lines share stdout)."""
    return json.loads(next(line for line in out.splitlines() if line.startswith(start)))


def test_status_of_a_queue_before_any_worker_shows_nothing_pending(queue, url) -> None:
    Client(url, queue).submit("waiting", max_tokens=3)
    st = status.queue_status(connect(url), queue)  # no consumer group yet: NOGROUP answers are zero pending
    assert st["depth"] == 1 and st["pending"] == 0 and st["undelivered"] == 1 and st["workers"] == []


def test_dlq_list_retry_purge(cluster, queue, url, capsys) -> None:
    client = Client(url, queue)
    poison = client.submit("this is POISON", max_tokens=3, metadata={"k": 1})
    engine = FaultyEngine(StubEngine(), "POISON")
    run_burst(url, queue, engine, max_attempts=1)
    assert client.result(poison, timeout=5).status == "failed"
    r = connect(url)
    assert [letter["id"] for letter in dlq.dead_letters(r, queue)] == [poison]
    assert dlq.run(argparse.Namespace(action="list", job_ids=[], all=False, redis=url, queue=queue, json=True)) == 0
    assert [x["id"] for x in _json_line(capsys.readouterr().out, "[")] == [poison]
    assert dlq.retry(r, queue) == [poison]
    assert client.final(poison) is None and client.queue_depth() == 1  # old record gone, enqueued again
    run_burst(url, queue)  # a healthy engine this time
    assert client.result(poison, timeout=5).status == "completed"
    assert dlq.purge(r, queue) == 0
    client.close()


def test_a_draining_worker_hands_back_its_jobs_on_the_queue_s_slot(cluster, queue, url) -> None:
    """The hand-back script (one band stream per call) on each master: what the drain cut off or never started is
    claimable or readable at once, and a second worker finishes every job once."""
    client = Client(url, queue)
    prompts = {client.submit(f"drain {i}", max_tokens=30, temperature=0): f"drain {i}" for i in range(6)}
    first = Worker(
        StubEngine(max_num_seqs=2, step_delay_s=0.02), connect(url), settings(queue, burst=False, lease_ms=600_000)
    )
    with running(first):
        deadline = time.monotonic() + 10
        while not any(t.started for t in first.held) and time.monotonic() < deadline:
            time.sleep(0.01)
        first.request_stop(drain_timeout_s=0.05)
    keys = QueueKeys(queue)
    stored = owner(cluster, queue)
    pending = stored.xpending_range(keys.jobs, "workers", min="-", max="+", count=100)
    assert all(entry["time_since_delivered"] >= 600_000 for entry in pending)  # the ones that ran: released
    second = run_burst(url, queue, name=f"second-{queue}", lease_ms=600_000)
    assert second.stats["completed"] + first.stats["completed"] == len(prompts)
    for job_id, prompt in prompts.items():
        record = client.result(job_id, timeout=5)
        assert record.status == "completed" and record.text == offline(prompt, max_tokens=30, temperature=0)
    assert stored.xlen(keys.jobs) == 0 and stored.xpending(keys.jobs, "workers")["pending"] == 0
    client.close()
