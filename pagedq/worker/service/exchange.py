"""The turn's one round trip: this step's writes, the cancel check, the burst-mode pending count and the reads of
new jobs, all in a single pipeline (one round trip per turn, however many jobs advanced); and, once the writes
are known to be in Redis, the front doors' settling of the jobs they finished."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedq.worker.protocol.keys import BANDS, GROUP
from pagedq.worker.protocol.replies import text
from pagedq.worker.service.context import ServiceContext
from pagedq.worker.service.front_door import FrontDoor
from pagedq.worker.service.publisher import Publisher
from pagedq.worker.service.recovery import REDIS_DOWN
from pagedq.worker.service.round_trip import Reply, RoundTrip

Batch = tuple[str, list]  # (band, stream entries as XREADGROUP answers them)


@dataclass(frozen=True)
class TurnReplies:
    cancel_count: int  # the cancel set's size: 0 means no held job needs checking next turn
    cancelled: list[str]  # the held job ids asked about that are in the cancel set
    batches: list[Batch]
    burst_pending: int | None  # entries delivered and unacknowledged over every band; None unless asked


class Exchange:
    def __init__(self, ctx: ServiceContext, publisher: Publisher, front_doors: Sequence[FrontDoor]) -> None:
        self.r, self.keys, self.s = ctx.redis, ctx.keys, ctx.settings
        self.publisher, self.front_doors = publisher, front_doors
        self.spans = ctx.spans

    def turn(self, job_ids: list[str], idle: bool, stopping: bool, room: Callable[[str], int]) -> TurnReplies:
        """One round trip: pending writes, cancel check of job_ids, new jobs (blocking only when idle).
        room(band): how many entries of that band to read when not blocking."""
        trip = RoundTrip(self.r)
        ops = self.publisher.take()
        trip.write(ops)
        k = self.keys
        cancel_count = trip.read(lambda p: p.zcard(k.cancelled), int)
        scores = trip.read(lambda p: p.zmscore(k.cancelled, job_ids), list) if job_ids else None
        pending = None
        if self.s.burst and idle and not stopping:
            pending = [self._pending(trip, band) for band in BANDS]
        reads = self._queue_reads(trip, idle, stopping, room)
        try:
            results = trip.execute()
        except REDIS_DOWN:
            self.publisher.restore(ops)  # not known to be written: send again after the outage
            raise
        self.publisher.check(ops, results)
        if self.spans is not None:  # a blocking read waits after the writes have landed: they were done when sent
            self.spans.sent(blocked=self._blocks(idle, stopping))
        self.settle()
        trip.raise_read_error()
        return TurnReplies(
            cancel_count=cancel_count.value,
            cancelled=[j for j, score in zip(job_ids, scores.value) if score is not None] if scores else [],
            batches=[batch for read in reads for batch in read.value],
            burst_pending=None if pending is None else sum(reply.value for reply in pending),
        )

    def _queue_reads(
        self, trip: RoundTrip, idle: bool, stopping: bool, room: Callable[[str], int]
    ) -> list[Reply[list[Batch]]]:
        """The XREADGROUPs of this round trip."""
        # burst mode never blocks: it checks the pending count instead (and the loop naps if others hold jobs)
        block = self.s.block_ms if self._blocks(idle, stopping) else None
        if block:  # idle: one blocking read over every band, woken by the first job in any of them
            for door in self.front_doors:  # wake up often enough to poll the front doors too
                block = min(block, max(1, int(door.poll_interval_s * 1000)))
            return [self._read(trip, BANDS, self.s.max_waiting, block)]
        reads = []
        for band in BANDS:  # busy: each band read up to its own room, without blocking
            count = room(band)
            if count > 0:
                reads.append(self._read(trip, (band,), count))
        return reads

    def _blocks(self, idle: bool, stopping: bool) -> bool:
        return bool(self.s.block_ms) and idle and not self.s.burst and not stopping

    def _read(self, trip: RoundTrip, bands: Sequence[str], count: int, block: int | None = None) -> Reply[list[Batch]]:
        streams = {self.keys.jobs_of(band): ">" for band in bands}
        return trip.read(lambda p: p.xreadgroup(GROUP, self.s.name, streams, count=count, block=block), self._batches)

    def _pending(self, trip: RoundTrip, band: str) -> Reply[int]:
        return trip.read(lambda p: p.xpending(self.keys.jobs_of(band), GROUP), _pending_count)

    def _batches(self, reply: Any) -> list[Batch]:
        bands = {self.keys.jobs_of(b): b for b in BANDS}
        return [(bands[text(stream)], batch) for stream, batch in reply or []]

    def flush(self) -> None:
        """The writes alone (at shutdown)."""
        ops = self.publisher.take()
        if ops:
            trip = RoundTrip(self.r)
            trip.write(ops)
            self.publisher.check(ops, trip.execute())
            if self.spans is not None:
                self.spans.sent(blocked=False)
        self.settle()

    def settle(self) -> None:
        """Front-door jobs whose final records were just written: each door reports and acknowledges its own."""
        done = self.publisher.take_settled()
        if done:
            for door in self.front_doors:
                door.settle(done)


def _pending_count(summary: Any) -> int:
    return int(summary["pending"])
