"""Many waits on one blocking read: a reader task XREADs the result streams of every job being waited for at once
and hands each waiter its entries, so open waits hold no Redis connection each (AsyncClient(shared_reads=True),
what the gateway uses).

Each waiter has a bounded buffer: while it holds `buffered` entries its stream is left out of the reads (the
entries stay in Redis) until the waiter takes some, so a slow consumer costs a bounded amount of memory and
slows nobody else. A new waiter, or one whose buffer drained, joins a read in progress by an entry on the reader's
wake stream (QueueKeys.reader_wake), which the read blocks on too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

import structlog

from pagedq.worker.client.core import POLL_MS, Entry, parse_result_entry
from pagedq.worker.protocol.connection import AsyncRedis
from pagedq.worker.protocol.errors import ResultTimeout
from pagedq.worker.protocol.job import FinalRecord
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.protocol.replies import text
from pagedq.worker.telemetry import run_untraced

WAKE_TTL_S = 60  # the wake stream outlives a gateway that died by this much
ERROR_PAUSE_S = 0.05  # after a failed read, before the next (a Redis outage does not spin the loop)


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class _Waiter:
    """One wait on one job's result stream: what it has read so far and what it has not taken yet."""

    def __init__(self, key: str, final_key: str, offset: str) -> None:
        self.key, self.final_key = key, final_key
        self.last = _stream_id(offset)
        self.buffer: deque[Entry | BaseException] = deque()
        self.ready = asyncio.Event()
        self.finished = False  # its final record is in the buffer: nothing more to read
        self.quiet_since = time.monotonic()  # when a read last brought it something

    def wants(self, limit: int) -> bool:
        return not self.finished and len(self.buffer) < limit

    def put(self, item: Entry | BaseException) -> None:
        self.buffer.append(item)
        self.quiet_since = time.monotonic()
        if isinstance(item, BaseException) or item[0] == "final":
            self.finished = True
        self.ready.set()


class SharedReads:
    def __init__(self, r: AsyncRedis, keys: QueueKeys, buffered: int = 64) -> None:
        if buffered < 1:
            raise ValueError(f"buffered must be at least 1, got {buffered}")
        self.r, self.keys, self.limit = r, keys, buffered
        self.wake_key = keys.reader_wake(uuid.uuid4().hex)
        self.waiters: set[_Waiter] = set()
        self._task: asyncio.Task | None = None
        self._wake_last = "0-0"
        self._reading = False  # a blocking read is out: a new waiter must wake it
        self._wake_sent = False  # one wake per read is enough
        self._wakes: set[asyncio.Task] = set()

    @property
    def buffered(self) -> int:
        """Entries read from Redis and not yet taken by their waiters, over all waiters."""
        return sum(len(w.buffer) for w in self.waiters)

    async def aclose(self) -> None:
        tasks = [t for t in (self._task, *self._wakes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):  # Redis may be gone; the key expires by itself
            await self.r.delete(self.wake_key)

    async def entries(
        self, job_id: str, offset: str, timeout: float | None, per_item: bool
    ) -> AsyncGenerator[Entry, None]:
        """The job's entries after offset up to its final record: AsyncClient._entries' contract (ResultTimeout
        when none comes within timeout; with per_item, within timeout of the previous one)."""
        waiter = _Waiter(self.keys.result(job_id), self.keys.final(job_id), offset)
        deadline = None if timeout is None else time.monotonic() + timeout
        self.waiters.add(waiter)
        self._start()
        try:
            while True:
                while not waiter.buffer:
                    waiter.ready.clear()
                    left = None if deadline is None else deadline - time.monotonic()
                    try:
                        await asyncio.wait_for(waiter.ready.wait(), left)
                    except asyncio.TimeoutError:
                        raise ResultTimeout(f"no final record for job {job_id} within {timeout}s") from None
                item = waiter.buffer.popleft()
                if len(waiter.buffer) == self.limit - 1:  # it was left out of the reads: back in
                    self._wake()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item[0] == "final":
                    return
                if per_item and timeout is not None:
                    deadline = time.monotonic() + timeout
        finally:
            self.waiters.discard(waiter)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            # the one reader serves every waiter: it runs outside the context (and the trace) of the first
            self._task = run_untraced(asyncio.get_running_loop().create_task, self._run())
        else:
            self._wake()

    def _wake(self) -> None:
        if not self._reading or self._wake_sent:
            return  # no read is out (the next one includes every waiter), or a wake already is on its way
        self._wake_sent = True
        task = asyncio.get_running_loop().create_task(self._send_wake())
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)

    async def _send_wake(self) -> None:
        try:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.xadd(self.wake_key, {"wake": 1}, maxlen=1, approximate=False)
                pipe.expire(self.wake_key, WAKE_TTL_S)
                await pipe.execute()
        except Exception as exc:  # the read it was to end fails too, or ends within POLL_MS
            structlog.get_logger("pagedq.client").debug("reader_wake_failed", error=repr(exc))

    async def _run(self) -> None:
        checked = time.monotonic()
        while self.waiters:
            reading: dict[str, list[_Waiter]] = {}
            for waiter in self.waiters:
                if waiter.wants(self.limit):
                    reading.setdefault(waiter.key, []).append(waiter)
                else:  # left out: its stream is not quiet, nobody reads it (the check below is for read streams)
                    waiter.quiet_since = time.monotonic()
            streams: dict[Any, Any] = {key: _offset(min(w.last for w in ws)) for key, ws in reading.items()}
            streams[self.wake_key] = self._wake_last
            self._reading, self._wake_sent = True, False
            try:
                reply = await self.r.xread(streams, count=self.limit, block=POLL_MS)
                self._reading = False
                self._deliver(reply, reading)
                if time.monotonic() - checked >= POLL_MS / 1000:
                    checked = time.monotonic()
                    await self._finals_of_quiet(reading)
            except Exception as exc:  # Redis lost or too slow: every wait fails, the next waiters try again
                self._reading = False
                for waiter in list(self.waiters):
                    waiter.put(exc)
                await asyncio.sleep(ERROR_PAUSE_S)

    def _deliver(self, reply: object, reading: dict[str, list[_Waiter]]) -> None:
        if not reply:
            return
        if not isinstance(reply, list):
            raise TypeError(f"XREAD answered {type(reply).__name__}; the clients speak RESP2, which answers a list")
        for raw_key, entries in reply:
            key = text(raw_key)
            if key == self.wake_key:
                self._wake_last = text(entries[-1][0])
                continue
            for entry_id, fields in entries:
                position = _stream_id(text(entry_id))
                try:
                    item: Entry | BaseException = parse_result_entry(entry_id, fields)
                except Exception as exc:  # a malformed entry fails its waiters, as AsyncClient's own read would
                    item = exc
                for waiter in reading.get(key, ()):
                    if position > waiter.last and not waiter.finished:
                        waiter.last = position
                        waiter.put(item)

    async def _finals_of_quiet(self, reading: dict[str, list[_Waiter]]) -> None:
        """Waiters whose stream brought nothing for a poll get the final record by its own key, if there is one:
        their stream expired or was trimmed (what AsyncClient's own read does after an empty read)."""
        since = time.monotonic() - POLL_MS / 1000
        quiet = [w for ws in reading.values() for w in ws if w.quiet_since <= since and not w.finished]
        if not quiet:
            return
        for waiter, raw in zip(quiet, await self.r.mget([w.final_key for w in quiet])):
            if raw and not waiter.finished:
                waiter.put(("final", FinalRecord.model_validate_json(raw)))


def _offset(position: tuple[int, int]) -> str:
    return f"{position[0]}-{position[1]}"
