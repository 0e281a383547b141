"""Jobs coming into the held set (read, claimed, recovered at start-up or polled through a front door): only new
ones are held, recovered ones are charged the runs they already had, and, while cancels may be pending, each batch
is checked against the cancel set. Also how much room there is to read ahead."""

from __future__ import annotations

from pagedq.worker.protocol.keys import BANDS, band_rank
from pagedq.worker.service.admission import Intake
from pagedq.worker.service.context import ServiceContext
from pagedq.worker.service.engine_api import WorkerEngine
from pagedq.worker.service.finish import Finisher
from pagedq.worker.service.held import HeldJob, JobState
from pagedq.worker.service.publisher import Publisher


class Holding:
    def __init__(
        self, ctx: ServiceContext, engine: WorkerEngine, publisher: Publisher, intake: Intake, finisher: Finisher
    ) -> None:
        self.r, self.keys, self.s, self.log = ctx.redis, ctx.keys, ctx.settings, ctx.log
        self.held, self.stop = ctx.held, ctx.stop
        self.engine, self.publisher, self.intake, self.finisher = engine, publisher, intake, finisher

    def room(self, band: str | None = None) -> int:
        """Room to read ahead: max_waiting minus the jobs held and not yet running, of this band and the
        bands above it (so a backlog of bulk jobs never stops interactive ones from being read). None: of all."""
        if self.stop.requested:
            return 0
        if band is None:
            return self.s.max_waiting - self.engine.num_waiting_requests - len(self.held.waiting())
        above = BANDS[: band_rank(band) + 1]
        queued = sum(1 for t in self.held if t.band in above and (t.state is not JobState.IN_ENGINE or not t.started))
        # tenant_read_ahead: deeper, so the tenants' round (service/tenants.py) sees past one tenant's backlog
        return self.s.max_waiting + self.s.tenant_read_ahead - queued

    def take_in(self, entries: list, band: str, recovered: bool = False, check_cancel: bool = False) -> None:
        """Stream entries of a band, read or claimed: parsed by the intake (rejections settled there), then held."""
        self.hold(self.intake.parse(entries, recovered=recovered, band=band), check_cancel=check_cancel)

    def hold(self, jobs: list[HeldJob], check_cancel: bool = False) -> None:
        new = []
        for t in jobs:  # one at a time: a batch may hold two entries of one job
            if self._is_new(t):
                self.held.add(t)
                new.append(t)
        jobs = new
        recovered = [t for t in jobs if t.recovered]
        if recovered:  # charge each its lost run plus the runs alone it was given before
            for t, runs in zip(recovered, self.r.hmget(self.keys.runs, [t.id for t in recovered])):
                t.runs_alone = int(runs or 0)
                t.attempts = 1 + t.runs_alone
        if check_cancel and jobs:
            ids = sorted({t.id for t in jobs})
            scores = self.r.zmscore(self.keys.cancelled, ids)
            self.finisher.cancel([j for j, score in zip(ids, scores) if score is not None])

    def _is_new(self, t: HeldJob) -> bool:
        """False for a job already held under the same key: the same entry read again (a claim of our own
        entry) is skipped; another entry of the same job id in the same band is acknowledged, because the
        held one answers for that id."""
        held = self.held.get(t.key)
        if held is None:
            return True
        if t.entry_id and t.entry_id != held.entry_id:
            self.log.warning(
                "duplicate_job_entry", job_id=t.id, band=t.origin, entry_id=t.entry_id, held_entry_id=held.entry_id
            )
            self.publisher.ack(t.origin, t.entry_id, delete=True)
        return False
