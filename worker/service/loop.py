"""The worker loop: Redis in, continuous batching, Redis out.

Each turn of the loop is one pipeline round trip (this step's deltas and final records, the cancel
check, and a non-blocking XREADGROUP sized to what the engine can take), then admission, deadline and
cancel enforcement, and one engine step. Only when the engine is idle does the read BLOCK. Lease
renewal, claiming of dead workers' jobs and the heartbeat run on timers, off the per-step path.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from typing import Any

import structlog

from worker.protocol import scripts
from worker.protocol.connection import refuse_cluster
from worker.protocol.keys import BANDS, GROUP, QueueKeys, band_rank
from worker.protocol.replies import text
from worker.service.absorb import absorb, absorb_abort
from worker.service.admission import Intake, Lanes, engine_priority, pick, prepare
from worker.service.config import WorkerSettings
from worker.service.engine_api import RequestOutput, WorkerEngine
from worker.service.heartbeat import Heartbeat
from worker.service.held import HeldJob, HeldJobs, JobState
from worker.service.leases import Leases
from worker.service.publisher import Publisher
from worker.service.recovery import REDIS_DOWN, EngineBreaker, Recovery

STATUSES = ("completed", "failed", "cancelled", "expired", "rejected")


class Worker(Recovery):
    def __init__(self, engine: WorkerEngine, redis_client: Any, settings: WorkerSettings) -> None:
        if not isinstance(engine, WorkerEngine):
            raise TypeError(f"{type(engine).__name__} does not implement worker.service.engine_api.WorkerEngine")
        self.engine, self.r, self.s = engine, redis_client, settings
        self.keys = QueueKeys(settings.queue)
        self.log = structlog.get_logger("pagedq.worker").bind(worker=settings.name)
        self.publisher = Publisher(self.keys, settings.name, settings.result_ttl_s, settings.completions_maxlen)
        self.stats = {status: 0 for status in STATUSES}
        self.intake = Intake(self.keys, settings, self.publisher, self.log, self.stats)
        self.lanes = Lanes(settings.band_min_share, settings.reserve_seqs)
        self.leases = Leases(redis_client, self.keys, settings.name, settings.lease_ms)
        self.celery = None
        if settings.celery_broker:  # kombu has no Redis Cluster transport: one line here, not a kombu traceback
            refuse_cluster("Celery's broker and backend (kombu)", settings.celery_broker, settings.celery_backend)
            from worker.celery.intake import CeleryIntake  # celery is only imported when the front door is on

            self.celery = CeleryIntake.for_worker(self)
        self.heartbeat = Heartbeat(
            redis_client,
            self.keys,
            settings.name,
            settings.heartbeat_every_s,
            {
                "device": settings.device,
                "model": settings.model,
                "celery_queue": self.celery.name if self.celery else None,
            },
        )
        self.metrics = None
        if settings.metrics_port is not None:
            from worker.ops.metrics import Metrics

            self.metrics = Metrics(settings.metrics_port, settings.queue, addr=settings.metrics_addr)
        self.breaker = EngineBreaker(settings.engine_failure_limit)
        self.exit_code = 0  # set by recovery.py when the worker stops itself (broken engine, Redis lost)
        self.tokens_generated = 0  # counted per step; the metrics timer exports it
        self.held = HeldJobs()  # every job this worker holds, by JobKey, each with its JobState
        self.cancel_possible = True  # the cancel set was non-empty at the last look
        self.stopping = False
        self.stop_by = math.inf
        self._burst_done = False
        self._timers = {"renew": 0.0, "claim": 0.0, "beat": 0.0, "metrics": 0.0}
        self.num_redis_outages = 0

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        """Serve until stopped (SIGTERM/SIGINT or request_stop()) or, in burst mode, until nothing is left."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        self._start()
        try:
            while not self._done():
                try:
                    self._turn()
                except REDIS_DOWN as exc:
                    self._ride_out_outage(exc)
        finally:
            self._shutdown()
        return self.exit_code

    def request_stop(self, drain_timeout_s: float | None = None) -> None:
        """Stop admitting; finish in-flight jobs within the drain timeout; leave the rest unacknowledged."""
        if not self.stopping:
            self.stopping = True
            timeout = self.s.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
            self.stop_by = time.monotonic() + timeout
            self.log.info("worker_draining", in_flight=self.engine.num_unfinished_requests, drain_timeout_s=timeout)
        else:  # a second signal: stop now
            self.stop_by = 0.0

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.request_stop()

    def _start(self) -> None:
        self.leases.ensure_group()
        scripts.load_all(self.r)
        recovered = 0
        for band in BANDS:
            entries = self.leases.read_own_pending(band)
            recovered += len(entries)
            self._hold(self.intake.parse(entries, recovered=True, band=band))
        self.log.info(
            "worker_started",
            queue=self.s.queue,
            recovered=recovered,
            burst=self.s.burst,
            device=self.s.device,
            model=self.s.model,
        )
        self._beat(time.monotonic())

    def _done(self) -> bool:
        if self.stopping:
            return not self.engine.has_unfinished_requests() or time.monotonic() >= self.stop_by
        return self._burst_done

    def _shutdown(self) -> None:
        for t in self.held.in_state(JobState.IN_ENGINE):
            self._leave_engine(t)  # drain timed out: left unacknowledged for redelivery
        try:
            self._flush()
            self.heartbeat.remove()
        except Exception as exc:  # Redis gone: nothing more to do; unacked jobs will be redelivered
            self.log.error("shutdown_flush_failed", error=repr(exc))
        if self.celery is not None:
            self.celery.close()  # requeues the Celery messages of jobs left unfinished
        if self.metrics is not None:
            self.metrics.close()
        self.log.info("worker_stopped", unacknowledged=len(self.held), **self.stats)

    # ------------------------------------------------------------------ one turn
    def _turn(self) -> None:
        now = time.monotonic()
        self._maintenance(now)
        if self.celery is not None and not self.stopping:
            count = self._read_count()  # Celery takes half of the room per turn, the stream the rest
            self._hold(self.celery.poll(count - count // 2), check_cancel=self.cancel_possible)
        self._sync()
        if not self.stopping:
            self._admit()
        self._enforce_deadlines()
        if self.engine.has_unfinished_requests():
            self._step()

    def _read_count(self, band: str | None = None) -> int:
        """Room to read ahead: max_waiting minus the jobs held and not yet running, of this band and the
        bands above it (so a backlog of bulk jobs never stops interactive ones from being read)."""
        if self.stopping:
            return 0
        if band is None:
            return self.s.max_waiting - self.engine.num_waiting_requests - len(self.held.waiting())
        rank = band_rank(band)
        queued = sum(1 for t in self.held if band_rank(t.band) <= rank and (not t.in_engine or t.waiting_in_engine))
        return self.s.max_waiting - queued

    def _sync(self) -> None:
        """One round trip: pending writes, cancel check, new jobs (blocking only when idle)."""
        idle = not self.engine.has_unfinished_requests() and not self.held.waiting()
        ops = self.publisher.take()
        pipe = self.r.pipeline(transaction=False)
        for op in ops:
            pipe.execute_command(*op)
        job_ids = self.held.job_ids() if self.cancel_possible else []
        names = ["cancel_count"]  # what each command after the writes answers, in order
        pipe.zcard(self.keys.cancelled)
        if job_ids:
            names.append("cancel_scores")
            pipe.zmscore(self.keys.cancelled, job_ids)
        check_burst = self.s.burst and idle and not self.stopping
        if check_burst:
            for band in BANDS:
                names.append(f"pending:{band}")
                pipe.xpending(self.keys.jobs_of(band), GROUP)
        names += self._queue_reads(pipe, idle)
        try:
            results = pipe.execute(raise_on_error=False)
        except REDIS_DOWN:
            self.publisher.restore(ops)  # not known to be written: send again after the outage
            raise
        self.publisher.check(self.r, ops, results[: len(ops)])
        self._settle()
        replies = dict(zip(names, results[len(ops) :], strict=True))
        for res in replies.values():
            if isinstance(res, Exception):
                raise res
        self.cancel_possible = bool(replies["cancel_count"])
        if job_ids:
            self._apply_cancels([j for j, score in zip(job_ids, replies["cancel_scores"]) if score is not None])
        pending = sum(replies[f"pending:{b}"]["pending"] for b in BANDS) if check_burst else None
        streams = {self.keys.jobs_of(b): b for b in BANDS}
        entries = 0
        for name in names:
            if name.startswith("read"):
                for stream, batch in replies[name] or []:
                    entries += len(batch)
                    self._hold(self.intake.parse(batch, band=streams[text(stream)]), check_cancel=self.cancel_possible)
        if not entries and check_burst and not len(self.publisher) and not self.held:
            if pending:
                time.sleep(0.05)  # jobs held by other (maybe dead) workers: wait for them or their leases
            else:
                self._burst_done = True

    def _queue_reads(self, pipe: Any, idle: bool) -> list[str]:
        """The XREADGROUPs of this round trip, added to pipe; their names in the replies."""
        # burst mode never blocks: it checks the pending count instead (and naps in _sync if others hold jobs)
        block = self.s.block_ms if idle and not self.s.burst and not self.stopping else None
        if block:  # idle: one blocking read over every band, woken by the first job in any of them
            if self.celery is not None:  # wake up often enough to poll the Celery queue too
                block = min(block, max(1, int(self.s.celery_poll_s * 1000)))
            pipe.xreadgroup(
                GROUP, self.s.name, {self.keys.jobs_of(b): ">" for b in BANDS}, count=self.s.max_waiting, block=block
            )
            return ["read"]
        names = []
        for band in BANDS:  # busy: each band read up to its own room, without blocking
            count = self._read_count(band)
            if count > 0:
                names.append(f"read:{band}")
                pipe.xreadgroup(GROUP, self.s.name, {self.keys.jobs_of(band): ">"}, count=count)
        return names

    def _flush(self) -> None:
        ops = self.publisher.take()
        if ops:
            pipe = self.r.pipeline(transaction=False)
            for op in ops:
                pipe.execute_command(*op)
            self.publisher.check(self.r, ops, pipe.execute(raise_on_error=False))
        self._settle()

    def _settle(self) -> None:
        """Celery jobs whose final records were just written: report to Celery's backend, then ack."""
        if self.publisher.settling:
            done, self.publisher.settling = self.publisher.settling, []
            if self.celery is not None:
                self.celery.settle(done)

    # ------------------------------------------------------------------ holding and admitting
    def _hold(self, jobs: list[HeldJob], check_cancel: bool = False) -> None:
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
            self._apply_cancels([j for j, score in zip(ids, scores) if score is not None])

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
            stream = self.keys.jobs_of(t.origin)
            self.publisher.ops += [("XACK", stream, GROUP, t.entry_id), ("XDEL", stream, t.entry_id)]
        return False

    def _admit(self) -> None:
        in_engine = self.held.in_state(JobState.IN_ENGINE)
        isolating = any(t.alone for t in in_engine)
        lowest = sum(1 for t in in_engine if t.band == BANDS[-1])
        ready = [t for t in self.held.waiting() if t.prepared or self._prepare(t)]
        for t in pick(ready, self.engine, self.s.max_waiting, isolating, self.lanes, lowest):
            alone = t.state is JobState.SUSPECT
            if alone and not self._may_run_alone(t):
                continue
            if t.job.deadline is not None and time.time() >= t.job.deadline:
                self._finalize(t, "expired", "deadline passed before the job started")
                continue
            self._add_to_engine(t, alone)
            self.lanes.admitted(t)

    def _prepare(self, t: HeldJob) -> bool:
        """The engine's view of a job before admission (admission.prepare); False when it was settled instead."""
        try:
            prepare(self.engine, t)
            return True
        except ValueError as exc:  # the engine's verdict on bad input (too long, token out of vocab, ...)
            self.intake.reject(t, str(exc))
            self.held.finish(t)
        except Exception as exc:
            self._job_error(t, exc)
        return False

    def _add_to_engine(self, t: HeldJob, alone: bool) -> None:
        if t.engine_input is None or t.sampling_params is None:  # admission prepares every job before it reaches here
            raise RuntimeError(f"job {t.key} reached the engine unprepared")
        try:
            self.engine.add_request(t.request_id, t.engine_input, t.sampling_params, priority=engine_priority(t))
        except ValueError as exc:  # the engine's verdict on bad input (too long, token out of vocab, ...)
            self.intake.reject(t, str(exc))
            self.held.finish(t)
            return
        except Exception as exc:
            self._job_error(t, exc)
            return
        t.move(JobState.IN_ENGINE)
        t.alone, t.admitted_at = alone, time.time()
        t.attempts += 1

    def _leave_engine(self, t: HeldJob) -> RequestOutput | None:
        """Abort t in the engine; its state is the caller's to set next."""
        try:
            return self.engine.abort_request(t.request_id)
        except Exception as exc:
            self.log.error("abort_failed", job_id=t.id, error=repr(exc))
            return None

    # ------------------------------------------------------------------ stepping
    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._on_step_error(exc)
            return
        self.breaker.step_succeeded()
        now = time.time()
        for out in outputs:
            self.tokens_generated += sum(len(c.token_ids) for c in out.outputs)
            t = self.held.by_request_id(out.request_id)
            if t is not None and t.in_engine:
                settled = absorb(t, out, now, self.publisher)
                if settled is not None:
                    self._finalize(t, *settled)

    # ------------------------------------------------------------------ cancel, deadlines, final records
    def _apply_cancels(self, job_ids: list[str]) -> None:
        for t in self.held.with_job_ids(set(job_ids)):
            self._stop_early(t, "cancelled", "cancelled by request")

    def _enforce_deadlines(self) -> None:
        for t in self.held.past_deadline(time.time()):
            self._stop_early(
                t,
                "expired",
                "deadline passed while running" if t.in_engine else "deadline passed before the job started",
            )

    def _stop_early(self, t: HeldJob, status: str, reason: str) -> None:
        """Cancel or expire a queued or running job; a running one keeps its partial output."""
        if t.in_engine:
            absorb_abort(t, self._leave_engine(t))
        self._finalize(t, status, reason)

    def _finalize(self, t: HeldJob, status: str, error: str | None = None) -> None:
        record = self.publisher.record(t, status, error)
        self.publisher.final(record, t.origin, t.entry_id)
        self.stats[status] += 1
        if self.metrics is not None:
            self.metrics.observe(record)
        self.held.finish(t)
        log = self.log.bind(job_id=t.id)
        if status == "completed":
            log.debug("job_finished", status=status, tokens=len(t.token_ids))
        else:
            log.info("job_finished", status=status, tokens=len(t.token_ids), error=error)

    # ------------------------------------------------------------------ timers
    def _maintenance(self, now: float) -> None:
        if now >= self._timers["renew"] and self.held:
            self._timers["renew"] = now + self.s.renew_interval
            for band in BANDS:
                ids = self.held.entry_ids(band)
                lost = self.leases.renew(band, ids) if ids else []
                if lost:
                    self.log.warning("lease_lost", band=band, entries=lost)  # keep going: the first final wins
        if now >= self._timers["claim"] and not self.stopping:
            self._timers["claim"] = now + self.s.claim_interval
            for band in BANDS:
                entries = self.leases.claim(band, self._read_count(band))  # _hold skips those we hold
                if entries:
                    self.log.info("jobs_claimed", band=band, count=len(entries))
                    self._hold(self.intake.parse(entries, recovered=True, band=band), check_cancel=True)
        if now >= self._timers["beat"]:
            self._beat(now)
        if self.celery is not None and self.celery.maintain(now):
            self.cancel_possible = True  # a Celery revoke: check held jobs and the next ones read at once
        if self.metrics is not None and now >= self._timers["metrics"]:
            self._timers["metrics"] = now + self.s.metrics_every_s
            try:
                self.metrics.update(self)
            except Exception as exc:  # metrics must never take the worker down
                self.log.error("metrics_update_failed", error=repr(exc))

    def _beat(self, now: float) -> None:
        self._timers["beat"] = now + self.s.heartbeat_every_s
        self.heartbeat.beat(self.engine, len(self.held), self.stats, "draining" if self.stopping else "running")
        self.r.zremrangebyscore(self.keys.cancelled, "-inf", time.time() - self.s.result_ttl_s)
