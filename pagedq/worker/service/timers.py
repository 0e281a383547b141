"""What the loop does on timers, off the per-step path: renew the leases of held jobs, claim the jobs of dead
workers, beat the heartbeat, let the front doors do their upkeep, update the metrics."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pagedq.worker.protocol.keys import BANDS
from pagedq.worker.service.context import ServiceContext
from pagedq.worker.service.front_door import FrontDoor
from pagedq.worker.service.heartbeat import Heartbeat
from pagedq.worker.service.holding import Holding
from pagedq.worker.service.leases import Leases
from pagedq.worker.service.snapshot import MetricsSink, WorkerSnapshot


class Timers:
    def __init__(
        self,
        ctx: ServiceContext,
        leases: Leases,
        holding: Holding,
        heartbeat: Heartbeat,
        front_doors: Sequence[FrontDoor],
        metrics: MetricsSink | None,
        snapshot: Callable[[bool], WorkerSnapshot],  # the loop's figures now (True: the costly ones too)
    ) -> None:
        self.ctx, self.s = ctx, ctx.settings
        self.leases, self.holding, self.heartbeat = leases, holding, heartbeat
        self.front_doors, self.metrics, self.snapshot = front_doors, metrics, snapshot
        self._next = {"renew": 0.0, "claim": 0.0, "beat": 0.0, "metrics": 0.0}

    def run_due(self, now: float) -> bool:
        """Whatever is due at now (time.monotonic()); True when a front door may have brought cancels."""
        if now >= self._next["renew"] and self.ctx.held:
            self._next["renew"] = now + self.s.renew_interval
            self.leases.renew_held()
        if now >= self._next["claim"] and not self.ctx.stop.requested:
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
                self.ctx.log.error("metrics_update_failed", error=repr(exc))
        return revoked

    def beat(self, now: float) -> None:
        self._next["beat"] = now + self.s.heartbeat_every_s
        self.heartbeat.beat(self.snapshot(False))
        self.ctx.redis.zremrangebyscore(self.ctx.keys.cancelled, "-inf", time.time() - self.s.result_ttl_s)

    def _claim(self) -> None:
        for band in BANDS:
            entries = self.leases.claim(band, self.holding.room(band))  # hold() skips those we hold
            if entries:
                self.ctx.log.info("jobs_claimed", band=band, count=len(entries))
                self.holding.take_in(entries, band, recovered=True, check_cancel=True)
