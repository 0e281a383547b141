"""One priority sense end to end: the gateway's `priority` is vLLM's (lower is served sooner), the native job's field
keeps its wire sense (higher sooner), and a gateway request of priority p is served exactly as a native job of
priority -p. Oracle: the order the jobs complete in on an engine with one seat (the stub's waiting queue orders by
the engine priority the worker gives each job, vLLM's sense as the real engine's)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
from redis import Redis

from pagedq.worker import Client
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.testing.stub_engine import StubEngine

from .conftest import gateway_thread, wait_for, worker_thread


def test_a_gateway_priority_is_the_native_jobs_negated_in_service_order(redis_url):
    engine = StubEngine(max_num_seqs=1, step_delay_s=0.01)
    r, keys = Redis.from_url(redis_url), QueueKeys("default")
    with (
        worker_thread(engine, redis_url, model="stub"),
        gateway_thread(redis_url) as base,
        ThreadPoolExecutor(4) as pool,
    ):
        sdk = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        wait_for(lambda: sdk.models.list().data, what="a live worker")
        client = Client(redis_url)
        blocker = client.submit(prompt="hold the seat", max_tokens=2000, ignore_eos=True)
        wait_for(lambda: engine.has_unfinished_requests() and not engine.num_waiting_requests, what="the blocker")

        def via_gateway(priority: int) -> str:
            answer = sdk.completions.create(
                model="stub", prompt=f"gateway {priority}", max_tokens=2, extra_body={"priority": priority}
            )
            return answer.id.removeprefix("cmpl-")

        # (front door, priority in its own sense), mostly the last served first; each reaches the engine's
        # waiting queue before the next is sent, so read order breaks the one tie
        arrivals = [("gateway", -1), ("native", 3), ("native", 4), ("gateway", -5), ("native", 5)]
        ids: dict[tuple[str, int], str] = {}
        futures = {}
        for waiting, (door, priority) in enumerate(arrivals, 1):
            if door == "gateway":
                futures[(door, priority)] = pool.submit(via_gateway, priority)
            else:
                ids[(door, priority)] = client.submit(prompt=f"native {priority}", max_tokens=2, priority=priority)
            wait_for(lambda n=waiting: engine.num_waiting_requests == n, what=f"{door} {priority} waiting")
        client.cancel(blocker)
        ids.update({key: future.result(timeout=30) for key, future in futures.items()})
        wait_for(lambda: all(client.result(i, timeout=5).status == "completed" for i in ids.values()), what="all")
    served = [fields[b"id"].decode() for _, fields in r.xrange(keys.completions)]
    by_id = {job_id: key for key, job_id in ids.items()}
    order = [by_id[job_id] for job_id in served if job_id in by_id]
    # gateway -5 ties native 5 (read order), and goes ahead of native 4 as native 3 goes ahead of gateway -1
    assert order == [("gateway", -5), ("native", 5), ("native", 4), ("native", 3), ("gateway", -1)]
