"""How a held job ends: cancelled or expired early (a running one keeps its partial output), or settled with its
final record, which is counted (service/counters.py), observed by the metrics and logged (event `job_finished`)."""

from __future__ import annotations

import time

from pagedq.worker.service.absorb import absorb_abort
from pagedq.worker.service.context import ServiceContext
from pagedq.worker.service.held import HeldJob
from pagedq.worker.service.publisher import Publisher
from pagedq.worker.service.recovery import Recovery
from pagedq.worker.service.snapshot import MetricsSink


class Finisher:
    def __init__(
        self, ctx: ServiceContext, publisher: Publisher, recovery: Recovery, metrics: MetricsSink | None
    ) -> None:
        self.held, self.counters, self.log = ctx.held, ctx.counters, ctx.log
        self.publisher, self.recovery, self.metrics = publisher, recovery, metrics

    def cancel(self, job_ids: list[str]) -> None:
        """The held jobs of these ids (found in the cancel set), whatever their state."""
        for t in self.held.with_job_ids(set(job_ids)):
            self.stop_early(t, "cancelled", "cancelled by request")

    def enforce_deadlines(self) -> None:
        for t in self.held.past_deadline(time.time()):
            self.stop_early(
                t,
                "expired",
                "deadline passed while running" if t.in_engine else "deadline passed before the job started",
            )

    def stop_early(self, t: HeldJob, status: str, reason: str) -> None:
        """Cancel or expire a queued or running job; a running one keeps its partial output."""
        if t.in_engine:
            absorb_abort(t, self.recovery.leave_engine(t))
        self.finalize(t, status, reason)

    def finalize(self, t: HeldJob, status: str, error: str | None = None) -> None:
        record = self.publisher.record(t, status, error)
        self.publisher.final(record, t.origin, t.entry_id, held=t)
        self.counters.settled(status)
        if self.metrics is not None:
            self.metrics.observe(record, t.band)
        self.held.finish(t)
        log = self.log.bind(job_id=t.id)
        if status == "completed":
            log.debug("job_finished", status=status, tokens=len(t.token_ids))
        else:
            log.info("job_finished", status=status, tokens=len(t.token_ids), error=error)
