"""Operations: the Prometheus endpoint scraped over HTTP and parsed with prometheus_client's parser, checked
against the final records, the engine and Redis; `pagedq status` against a live worker; `pagedq dlq`."""

from __future__ import annotations

import json
import time

import pytest

from pagedq.worker import Client
from pagedq.worker.testing.faults import FaultyEngine
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, run_burst, run_cli, scrape, wait_for, worker_thread

DEFAULT = (("band", "default"),)  # the per-band series of the default band


def test_metrics_endpoint_matches_reality(redis_url, r):
    client = Client(redis_url)
    ids = client.submit_many([dict(prompt=f"m {i}", max_tokens=2 + i % 5, temperature=0) for i in range(20)])
    client.submit(prompt="POISON pill", max_tokens=3)
    engine = FaultyEngine(StubEngine(step_delay_s=0.002, num_kv_blocks=512, max_num_seqs=1), "POISON")
    with worker_thread(engine, redis_url, metrics_port=0, metrics_every_s=0.05, max_attempts=1) as worker:
        port = worker.metrics.port
        assert worker.metrics.server.server_address[0] == "127.0.0.1"  # no authentication: local by default

        def settled():
            m = scrape(port)
            return (
                m
                if (
                    m.get(("pagedq_jobs_finished_total", (("status", "completed"),))) == 20
                    and m.get(("pagedq_dead_letters", DEFAULT)) == 1
                    # counters move when the worker settles a job; gauges when it next samples (metrics_every_s):
                    # the scrape that counts all 21 may precede either, so wait for both to be in
                    and m.get(("pagedq_jobs_finished_total", (("status", "failed"),))) == 1
                    and m.get(("pagedq_kv_blocks_free", ())) == 512
                    and m.get(("pagedq_queue_depth", DEFAULT)) == 0
                )
                else None
            )

        m = wait_for(settled, timeout=20, what="20 completed, 1 dead-lettered and the cache free in the metrics")
        finals = [client.result(j, timeout=1) for j in ids]
        tokens = sum(f.usage.completion_tokens for f in finals)
        assert m[("pagedq_generated_tokens_total", ())] == tokens
        assert m[("pagedq_jobs_finished_total", (("status", "failed"),))] == 1
        assert m[("pagedq_time_to_first_token_seconds_count", DEFAULT)] == 20
        assert m[("pagedq_e2e_latency_seconds_count", DEFAULT)] == 20
        assert abs(m[("pagedq_e2e_latency_seconds_sum", DEFAULT)] - sum(f.timings.total for f in finals)) < 1e-3
        assert m[("pagedq_kv_blocks", ())] == 512 and m[("pagedq_kv_blocks_free", ())] == 512
        assert m[("pagedq_queue_depth", DEFAULT)] == r.xlen(KEYS.jobs) == 0
        assert m[("pagedq_preemptions_total", ())] == 0

        # a long job running (one at a time): gauges follow the engine; jobs behind it show as depth
        long_id = client.submit(prompt="long", max_tokens=1500, temperature=0)
        wait_for(lambda: engine.num_running_requests == 1, what="the long job running")
        held = client.submit_many([dict(prompt=f"q {i}", max_tokens=2) for i in range(3)])

        def busy():
            m = scrape(port)
            return (
                m
                if (
                    m[("pagedq_running_requests", ())] == 1
                    and m[("pagedq_queue_depth", DEFAULT)] == 4
                    and m[("pagedq_held_jobs", ())] == 4
                    # the queue's gauges come from one Redis round trip and the worker's from its own snapshot,
                    # taken at different moments: wait until the delivery shows in both
                    and m[("pagedq_pending_jobs", DEFAULT)] == 4
                )
                else None
            )

        m = wait_for(busy, timeout=10, what="running job and queue depth in the metrics")
        used = engine.num_total_blocks - engine.num_free_blocks
        assert m[("pagedq_kv_blocks_used", ())] == used > 0  # constant while the one job runs
        assert m[("pagedq_waiting_requests", ())] == 3 and m[("pagedq_pending_jobs", DEFAULT)] == 4
        assert m[("pagedq_pending_jobs", DEFAULT)] + m[("pagedq_queue_lag", DEFAULT)] == 4
        assert m[("pagedq_queue_oldest_job_age_seconds", DEFAULT)] >= 0
        assert m[("pagedq_kv_slot_utilization", ())] > 0
        client.cancel(long_id)
        for job_id in held:
            assert client.result(job_id, timeout=10).status == "completed"


def test_latency_per_band_and_every_workers_heartbeat_in_the_metrics(redis_url, r):
    """Each band's histograms count its own jobs (summed from the final records); the heartbeat gauge is the
    workers set's score for each worker, and a worker that left the set loses its series."""
    client = Client(redis_url)
    priorities = {"interactive": 1, "default": 0, "bulk": -1}
    ids = {
        band: client.submit_many([dict(prompt=f"{band} {i}", max_tokens=3, priority=p) for i in range(n)])
        for (band, p), n in zip(priorities.items(), (3, 2, 1))
    }
    elsewhere = time.time() - 60  # another worker's last beat; "long-gone" beat beyond the hour exported
    r.zadd(KEYS.workers, {"elsewhere": elsewhere, "long-gone": time.time() - 7200})
    with worker_thread(StubEngine(), redis_url, metrics_port=0, metrics_every_s=0.05, name="beating") as worker:
        counts = {band: len(ids[band]) for band in priorities}

        def settled():
            m = scrape(worker.metrics.port)
            done = all(m.get(("pagedq_e2e_latency_seconds_count", (("band", b),))) == n for b, n in counts.items())
            return m if done and ("pagedq_worker_heartbeat_timestamp_seconds", (("worker", "beating"),)) in m else None

        m = wait_for(settled, timeout=20, what="every band's jobs in its histograms, and this worker's heartbeat")
        for band, job_ids in ids.items():
            finals = [client.result(j, timeout=1) for j in job_ids]
            labels = (("band", band),)
            assert m[("pagedq_time_to_first_token_seconds_count", labels)] == len(job_ids)
            assert abs(m[("pagedq_e2e_latency_seconds_sum", labels)] - sum(f.timings.total for f in finals)) < 1e-3
        beats = {dict(k[1])["worker"]: v for k, v in m.items() if k[0] == "pagedq_worker_heartbeat_timestamp_seconds"}
        assert beats.keys() == {"beating", "elsewhere"}  # "long-gone" is older than the window
        assert beats["elsewhere"] == elsewhere and abs(beats["beating"] - r.zscore(KEYS.workers, "beating")) < 6
        r.zrem(KEYS.workers, "elsewhere")
        wait_for(
            lambda: all(dict(k[1]).get("worker") != "elsewhere" for k in scrape(worker.metrics.port)),
            timeout=10,
            what="the series of a worker that left the set removed",
        )


@pytest.mark.slow
def test_status_against_a_live_worker(redis_url, r):
    client = Client(redis_url)
    long_id = client.submit(prompt="keeps running", max_tokens=1500, temperature=0)
    client.submit(messages=[{"role": "user", "content": "hi"}], max_tokens=2)  # no chat template: rejected
    engine = StubEngine(step_delay_s=0.005)
    with worker_thread(engine, redis_url, device="cpu", model="stub-model", name="status-w"):
        wait_for(
            lambda: (
                json.loads(r.get(KEYS.heartbeat("status-w")) or b"{}").get("running") == 1
                and json.loads(r.get(KEYS.heartbeat("status-w")))["rejected"] == 1
            ),
            timeout=10,
            what="a heartbeat with the job running and one rejected",
        )
        client.submit_many([dict(prompt=f"later {i}", max_tokens=2) for i in range(2)])
        r.xadd(
            KEYS.dead,
            {
                "id": "old-dead",
                "data": json.dumps({"job": {"id": "old-dead", "prompt": "x"}, "error": "boom", "attempts": 4}),
            },
        )
        proc = run_cli("status", "--redis", redis_url, "--json", timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        (queue,) = json.loads(proc.stdout)["queues"]
        assert queue["queue"] == "default" and queue["depth"] == r.xlen(KEYS.jobs) >= 1
        assert queue["dead_letters"] == 1 and queue["pending"] + queue["undelivered"] == queue["depth"]
        (w,) = queue["workers"]
        assert (w["worker"], w["state"], w["device"], w["model"], w["running"]) == (
            "status-w",
            "running",
            "cpu",
            "stub-model",
            1,
        )
        assert 0 <= w["heartbeat_age_s"] < 3 and 0 < w["kv_utilization"] <= 1 and w["rejected"] == 1
        table = run_cli("status", "--redis", redis_url, timeout=60)
        assert table.returncode == 0
        assert "status-w" in table.stdout and "stub-model" in table.stdout and "dead letters 1" in table.stdout
        header, row = (line.split() for line in table.stdout.splitlines() if "WORKER" in line or "status-w" in line)
        header = [h for h in header if h not in ("AGE", "USED")]  # "BEAT AGE" and "KV USED" are one column each
        assert dict(zip(header, row))["REJECTED"] == "1"
        client.cancel(long_id)


@pytest.mark.slow
def test_dlq_list_retry_purge(redis_url, r):
    client = Client(redis_url)
    poison = client.submit(prompt="POISON here", max_tokens=3, temperature=0)
    other = client.submit(prompt="POISON too", max_tokens=3, temperature=0)
    run_burst(FaultyEngine(StubEngine(), "POISON"), redis_url, max_attempts=1)
    assert client.result(poison, timeout=1).status == "failed" and r.xlen(KEYS.dead) == 2
    listed = run_cli("dlq", "list", "--redis", redis_url, "--json", timeout=60)
    letters = json.loads(listed.stdout)  # one JSON array
    assert {(d["id"], d["job"]["prompt"]) for d in letters} == {(poison, "POISON here"), (other, "POISON too")}
    assert all("injected fault" in d["error"] for d in letters)
    assert run_cli("dlq", "purge", "--redis", redis_url, timeout=60).returncode != 0  # ids or --all required
    retried = run_cli("dlq", "retry", poison, "--redis", redis_url, timeout=60)
    assert retried.returncode == 0 and poison in retried.stdout
    assert r.xlen(KEYS.dead) == 1 and r.get(KEYS.final(poison)) is None  # a fresh attempt
    run_burst(StubEngine(), redis_url)  # the fault is fixed: the retried job completes
    res = client.result(poison, timeout=1)
    assert res.status == "completed" and res.attempts == 1
    purged = run_cli("dlq", "purge", "--all", "--redis", redis_url, timeout=60)
    assert purged.returncode == 0 and "purged 1" in purged.stdout and r.xlen(KEYS.dead) == 0
    empty = run_cli("dlq", "list", "--redis", redis_url, "--json", timeout=60)
    assert empty.returncode == 0 and json.loads(empty.stdout) == []
