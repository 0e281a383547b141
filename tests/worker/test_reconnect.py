"""Redis goes away under a working worker and comes back: nothing is lost, nothing is finalised twice.

The server persists every write (AOF, fsync always) and is killed with SIGKILL mid-run, then restarted on
the same port. Oracles: the stub engine's offline output and the completions stream of the real server.
"""

from __future__ import annotations

import threading
import time

import pytest
from redis import Redis

from pagedq.worker import Client
from pagedq.worker.assembly import Worker
from pagedq.worker.ops.embedded_redis import EmbeddedRedis
from pagedq.worker.service.recovery import EXIT_REDIS_LOST
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import (
    KEYS,
    REDIS_SERVERS,
    assert_clean_queue,
    fast_settings,
    finals_by_id,
    offline,
    scrape,
    wait_for,
    worker_thread,
)


@pytest.fixture(params=sorted(REDIS_SERVERS))
def durable_redis(request):
    server = EmbeddedRedis(
        binary=REDIS_SERVERS[request.param], extra_args=("--appendonly", "yes", "--appendfsync", "always")
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_worker_rides_out_a_redis_restart(durable_redis):
    client = Client(durable_redis.url)
    prompts = [f"outage {i}" for i in range(12)]
    ids = [client.submit(prompt=p, max_tokens=60, temperature=0.0, stream=True) for p in prompts]
    with worker_thread(
        StubEngine(step_delay_s=0.02), durable_redis.url, redis_outage_s=30.0, metrics_port=0, metrics_every_s=0.1
    ) as worker:
        wait_for(lambda: worker.tokens_generated > 0, what="generation to start")
        durable_redis.kill()
        before = worker.tokens_generated
        wait_for(lambda: worker.tokens_generated > before + 12 * 5, what="generation to go on without Redis")
        durable_redis.relaunch()
        r = Redis.from_url(durable_redis.url)
        wait_for(lambda: len(finals_by_id(r)) == len(ids), timeout=30, what="every final record")
        assert worker.num_redis_outages >= 1 and worker.exit_code == 0
        counted = ("pagedq_redis_outages_total", ())
        wait_for(
            lambda: scrape(worker.metrics.port).get(counted) == worker.num_redis_outages,
            what="the outage counted in the metrics",
        )
    assert all(len(records) == 1 for records in finals_by_id(r).values())
    for job_id, prompt in zip(ids, prompts):
        res = client.result(job_id, timeout=1)
        text, tokens = offline(prompt, max_tokens=60, temperature=0.0)
        assert (res.status, res.text, res.token_ids) == ("completed", text, tokens)
        assert "".join(d.text for d in client.stream(job_id, timeout=1)) == text  # deltas deduplicated by pos
    assert_clean_queue(r)


def test_worker_gives_up_after_the_outage_limit_and_leaves_its_jobs(durable_redis):
    client = Client(durable_redis.url)
    ids = [client.submit(prompt=f"lost {i}", max_tokens=500, temperature=0.0) for i in range(4)]
    worker = Worker(StubEngine(step_delay_s=0.02), Redis.from_url(durable_redis.url), fast_settings(redis_outage_s=0.5))

    def kill_once_generating() -> None:
        wait_for(lambda: worker.tokens_generated > 0, what="generation to start")
        durable_redis.kill()

    killer = threading.Thread(target=kill_once_generating)
    killer.start()
    started = time.monotonic()
    assert worker.run() == EXIT_REDIS_LOST
    killer.join()
    assert time.monotonic() - started < 20
    durable_redis.relaunch()
    r = Redis.from_url(durable_redis.url)
    assert finals_by_id(r) == {}  # nothing settled: the jobs wait, unacknowledged, for the next worker
    assert r.xpending(KEYS.jobs, "workers")["pending"] == len(ids)
