"""AsyncClient against a live worker (stub engine in a thread): submit, stream, result, cancel, queue limit."""

from __future__ import annotations

import asyncio

import pytest

from worker import AsyncClient, Client, JobRejected, QueueFullError
from worker.stub_engine import StubEngine

from .conftest import worker_thread


def test_async_client_end_to_end(redis_url):
    async def scenario() -> None:
        async with AsyncClient(redis_url) as client:
            with pytest.raises(JobRejected, match="top_k"):
                await client.submit(prompt="x", top_k=-5)
            streamed = await client.submit(prompt="async stream", max_tokens=6, temperature=0.0, stream=True)
            plain = await client.submit_many([dict(prompt=f"async {i}", max_tokens=3, temperature=0.0)
                                              for i in range(5)])
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
