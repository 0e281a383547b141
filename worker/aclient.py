"""Producer API for asyncio (redis.asyncio); same methods and semantics as worker.client.Client."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Iterable, Mapping

from redis.asyncio import Redis

from . import scripts
from .client import (DeltaFilter, _band, _block_ms, _s, as_banded, cancel_args, check_submit_reply, make_job,
                     parse_result_entry, submit_args)
from .errors import ResultTimeout
from .job import Delta, FinalRecord, Job
from .keys import BANDS, QueueKeys


class AsyncClient:
    def __init__(self, url: str = "redis://localhost:6379/0", queue: str = "default", *,
                 max_queue_depth: int | None = None, redis: Redis | None = None) -> None:
        self.r = redis if redis is not None else Redis.from_url(url)
        self.keys = QueueKeys(queue)
        self.max_queue_depth = max_queue_depth

    async def aclose(self) -> None:
        await self.r.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def submit(self, prompt: str | None = None, *, band: str | None = None, **kwargs: Any) -> str:
        job = make_job(prompt, **kwargs)
        return (await self._submit([(job, _band(band, job))]))[0]

    async def submit_many(self, jobs: Iterable[Job | Mapping[str, Any]]) -> list[str]:
        return await self._submit([as_banded(j) for j in jobs])

    async def _submit(self, built: list[tuple[Job, str]]) -> list[str]:
        if not built:
            return []
        keys, args = submit_args(self.keys, built, self.max_queue_depth)
        check_submit_reply(await scripts.acall(self.r, "submit", keys, args), len(built), self.max_queue_depth)
        return [job.id for job, _ in built]

    async def cancel(self, job_id: str) -> bool:
        keys, args = cancel_args(self.keys, job_id)
        return bool(await scripts.acall(self.r, "cancel", keys, args))

    async def queue_depth(self, band: str | None = None) -> int:
        bands = [band] if band is not None else BANDS
        return sum([int(await self.r.xlen(self.keys.jobs_of(b))) for b in bands])

    async def final(self, job_id: str) -> FinalRecord | None:
        raw = await self.r.get(self.keys.final(job_id))
        return FinalRecord.model_validate_json(raw) if raw else None

    async def result(self, job_id: str, timeout: float | None = None) -> FinalRecord:
        async for kind, item in self._entries(job_id, "0-0", timeout):
            if kind == "final":
                return item
        raise AssertionError("unreachable")

    async def stream(self, job_id: str, offset: str = "0-0", timeout: float | None = None) -> AsyncIterator[Delta]:
        seen = DeltaFilter()
        async for kind, item in self._entries(job_id, offset, timeout, per_item=True):
            if kind == "final":
                return
            if seen.keep(item):
                yield item

    async def _entries(self, job_id: str, offset: str, timeout: float | None, per_item: bool = False):
        key, last = self.keys.result(job_id), offset
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            reply = await self.r.xread({key: last}, count=256, block=_block_ms(deadline))
            for entry_id, fields in (reply[0][1] if reply else []):
                last = _s(entry_id)
                yield parse_result_entry(entry_id, fields)
                if per_item and timeout is not None:
                    deadline = time.monotonic() + timeout
            if not reply:
                record = await self.final(job_id)
                if record is not None:
                    yield "final", record
                if deadline is not None and time.monotonic() >= deadline:
                    raise ResultTimeout(f"no final record for job {job_id} within {timeout}s")
