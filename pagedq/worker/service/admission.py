"""Turning job stream entries into held jobs, and admitting held jobs into the engine.

The backlog holds jobs read from Redis but not yet handed to the engine (blocked by the KV budget, or
waiting to be rerun alone after a failed step). Reads are sized so the backlog stays small: jobs in a
worker's pending list cannot be taken by an idle worker until their lease lapses.
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

from pagedq.worker.protocol import limits
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.job import FinalRecord, Job, parse_job
from pagedq.worker.protocol.keys import BANDS, DEFAULT_BAND, JOB_FIELD, band_rank
from pagedq.worker.protocol.prompt_size import prompt_source
from pagedq.worker.protocol.replies import text
from pagedq.worker.protocol.salvage import salvage
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.context import ServiceContext
from pagedq.worker.service.engine_api import WorkerEngine, check_context_fits
from pagedq.worker.service.engine_input import MadePrompt
from pagedq.worker.service.held import HeldJob, JobKey, JobState
from pagedq.worker.service.publisher import Publisher
from pagedq.worker.service.tenants import TenantShares, parse_weights

_JOB_FIELD_B = JOB_FIELD.encode()
MAX_REASON_CHARS = 2000  # a rejection reason quotes the problem, never the whole entry


class Intake:
    def __init__(self, ctx: ServiceContext, publisher: Publisher) -> None:
        self.keys, self.settings, self.log, self.counters = ctx.keys, ctx.settings, ctx.log, ctx.counters
        self.publisher = publisher
        self.seq = 0

    def parse(self, entries: list, recovered: bool = False, band: str = DEFAULT_BAND) -> list[HeldJob]:
        """Validate entries; queue rejections and dead letters; return the jobs to run.

        Whatever an entry holds, it ends here as a held job, a rejection or a raw dead letter: any exception
        while parsing or rejecting one entry is that entry's fault, never the worker's."""
        jobs = []
        for entry_id, fields in entries:
            entry_id = text(entry_id)
            if not fields:  # deleted while pending (Redis 6.2 XAUTOCLAIM returns these with nil bodies)
                self.publisher.ack(band, entry_id)
                continue
            raw = fields.get(_JOB_FIELD_B, fields.get(JOB_FIELD))
            try:
                t = self._parse_one(entry_id, raw, recovered, band)
            except JobRejected as exc:
                self.reject_raw(entry_id, raw, str(exc), band)
                continue
            except Exception as exc:
                self.reject_raw(entry_id, raw, f"cannot parse the job entry: {type(exc).__name__}: {exc}", band)
                continue
            if t is not None:
                jobs.append(t)
        return jobs

    def _parse_one(self, entry_id: str, raw: Any, recovered: bool, band: str) -> HeldJob:
        if raw is None:
            raise JobRejected(f"stream entry has no {JOB_FIELD!r} field")
        job = parse_job(raw)
        if "id" not in job.model_fields_set:  # a raw XADD without an id: the entry id is its id
            job = job.model_copy(update={"id": entry_id})
        return self.track(band, entry_id, job, recovered, size=len(raw))

    def track(
        self,
        origin: str,
        entry_id: str | None,
        job: Job,
        recovered: bool = False,
        enqueued_at: float = 0.0,
        size: int = 0,
    ) -> HeldJob:
        """A held job in read order. A recovered one (its worker died holding it) is a suspect: the worker
        charges it its lost run and its runs alone (service/holding.py) and runs it alone."""
        self.seq += 1
        t = HeldJob(
            JobKey(origin, job.id),
            job,
            entry_id=entry_id,
            seq=self.seq,
            size=size,
            enqueued_at=enqueued_at,
            recovered=recovered,
            state=JobState.SUSPECT if recovered else JobState.BACKLOG,
            read_at=time.monotonic(),
            read_unix=time.time(),
        )
        self.publisher.mark_known(job.id)  # now Client.cancel knows it
        return t

    def reject_raw(self, entry_id: str, raw: Any, reason: str, band: str = DEFAULT_BAND) -> None:
        """The one `rejected` final record of an entry that is not a valid job (addressed to its id when it
        has a readable one, else to the entry id). If even that cannot be built, dead-letter the entry raw."""
        try:
            job_id, metadata = salvage(raw)
            record = FinalRecord(
                id=job_id or entry_id,
                status="rejected",
                error=reason[:MAX_REASON_CHARS],
                metadata=metadata,
                worker=self.settings.name,
            )
            self.log.warning("job_rejected", job_id=record.id, entry_id=entry_id, error=record.error)
            self.publisher.final(record, band, entry_id)
            self.counters.settled("rejected")
        except Exception as exc:
            self.log.error(
                "job_rejection_failed",
                entry_id=entry_id,
                reason=reason[:MAX_REASON_CHARS],
                error=repr(exc)[:MAX_REASON_CHARS],
            )
            self.publisher.dead_raw(
                entry_id, raw, f"{reason} (and the rejection failed: {exc!r})"[:MAX_REASON_CHARS], band
            )

    def reject(self, t: HeldJob, reason: str, code: str | None = None) -> None:
        self.log.warning("job_rejected", job_id=t.id, error=reason)
        self.publisher.final(
            self.publisher.record(t, "rejected", reason, error_code=code), t.origin, t.entry_id, held=t
        )
        self.counters.settled("rejected")

    def reject_delivery(self, job_id: str, origin: str, reason: str) -> None:
        """The `rejected` final record of a front-door delivery that never became a held job (origin: its door)."""
        record = FinalRecord(id=job_id, status="rejected", error=reason, worker=self.settings.name)
        self.log.warning("job_rejected", job_id=job_id, error=reason)
        self.publisher.final(record, origin, None)
        self.counters.settled("rejected")

    def dead_letter(self, t: HeldJob, error: str) -> None:
        error = f"{error}; attempts {t.attempts}, max_attempts {self.settings.max_attempts}"
        if t.last_error:
            error += f"; last error: {t.last_error}"
        self.log.error("job_dead_lettered", job_id=t.id, error=error)
        dead = {
            "job": json.loads(t.job.to_json()),
            "entry_id": t.entry_id,
            "band": t.origin,
            "error": error,
            "attempts": t.attempts,
            "worker": self.settings.name,
        }
        self.publisher.final(self.publisher.record(t, "failed", error), t.origin, t.entry_id, dead=dead, held=t)
        self.counters.settled("failed")


BAND_STRIDE = 2 * limits.MAX_PRIORITY + 1  # engine priority: every job of a band ahead of every job below it


def engine_priority(t: HeldJob) -> int:
    """The engine's priority for a held job, in vLLM's sense as the engine takes it (lower is sooner): its band
    first, then its own (the engine preempts the highest value when the KV cache runs dry, so an interactive job
    takes a bulk job's blocks). A job let in by the starvation guard goes to the head of the engine's queue, or
    the engine's own priority order would put it back behind the busy band."""
    if t.guarded:
        return -BAND_STRIDE
    return band_rank(t.band) * BAND_STRIDE + t.job.vllm_priority


class Lanes:
    """Admission across priority bands: highest band first, tenants sharing each band (service/tenants.py),
    with two guards.

    - Starvation: while higher bands are busy, a lower band with jobs waiting keeps at least `min_share` of
      the last WINDOW admissions (its next job goes first whenever it is below that share).
    - Reserve: the lowest band never holds more than max_num_seqs - `reserve_seqs` of the engine's sequence
      slots, so a job of a higher band finds a free slot at once instead of waiting for a bulk job to end."""

    WINDOW = 100

    def __init__(self, min_share: float, reserve_seqs: int, tenants: TenantShares | None = None) -> None:
        if not 0.0 <= min_share < 1.0:
            raise ValueError(f"band min share must be in [0, 1), got {min_share}")
        if reserve_seqs < 0:
            raise ValueError(f"reserved sequence slots must be >= 0, got {reserve_seqs}")
        self.min_share, self.reserve_seqs = min_share, reserve_seqs
        self.tenants = tenants or TenantShares()
        self.recent: deque[str] = deque(maxlen=self.WINDOW)

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> Lanes:
        tenants = TenantShares(parse_weights(settings.tenant_weights), settings.tenant_quantum, settings.tenant_burst)
        return cls(settings.band_min_share, settings.reserve_seqs, tenants)

    def order(self, backlog: list[HeldJob], limit: int | None = None) -> list[HeldJob]:
        """The backlog in admission order; limit: at most this many can go in now (the tenants' round is worked out
        that far in each band, the rest left in read order)."""
        backlog.sort(key=lambda t: (band_rank(t.band), t.job.vllm_priority, t.seq))
        by_band = [self.tenants.order(band, [t for t in backlog if t.band == band], limit) for band in BANDS]
        backlog[:] = [t for jobs in by_band for t in jobs]
        if self.min_share <= 0 or not backlog:
            return backlog
        first: list[HeldJob] = []
        for band in BANDS[1:]:
            head = next((t for t in backlog if t.band == band), None)
            busy_above = band_rank(backlog[0].band) < band_rank(band)
            if head is not None and busy_above and self.recent.count(band) < self.min_share * len(self.recent):
                head.guarded = True
                first.append(head)
        return first + [t for t in backlog if t not in first] if first else backlog

    def admitted(self, t: HeldJob) -> None:
        self.recent.append(t.band)
        self.tenants.admitted(t)

    def lowest_band_cap(self, engine: WorkerEngine) -> int:
        return max(1, engine.max_num_seqs - self.reserve_seqs)


def prepare(engine: WorkerEngine, t: HeldJob, made: MadePrompt) -> None:
    """Once per held job, with its prompt made (engine_input.make_prompt, service/prompt_pool.py): the prompt as the
    engine gets it, its SamplingParams (built here only: every run of the job uses them) and the KV blocks it will
    take there, from the engine. Raises RequestRejected (the job is rejected) for input the engine refuses; any
    other exception is the engine's failure."""
    room = None
    if t.job.max_tokens is None:  # the rest of the context (vLLM's None): known once the prompt is counted
        check_context_fits(engine.max_model_len, made.num_prompt_tokens, None, prompt_source(t.job))
        room = engine.max_model_len - made.num_prompt_tokens
    params = t.job.to_sampling_params(room=room)
    t.blocks_needed = engine.blocks_needed(made.num_prompt_tokens, params.max_tokens, params.num_samples)
    t.admission_tokens = made.num_prompt_tokens + params.max_tokens * params.num_samples
    t.engine_input, t.sampling_params = made.engine_input, params


def pick(
    backlog: list[HeldJob],
    engine: WorkerEngine,
    max_waiting: int,
    isolating: bool,
    lanes: Lanes,
    in_engine: list[HeldJob],
) -> list[HeldJob]:
    """Choose prepared jobs to hand to the engine now: by band, then priority (Lanes), within the
    waiting-queue cap, the lowest band's slot cap and the free KV blocks the engine's waiting queue will
    not take (both the engine's own figures). Suspects (from a step that raised, or recovered from a dead
    worker) run one at a time with nothing beside them, which pins the failure on one job; the least tried
    first, so every suspect runs once before any is retried (what lets the breaker see a broken engine).

    A job of a higher band is not held back by lower-band jobs waiting in the engine: the engine admits it
    ahead of them (and takes a seat from a running one, pagedq/engine/core/seats.py), so the cap and the KV budget it is
    checked against leave those out."""
    if not backlog or isolating:
        return []
    suspects = [t for t in backlog if t.state is JobState.SUSPECT]
    if suspects:  # wait for the engine to empty, then run the next suspect alone
        return [] if engine.has_unfinished_requests() else [min(suspects, key=lambda t: (t.attempts, t.seq))]
    budget = engine.num_free_blocks - engine.waiting_blocks_needed
    room = max_waiting - engine.num_waiting_requests
    lowest_room = lanes.lowest_band_cap(engine) - sum(1 for t in in_engine if t.band == BANDS[-1])
    behind = _waiting_behind(in_engine)
    bands = {t.band for t in backlog}
    if not any(room + behind[band_rank(b)][0] > 0 and (b != BANDS[-1] or lowest_room > 0) for b in bands):
        return []  # no band has room (most turns of a busy engine): the order need not be worked out
    ordered = lanes.order(backlog, limit=max(1, room + max(count for count, _ in behind)))
    chosen: list[HeldJob] = []
    for t in ordered:
        count, blocks = behind[band_rank(t.band)]
        if room + count <= 0:
            continue  # its band and the ones above fill the waiting cap
        if t.band == BANDS[-1]:
            if lowest_room <= 0:
                continue  # the reserved slots stay free for the bands above
            lowest_room -= 1
        # Always let one job through when the engine has nothing waiting ahead of it: it queues for blocks itself.
        if t.blocks_needed > budget + blocks and (chosen or engine.num_waiting_requests > count):
            break
        budget -= t.blocks_needed
        room -= 1
        chosen.append(t)
    return chosen


def _waiting_behind(in_engine: list[HeldJob]) -> list[tuple[int, int]]:
    """Per band rank: the jobs of lower bands still waiting in the engine, and the KV blocks they will take."""
    waiting = [t for t in in_engine if t.waiting_in_engine]
    return [
        (
            sum(1 for t in waiting if band_rank(t.band) > rank),
            sum(t.blocks_needed for t in waiting if band_rank(t.band) > rank),
        )
        for rank in range(len(BANDS))
    ]
