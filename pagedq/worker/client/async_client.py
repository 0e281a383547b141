"""Producer API for asyncio (redis.asyncio); same methods and semantics as worker.client.sync_client.Client, with the
same core (pagedq/worker/client/core.py): only the round trips differ."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from typing import Any

from pagedq.worker.client.core import ClientCore, DeltaFilter, Entry
from pagedq.worker.client.shared_reads import SharedReads
from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.connection import AsyncRedis, connect_async
from pagedq.worker.protocol.job import Delta, FinalRecord, Job
from pagedq.worker.protocol.settings import redis_url


class AsyncClient(ClientCore):
    def __init__(
        self,
        url: str | None = None,
        queue: str = "default",
        *,
        max_queue_depth: int | None = None,
        max_tenant_queued: int | None = None,
        job_id_prefix: str | None = None,
        redis: AsyncRedis | None = None,
        shared_reads: bool = False,
        read_buffer: int = 64,
    ) -> None:
        """shared_reads: result() and stream() wait on one blocking read shared by every wait of this client
        (client/shared_reads.py), each holding at most about 2 x read_buffer entries, instead of a blocking read
        (a pooled connection) each: for a process with many waits at once, such as the gateway."""
        super().__init__(queue, max_queue_depth, max_tenant_queued, job_id_prefix)
        # url None: PAGEDQ_REDIS_URL, else a local Redis (pagedq/worker/protocol/settings.py);
        # redis+cluster:// a cluster
        self.r = redis if redis is not None else connect_async(redis_url(url))
        self.shared = SharedReads(self.r, self.keys, read_buffer) if shared_reads else None

    async def aclose(self) -> None:
        if self.shared is not None:
            await self.shared.aclose()
        await self.r.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def submit(self, prompt: str | None = None, *, band: str | None = None, **kwargs: Any) -> str:
        return (await self._submit(self._one(prompt, band, kwargs)))[0]

    async def submit_many(self, jobs: Iterable[Job | Mapping[str, Any]]) -> list[str]:
        return await self._submit(self._many(jobs))

    async def _submit(self, built: list[tuple[Job, str]]) -> list[str]:
        if not built:
            return []
        keys, args = self._submit_script(built)
        return self._submitted(await scripts.acall(self.r, "submit", keys, args), built)

    async def cancel(self, job_id: str) -> bool:
        keys, args = self._cancel_script(job_id)
        return bool(await scripts.acall(self.r, "cancel", keys, args))

    async def queue_depth(self, band: str | None = None) -> int:
        return sum([int(await self.r.xlen(key)) for key in self._depth_keys(band)])

    async def final(self, job_id: str) -> FinalRecord | None:
        return self._parse_final(await self.r.get(self.keys.final(job_id)))

    async def result(self, job_id: str, timeout: float | None = None) -> FinalRecord:
        async with contextlib.aclosing(self._entries(job_id, "0-0", timeout)) as entries:
            async for _kind, item in entries:
                if isinstance(item, FinalRecord):
                    return item
        raise AssertionError("unreachable")

    async def stream(self, job_id: str, offset: str = "0-0", timeout: float | None = None) -> AsyncIterator[Delta]:
        seen = DeltaFilter()
        async with contextlib.aclosing(self._entries(job_id, offset, timeout, per_item=True)) as entries:
            async for _kind, item in entries:
                if isinstance(item, FinalRecord):
                    return
                if seen.keep(item):
                    yield item

    async def _entries(
        self, job_id: str, offset: str, timeout: float | None, per_item: bool = False
    ) -> AsyncGenerator[Entry, None]:
        if self.shared is not None:  # closed at once when its caller is done: the shared read drops the wait
            async with contextlib.aclosing(self.shared.entries(job_id, offset, timeout, per_item)) as shared:
                async for entry in shared:
                    yield entry
            return
        reader = self._reader(job_id, offset, timeout, per_item)
        while True:
            reply = await self.r.xread(**reader.xread_kwargs())
            for entry in reader.entries(reply):
                yield entry
            if not reply:
                for entry in reader.when_idle(await self.r.get(reader.final_key)):
                    yield entry
