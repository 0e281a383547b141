"""The worker's running totals, counted where things happen and read as a snapshot (service/snapshot.py): final
records written by status (under the STATUSES names the heartbeat, `pagedq status` and the metrics show), tokens
generated and Redis outages ridden out."""

from __future__ import annotations

from pagedq.worker.protocol.job import STATUSES


class Counters:
    def __init__(self) -> None:
        self._by_status: dict[str, int] = dict.fromkeys(STATUSES, 0)
        self._tokens_generated = 0
        self._redis_outages = 0

    def settled(self, status: str) -> None:
        """One final record queued for a job, with this status (one of STATUSES)."""
        if status not in self._by_status:
            raise KeyError(f"unknown job status {status!r}")
        self._by_status[status] += 1

    def generated(self, tokens: int) -> None:
        self._tokens_generated += tokens

    def outage_ridden_out(self) -> None:
        self._redis_outages += 1

    def by_status(self) -> dict[str, int]:
        """Final records by status so far, in STATUSES order (a copy)."""
        return dict(self._by_status)

    @property
    def tokens_generated(self) -> int:
        return self._tokens_generated

    @property
    def redis_outages(self) -> int:
        return self._redis_outages
