"""AsyncClient against a live worker (stub engine in a thread): submit, stream, result, cancel, queue limit."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedq.worker import AsyncClient, Client, JobRejected, QueueFullError
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import worker_thread


@pytest.mark.parametrize("shared_reads", [False, True], ids=["own-reads", "shared-reads"])
def test_async_client_end_to_end(redis_url, shared_reads):
    async def scenario() -> None:
        async with AsyncClient(redis_url, shared_reads=shared_reads, read_buffer=2) as client:
            with pytest.raises(JobRejected, match="top_k"):
                await client.submit(prompt="x", top_k=-5)
            streamed = await client.submit(prompt="async stream", max_tokens=6, temperature=0.0, stream=True)
            plain = await client.submit_many(
                [dict(prompt=f"async {i}", max_tokens=3, temperature=0.0) for i in range(5)]
            )
            slow = await client.submit(prompt="async slow", max_tokens=5000, temperature=0.0)
            deltas = [d async for d in client.stream(streamed, timeout=10)]
            final = await client.result(streamed, timeout=10)
            assert final.ok and "".join(d.text for d in deltas) == final.text and len(final.token_ids) == 6
            results = await asyncio.gather(*(client.result(j, timeout=10) for j in plain))
            assert [len(res.token_ids) for res in results] == [3] * 5
            sync = Client(redis_url)  # same records through the sync client
            assert sync.result(plain[0], timeout=1).text == results[0].text
            assert await client.cancel(slow)
            cancelled = await client.result(slow, timeout=10)
            assert cancelled.status == "cancelled" and len(cancelled.token_ids) < 5000
            assert await client.queue_depth() == 0
        async with AsyncClient(redis_url, queue="small", max_queue_depth=1) as small:
            await small.submit(prompt="one")
            with pytest.raises(QueueFullError):
                await small.submit(prompt="two")

    with worker_thread(StubEngine(step_delay_s=0.002, max_model_len=10_000), redis_url):
        asyncio.run(scenario())


class SyncBehindAsync:
    """The sync Client behind AsyncClient's interface, so one scenario drives both."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def __getattr__(self, name: str):
        method = getattr(self.client, name)

        async def call(*args, **kwargs):
            return method(*args, **kwargs)

        return call

    async def stream(self, *args, **kwargs):
        for delta in self.client.stream(*args, **kwargs):
            yield delta


async def scenario(client, r, queue: str) -> list:
    """Every public call, good and bad, against a real Redis with no worker: what each returned or raised."""
    from pagedq.worker.protocol.errors import ResultTimeout
    from pagedq.worker.protocol.keys import QueueKeys

    keys, seen = QueueKeys(queue), []

    async def attempt(coro):
        try:
            seen.append(("ok", await coro))
        except (JobRejected, QueueFullError, ResultTimeout) as exc:
            seen.append((type(exc).__name__, str(exc), getattr(exc, "depth", None), getattr(exc, "stream", None)))

    await attempt(client.submit(prompt="a", job_id="j1", max_tokens=3, priority=5))
    await attempt(client.submit_many([dict(id="j2", prompt="b", band="bulk"), dict(id="j3", prompt="c")]))
    await attempt(client.submit(prompt="x", job_id="j4", top_k=-5))
    await attempt(client.submit(prompt="x", job_id="j5", band="nowhere"))
    await attempt(client.submit_many([dict(id="j6", prompt="d"), dict(id="j7", prompt="e")]))  # 2 > room of 1
    await attempt(client.submit(prompt="f", job_id="j8"))
    await attempt(client.submit(prompt="g", job_id="j9"))  # the default band is full now
    await attempt(client.queue_depth())
    await attempt(client.queue_depth("bulk"))
    await attempt(client.cancel("j1"))
    await attempt(client.cancel("never-submitted"))
    await attempt(client.final("j1"))
    await attempt(client.result("j1", timeout=0.2))
    # a result stream as a worker writes it, with a rerun's deltas restarting at pos 0, then the final record
    written = [
        {"text": "ab", "token_ids": [1, 2], "pos": 0},
        {"text": "a", "token_ids": [1], "pos": 0},
        {"text": "c", "token_ids": [3], "pos": 2},
        {"text": "d", "token_ids": [4], "pos": 3},
    ]
    for i, payload in enumerate(written):
        r.xadd(keys.result("j3"), {"type": "delta", "data": json.dumps(payload)}, id=f"{10 + i}-0")
    final = {"id": "j3", "status": "completed", "text": "abcd"}
    r.xadd(keys.result("j3"), {"type": "final", "data": json.dumps(final)}, id="20-0")
    deltas = [d async for d in client.stream("j3", timeout=1)]
    seen.append(("ok", [(d.text, d.pos, d.offset.split("-")[0]) for d in deltas]))
    seen.append(("ok", [d.text async for d in client.stream("j3", offset=deltas[1].offset, timeout=1)]))
    await attempt(client.result("j3", timeout=1))
    state = {
        band: [json.loads(f[b"job"]) for _, f in r.xrange(keys.jobs_of(band))]
        for band in ("interactive", "default", "bulk")
    }
    return [*seen, state, sorted(r.hkeys(keys.ids)), [m for m, _ in r.zrange(keys.cancelled, 0, -1, withscores=True)]]


def test_both_clients_answer_every_call_the_same(redis_url, r):
    async def both() -> tuple[list, list]:
        async with AsyncClient(redis_url, queue="a", max_queue_depth=2) as client:
            via_async = await scenario(client, r, "a")
        via_sync = await scenario(SyncBehindAsync(Client(redis_url, queue="s", max_queue_depth=2)), r, "s")
        return via_async, via_sync

    via_async, via_sync = asyncio.run(both())
    strip = json.dumps  # the stream names differ only in the queue name
    assert strip(via_async, default=str).replace("{a}", "{Q}") == strip(via_sync, default=str).replace("{s}", "{Q}")
    kinds = [item[0] for item in via_async[:13]]
    assert kinds == [
        "ok",
        "ok",
        "JobRejected",
        "JobRejected",
        "QueueFullError",
        "ok",
        "QueueFullError",
        "ok",
        "ok",
        "ok",
        "ok",
        "ok",
        "ResultTimeout",
    ]
    assert via_async[13][1] == [("ab", 0, "10"), ("c", 2, "12"), ("d", 3, "13")]  # the rerun's repeat skipped
    assert via_async[14][1] == ["d"] and via_async[15][1].text == "abcd"  # resumed after "c"; the record


def test_shared_reads_serve_concurrent_waits_a_final_without_its_stream_and_timeouts(redis_url):
    from pagedq.worker.protocol.errors import ResultTimeout

    async def scenario() -> None:
        async with AsyncClient(redis_url, shared_reads=True, read_buffer=1) as client:
            job_id = await client.submit(prompt="shared", max_tokens=6, temperature=0.0, stream=True)
            texts = await asyncio.gather(
                *(_joined(client.stream(job_id, timeout=10)) for _ in range(3)), client.result(job_id, timeout=10)
            )
            record = texts[-1]
            assert texts[:3] == [record.text] * 3 and len(record.token_ids) == 6
            await client.r.delete(client.keys.result(job_id))  # trimmed or expired: the record by its own key
            assert (await client.result(job_id, timeout=5)).text == record.text
            with pytest.raises(ResultTimeout):
                await client.result("nobody-runs-this", timeout=0.3)
            assert not client.shared.waiters

    with worker_thread(StubEngine(step_delay_s=0.01), redis_url):
        asyncio.run(scenario())


async def _joined(deltas) -> str:
    return "".join([d.text async for d in deltas])
