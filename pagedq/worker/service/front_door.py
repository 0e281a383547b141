"""What the loop asks of a front door: a source of jobs other than the queue's own streams (the Celery one,
pagedq/worker/celery/intake.py). The loop knows doors only through this protocol; they are built outside it, from the
settings (pagedq/worker/assembly.py), so the service layer never imports what a door is made of."""

from __future__ import annotations

from typing import Protocol

from pagedq.worker.service.admission import Intake
from pagedq.worker.service.held import HeldJob


class FrontDoor(Protocol):
    @property
    def name(self) -> str:
        """What the door serves, as its operator names it (the heartbeat's `celery_queue`)."""
        ...

    @property
    def poll_interval_s(self) -> float:
        """How long the loop may block on the streams while idle: the door is polled, not waited on."""
        ...

    def poll(self, count: int, intake: Intake) -> list[HeldJob]:
        """Up to count new jobs, without blocking, made held jobs through the loop's intake."""
        ...

    def settle(self, done: list[str]) -> None:
        """The job ids whose final records were just written: report and acknowledge those this door holds."""
        ...

    def maintain(self, now: float) -> bool:
        """On every turn (now: time.monotonic()); True when cancels may have come in through the door."""
        ...

    def depth(self) -> int:
        """Jobs waiting behind the door (a metrics gauge)."""
        ...

    def close(self) -> None:
        """At shutdown: give back what is unfinished (it is redelivered)."""
        ...
