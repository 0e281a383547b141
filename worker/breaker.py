"""Telling a broken engine from a poison job.

A job that makes every step fail is isolated by rerunning the suspects alone: only it keeps failing, and it
is dead-lettered past max_attempts. But when the engine itself is broken (a lost GPU, a CUDA error that
poisons the context), every job fails alone, and dead-lettering them one after another would empty the
whole queue into the dead-letter stream. So: once `limit` different jobs have each failed alone with no
successful step in between, the fault is the worker's, not the jobs'. The worker then stops without
settling anything: its unacknowledged jobs go to healthy workers (or to this one, restarted) after the lease.
"""

from __future__ import annotations


class EngineBreaker:
    def __init__(self, limit: int) -> None:
        if limit < 2:
            raise ValueError(f"engine failure limit must be >= 2 (one poison job must not trip it), got {limit}")
        self.limit = limit
        self._failed_alone: set[str] = set()

    def step_succeeded(self) -> None:
        if self._failed_alone:
            self._failed_alone.clear()

    def job_failed_alone(self, job_id: str) -> bool:
        """Record a solo failure; True when it makes `limit` distinct jobs in a row: the engine is broken."""
        self._failed_alone.add(job_id)
        return len(self._failed_alone) >= self.limit

    @property
    def num_failed_alone(self) -> int:
        return len(self._failed_alone)
