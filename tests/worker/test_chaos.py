"""Chaos on a real Redis: two workers, random jobs (poison ones among them), priorities, streams, deadlines
and cancels at random moments. Whatever happens, every job ends with exactly one final record whose status
it could have (a completed one equal to the stub engine's offline output), and the queue ends clean."""

from __future__ import annotations

import random
import threading
import time

import pytest
from redis import Redis

from pagedq.worker import Client
from pagedq.worker.assembly import Worker
from pagedq.worker.testing.faults import FaultyEngine
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, fast_settings, finals_by_id, offline, wait_for


def _submit_random_jobs(client: Client, rng: random.Random, seed: int) -> dict[str, dict]:
    jobs: dict[str, dict] = {}
    for i in range(rng.randint(20, 60)):
        job = dict(
            prompt=f"job {seed}-{i}" + (" POISON" if rng.random() < 0.05 else ""),
            max_tokens=rng.randint(1, 40),
            temperature=0.0,
            stream=rng.random() < 0.5,
            priority=rng.randint(-2, 2),
        )
        if rng.random() < 0.15:
            job["deadline"] = time.time() + rng.uniform(0.0, 0.5)
        jobs[client.submit(**job)] = job
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0, 0.05))
        if rng.random() < 0.15:
            victim = rng.choice(list(jobs))
            jobs[victim]["cancelled"] = True
            client.cancel(victim)
    return jobs


def _check_final(job: dict, records: list[dict]) -> None:
    assert len(records) == 1, f"{job['prompt']}: {len(records)} final records"
    status = records[0]["status"]
    if "POISON" in job["prompt"]:
        assert status in ("failed", "cancelled", "expired"), job
    elif status == "completed":
        expected = offline(job["prompt"], max_tokens=job["max_tokens"], temperature=0.0)
        assert (records[0]["text"], records[0]["token_ids"]) == expected, job
    else:
        assert (status == "cancelled" and job.get("cancelled")) or (status == "expired" and "deadline" in job), (
            job,
            records[0],
        )


@pytest.mark.parametrize("seed", [5, 21])  # 21: three poison jobs fail alone in a row (the breaker's canary)
def test_two_workers_under_random_traffic_settle_every_job_once(redis_url, r, seed):
    rng = random.Random(seed)
    client = Client(redis_url)
    workers = [
        Worker(
            FaultyEngine(StubEngine(step_delay_s=0.002, num_kv_blocks=rng.choice([64, 4096])), "POISON"),
            Redis.from_url(redis_url),
            fast_settings(name=f"w{i}", max_attempts=3, max_waiting=rng.choice([4, 64])),
        )
        for i in range(2)
    ]
    threads = [threading.Thread(target=worker.run, daemon=True) for worker in workers]
    for thread in threads:
        thread.start()
    try:
        jobs = _submit_random_jobs(client, rng, seed)
        wait_for(lambda: len(finals_by_id(r)) >= len(jobs), timeout=60, what="a final record for every job")
    finally:
        for worker in workers:
            worker.request_stop(drain_timeout_s=2.0)
        for thread in threads:
            thread.join(timeout=20)
    assert [worker.exit_code for worker in workers] == [0, 0]
    finals = finals_by_id(r)
    assert set(finals) == set(jobs)
    for job_id, job in jobs.items():
        _check_final(job, finals[job_id])
    assert r.xlen(KEYS.jobs) == 0 and r.xpending(KEYS.jobs, "workers")["pending"] == 0
