"""What the loop does on timers, off the per-step path: renew the leases of held jobs, claim the jobs of dead
workers, beat the heartbeat, let the front doors do their upkeep, update the metrics."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from pagedq.worker.protocol.keys import BANDS, QueueKeys
from pagedq.worker.service.admission import Intake
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.front_door import FrontDoor
from pagedq.worker.service.heartbeat import Heartbeat
from pagedq.worker.service.held import HeldJobs
from pagedq.worker.service.holding import Holding
from pagedq.worker.service.leases import Leases
from pagedq.worker.service.recovery import Stop
from pagedq.worker.service.snapshot import MetricsSink, WorkerSnapshot


class Timers:
    def __init__(
        self,
        redis_client: Any,
        keys: QueueKeys,
        settings: WorkerSettings,
        held: HeldJobs,
        holding: Holding,
        intake: Intake,
        leases: Leases,
        heartbeat: Heartbeat,
        front_doors: Sequence[FrontDoor],
        metrics: MetricsSink | None,
        snapshot: Callable[[bool], WorkerSnapshot],  # the loop's figures now (True: the costly ones too)
        stop: Stop,
        log: Any,
    ) -> None:
        self.r, self.keys, self.s = redis_client, keys, settings
        self.held, self.holding, self.intake, self.leases, self.heartbeat = held, holding, intake, leases, heartbeat
        self.front_doors, self.metrics, self.snapshot, self.stop, self.log = front_doors, metrics, snapshot, stop, log
        self._next = {"renew": 0.0, "claim": 0.0, "beat": 0.0, "metrics": 0.0}

    def run_due(self, now: float) -> bool:
        """Whatever is due at now (time.monotonic()); True when a front door may have brought cancels."""
        if now >= self._next["renew"] and self.held:
            self._next["renew"] = now + self.s.renew_interval
            self._renew()
        if now >= self._next["claim"] and not self.stop.requested:
            self._next["claim"] = now + self.s.claim_interval
            self._claim()
        if now >= self._next["beat"]:
            self.beat(now)
        revoked = False
        for door in self.front_doors:
            revoked = door.maintain(now) or revoked
        if self.metrics is not None and now >= self._next["metrics"]:
            self._next["metrics"] = now + self.s.metrics_every_s
            try:
                self.metrics.update(self.snapshot(True))
            except Exception as exc:  # metrics must never take the worker down
                self.log.error("metrics_update_failed", error=repr(exc))
        return revoked

    def beat(self, now: float) -> None:
        self._next["beat"] = now + self.s.heartbeat_every_s
        self.heartbeat.beat(self.snapshot(False))
        self.r.zremrangebyscore(self.keys.cancelled, "-inf", time.time() - self.s.result_ttl_s)

    def _renew(self) -> None:
        for band in BANDS:
            ids = self.held.entry_ids(band)
            lost = self.leases.renew(band, ids) if ids else []
            if lost:
                self.log.warning("lease_lost", band=band, entries=lost)  # keep going: the first final wins

    def _claim(self) -> None:
        for band in BANDS:
            entries = self.leases.claim(band, self.holding.room(band))  # hold() skips those we hold
            if entries:
                self.log.info("jobs_claimed", band=band, count=len(entries))
                self.holding.hold(self.intake.parse(entries, recovered=True, band=band), check_cancel=True)
