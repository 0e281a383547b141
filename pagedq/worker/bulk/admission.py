"""How a run's jobs enter the queue, for `pagedq bulk` and the gateway's Batch API alike: in input order, each once
(the run's enqueued set), within the queue's limits (a run waits for room, it never fails for being big), and
again when a job's result expired before the run collected it (protocol/scripts.py's BULK_ENQUEUE and
FORGET_EXPIRED). The runners send the commands (sync or asyncio); this builds them and reads their replies."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedq.worker.protocol.job import Job
from pagedq.worker.protocol.keys import JOB_FIELD, QueueKeys

# How often a run asks whether a job it awaits lost its result (the result TTL can only run out while nobody
# collects it: a resume, or a run blocked for a day). Every check is one script call over the jobs in flight.
EXPIRY_CHECK_S = 5.0


@dataclass
class Admission:
    """The enqueue and expiry commands of one run: `run_key` names its enqueued set (a run id or a batch id).
    max_depth and tenant_limit: the limits of SUBMIT (None or 0: none); tenant: whose jobs these are."""

    keys: QueueKeys
    band: str
    run_key: str
    ttl_s: int
    max_depth: int | None = None
    tenant: str | None = None
    tenant_limit: int | None = None
    _next_check: float = field(default=0.0, init=False)

    def enqueue(self, jobs: Sequence[Job]) -> tuple[list[str], list]:
        """KEYS and ARGV of BULK_ENQUEUE for these jobs, in order."""
        counted = bool(self.tenant_limit) and self.tenant is not None
        tenant_set = self.keys.tenant_queued(self.tenant) if counted and self.tenant else self.keys.ids
        keys = [self.keys.jobs_of(self.band), self.keys.bulk_enqueued(self.run_key), self.keys.ids, tenant_set]
        args: list = [self.ttl_s, JOB_FIELD, int(self.max_depth or 0), int(self.tenant_limit or 0)]
        for job in jobs:
            args += [job.id, job.to_json()]
        return keys, args

    @staticmethod
    def taken(reply: Sequence) -> tuple[int, int]:
        """(jobs taken, of which enqueued now) of a BULK_ENQUEUE reply."""
        return int(reply[0]), int(reply[1])

    def expiry_due(self) -> bool:
        """Whether to look for expired results now (at most every EXPIRY_CHECK_S, the first time at once)."""
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + EXPIRY_CHECK_S
        return True

    def forget_expired(self, job_ids: Sequence[str]) -> tuple[list[str], list]:
        """KEYS and ARGV of FORGET_EXPIRED for the jobs a run awaits."""
        return [self.keys.bulk_enqueued(self.run_key), self.keys.ids, *map(self.keys.final, job_ids)], list(job_ids)
