"""A draining worker hands back the leases it holds: jobs it read ahead but never started go back to the stream at
once (not after lease_ms), and the next worker runs them as new jobs, once each. Oracle: Redis' pending list, the
completions stream and the stub engine's offline output."""

from __future__ import annotations

import threading

from redis import Redis

from pagedq.worker import Client
from pagedq.worker.assembly import Worker
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, assert_clean_queue, fast_settings, finals_by_id, offline, wait_for

LONG_LEASE_MS = 600_000  # no lease can run out within the test: whatever the next worker gets was handed back


def test_unstarted_jobs_are_handed_back_at_drain_and_run_once_by_the_next_worker(redis_url, r):
    client = Client(redis_url)
    prompts = {client.submit(f"drain {i}", max_tokens=6, temperature=0.0): f"drain {i}" for i in range(24)}
    engine = StubEngine(max_num_seqs=2, step_delay_s=0.02)
    # read ahead both ways: into the engine's waiting queue (max_waiting) and held past it (tenant_read_ahead)
    settings = fast_settings(name="first", lease_ms=LONG_LEASE_MS, max_waiting=8, tenant_read_ahead=4)
    first = Worker(engine, Redis.from_url(redis_url), settings)
    thread = threading.Thread(target=first.run, daemon=True)
    thread.start()
    wait_for(lambda: r.xlen(KEYS.completions) >= 2, timeout=10, what="the first jobs done")
    wait_for(
        lambda: engine.num_waiting_requests >= 6 and first.held.waiting(), timeout=10, what="jobs read ahead, not run"
    )
    done_at_stop = r.xlen(KEYS.completions)
    first.request_stop(drain_timeout_s=10.0)  # long enough to finish what runs
    thread.join(timeout=10)
    assert not thread.is_alive() and first.exit_code == 0
    done_by_first = set(finals_by_id(r))
    # the drain finished the two running jobs (and at most two more started before it saw the stop), not the
    # six or more waiting in the engine
    assert len(done_by_first) <= done_at_stop + 4
    # nothing stays leased to the stopped worker: the rest waits in the stream, undelivered
    assert r.xpending(KEYS.jobs, "workers")["pending"] == 0
    assert r.xlen(KEYS.jobs) == len(prompts) - len(done_by_first)

    second = Worker(
        StubEngine(), Redis.from_url(redis_url), fast_settings(name="second", lease_ms=LONG_LEASE_MS, burst=True)
    )
    thread = threading.Thread(target=second.run, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the next worker waited for a lease: the drained worker kept its jobs"

    finals = finals_by_id(r)
    assert set(finals) == set(prompts), "a job was lost"
    assert all(len(records) == 1 for records in finals.values()), "a job got two final records"
    for job_id, records in finals.items():
        assert records[0]["status"] == "completed"
        assert records[0]["text"] == offline(prompts[job_id], max_tokens=6, temperature=0.0)[0]
        assert records[0]["worker"] == ("first" if job_id in done_by_first else "second")
    assert r.hlen(KEYS.runs) == 0, "a handed-back job was taken for a dead worker's suspect and run alone"
    assert_clean_queue(r)


def test_jobs_cut_off_by_the_drain_timeout_are_claimable_at_once(redis_url, r):
    client = Client(redis_url)
    prompts = {client.submit(f"cut {i}", max_tokens=40, temperature=0.0): f"cut {i}" for i in range(6)}
    engine = StubEngine(max_num_seqs=2, step_delay_s=0.02)
    first = Worker(engine, Redis.from_url(redis_url), fast_settings(name="first", lease_ms=LONG_LEASE_MS))
    thread = threading.Thread(target=first.run, daemon=True)
    thread.start()
    wait_for(lambda: any(t.started for t in first.held), timeout=10, what="jobs generating")
    first.request_stop(drain_timeout_s=0.05)  # far shorter than a job: the running ones are cut off
    thread.join(timeout=10)
    assert not thread.is_alive()
    cut = r.xpending_range(KEYS.jobs, "workers", min="-", max="+", count=100, consumername="first")
    assert cut, "the drain timeout should have cut running jobs off"
    # still pending (they ran: the next worker takes them as recovered suspects), but idle past the lease already
    assert all(entry["time_since_delivered"] >= LONG_LEASE_MS for entry in cut)

    second = Worker(
        StubEngine(), Redis.from_url(redis_url), fast_settings(name="second", lease_ms=LONG_LEASE_MS, burst=True)
    )
    thread = threading.Thread(target=second.run, daemon=True)
    thread.start()
    thread.join(timeout=15)
    assert not thread.is_alive(), "the next worker waited for a lease: the cut-off jobs were not handed back"
    finals = finals_by_id(r)
    assert set(finals) == set(prompts) and all(len(records) == 1 for records in finals.values())
    for job_id, records in finals.items():
        assert records[0]["text"] == offline(prompts[job_id], max_tokens=40, temperature=0.0)[0]
    assert_clean_queue(r)
