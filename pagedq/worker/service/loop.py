"""The service loop: Redis in, continuous batching, Redis out.

Each turn of the loop is one pipeline round trip (exchange.py: this step's deltas and final records, the cancel
check, and a non-blocking XREADGROUP sized to what the engine can take), then admission, deadline and cancel
enforcement, and one engine step. Only when the engine is idle does the read BLOCK. Lease renewal, claiming of
dead workers' jobs and the heartbeat run on timers, off the per-step path.

Front doors (front_door.py) and a metrics sink (snapshot.py) are protocols: what implements them is built
outside the service layer and passed in (pagedq/worker/assembly.py builds them from the settings).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.keys import BANDS
from pagedq.worker.service.absorb import absorb
from pagedq.worker.service.admission import Intake, Lanes, engine_priority, pick
from pagedq.worker.service.admit_delay import AdmitDelays
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.context import ServiceContext
from pagedq.worker.service.engine_api import ContextLengthExceeded, RequestRejected, WorkerEngine, require_engine
from pagedq.worker.service.exchange import Exchange
from pagedq.worker.service.finish import Finisher
from pagedq.worker.service.front_door import FrontDoor
from pagedq.worker.service.heartbeat import Heartbeat
from pagedq.worker.service.held import HeldJob, JobState
from pagedq.worker.service.holding import Holding
from pagedq.worker.service.leases import Leases
from pagedq.worker.service.loras import WorkerLoras
from pagedq.worker.service.prompt_pool import Prompts
from pagedq.worker.service.publisher import Publisher
from pagedq.worker.service.recovery import REDIS_DOWN, Recovery
from pagedq.worker.service.snapshot import EngineFigures, MetricsSink, WorkerSnapshot, costly_figures
from pagedq.worker.service.timers import Timers
from pagedq.worker.service.tokenizer_files import publish_tokenizer
from pagedq.worker.service.turn_clock import TurnClock


class ServiceLoop:
    def __init__(
        self,
        engine: WorkerEngine,
        redis_client: Any,
        settings: WorkerSettings,
        front_doors: Sequence[FrontDoor] = (),
        metrics: MetricsSink | None = None,
    ) -> None:
        require_engine(engine)
        self.ctx = ctx = ServiceContext.build(redis_client, settings)
        self.engine, self.r, self.s, self.keys, self.log = engine, redis_client, settings, ctx.keys, ctx.log
        self.held, self.stop, self.counters = ctx.held, ctx.stop, ctx.counters
        self.front_doors, self.metrics = tuple(front_doors), metrics
        self.publisher = Publisher(ctx, getattr(engine, "tokenizer", None))
        self.intake = Intake(ctx, self.publisher)
        self.lanes = Lanes.from_settings(settings)
        self.leases = Leases(ctx)
        self.exchange = Exchange(ctx, self.publisher, self.front_doors)
        self.recovery = Recovery(ctx, engine, self.intake, self.leases)
        self.finisher = Finisher(ctx, self.publisher, self.recovery, metrics)
        self.holding = Holding(ctx, engine, self.publisher, self.intake, self.finisher)
        self.heartbeat = Heartbeat(ctx, self.front_doors)
        self.timers = Timers(ctx, self.leases, self.holding, self.heartbeat, self.front_doors, metrics, self.snapshot)
        self.prompts = Prompts(engine, settings, self.log)  # prompt-making, on the loop thread or in its pool
        self.loras = WorkerLoras(ctx, engine)  # LoRA adapters by name: its --lora-modules load here, or it fails
        self.admit_delays = AdmitDelays()  # read-to-admit, per band
        self.turn_clock = TurnClock()  # where the turns' time goes (bench worker reports it)
        self.cancel_possible = True  # the cancel set was non-empty at the last look
        self._burst_done = False
        self._unstarted_left = False  # the drain's first turn took the jobs that never ran out of the engine

    @property
    def exit_code(self) -> int:
        """0, or why the worker stopped itself (recovery.EXIT_ENGINE_BROKEN, EXIT_REDIS_LOST)."""
        return self.stop.exit_code

    @property
    def stopping(self) -> bool:
        return self.stop.requested

    @property
    def num_redis_outages(self) -> int:
        return self.counters.redis_outages

    @property
    def tokens_generated(self) -> int:
        return self.counters.tokens_generated

    @property
    def stats(self) -> dict[str, int]:
        """Final records written so far, by status."""
        return self.counters.by_status()

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
                    self.recovery.ride_out_outage(exc, self._step)
        finally:
            self._shutdown()
        return self.exit_code

    def request_stop(self, drain_timeout_s: float | None = None) -> None:
        """Stop admitting; finish in-flight jobs within the drain timeout; leave the rest unacknowledged."""
        if not self.stop.requested:
            self.stop.requested = True
            timeout = self.s.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
            self.stop.by = time.monotonic() + timeout
            self.log.info("worker_draining", in_flight=self.engine.num_unfinished_requests, drain_timeout_s=timeout)
        else:  # a second signal: stop now
            self.stop.by = 0.0

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.request_stop()

    def _start(self) -> None:
        self.leases.ensure_group()
        scripts.load_all(self.r)
        publish_tokenizer(self.r, self.keys, self.s.model, self.engine, self.prompts.bound.chars_per_token)  # /tokenize
        recovered = 0
        for band in BANDS:
            entries = self.leases.read_own_pending(band)
            recovered += len(entries)
            self.holding.take_in(entries, band, recovered=True)
        self.log.info(
            "worker_started",
            queue=self.s.queue,
            recovered=recovered,
            burst=self.s.burst,
            device=self.s.device,
            model=self.s.model,
        )
        self.timers.beat(time.monotonic())

    def _done(self) -> bool:
        if self.stop.requested:
            return not self.engine.has_unfinished_requests() or time.monotonic() >= self.stop.by
        return self._burst_done

    def _shutdown(self) -> None:
        for t in self.held.in_state(JobState.IN_ENGINE):
            self.recovery.leave_engine(t)  # drain timed out (or a stop now): handed back below
        handed_back = (0, 0)
        try:
            self.exchange.flush()  # first: a job whose final record goes out here is not handed back
            handed_back = self.leases.hand_back(list(self.held))
            self.heartbeat.remove()
        except Exception as exc:  # Redis gone: nothing more to do; unacked jobs are claimed after the lease
            self.log.error("shutdown_flush_failed", error=repr(exc))
        self.prompts.close()
        for door in self.front_doors:
            door.close()  # requeues the messages of jobs left unfinished
        if self.metrics is not None:
            self.metrics.close()
        readded, released = handed_back
        self.log.info(
            "worker_stopped",
            unacknowledged=len(self.held) - readded,
            requeued=readded,
            released=released,
            duplicate_finals=self.publisher.duplicates,  # runs whose job had its final record already
            **self.counters.by_status(),
        )

    # ------------------------------------------------------------------ one turn
    def _turn(self) -> None:
        clock = self.turn_clock
        clock.start()
        if self.timers.run_due(time.monotonic()):
            self.cancel_possible = True  # a revoke through a front door: check held jobs and the next ones read
        self.loras.refresh(time.monotonic())  # adapters registered or unregistered on the queue
        if self.front_doors and not self.stopping:
            count = self.holding.room()
            room = count - count // 2  # the front doors take half of the room per turn, the streams the rest
            for door in self.front_doors:
                jobs = door.poll(room, self.intake)
                room -= len(jobs)
                self.holding.hold(jobs, check_cancel=self.cancel_possible)
        clock.lap("other")
        if self.stopping and not self._unstarted_left:
            self._unstarted_left = True
            self.log.info("unstarted_jobs_left_engine", count=self.recovery.leave_unstarted())
        self._sync()
        clock.lap("round_trip")
        if not self.stopping:
            self._admit()
        clock.lap("admit")
        self.finisher.enforce_deadlines()
        clock.lap("other")
        if self.engine.has_unfinished_requests():
            self._step()
        elif self.prompts.busy:  # nothing to step: wait for the prompts being made, not on Redis
            self.prompts.wait(self.s.prompt_wait_s)

    def _sync(self) -> None:
        """The turn's round trip (exchange.py), then what its replies say: cancels, new jobs, burst's end."""
        idle = not self.engine.has_unfinished_requests() and not self.held.waiting()
        job_ids = self.held.job_ids() if self.cancel_possible else []
        replies = self.exchange.turn(job_ids, idle, self.stopping, self.holding.room)
        self.cancel_possible = bool(replies.cancel_count)
        if job_ids:
            self.finisher.cancel(replies.cancelled)
        entries = 0
        for band, batch in replies.batches:
            entries += len(batch)
            self.holding.take_in(batch, band, check_cancel=self.cancel_possible)
        if replies.burst_pending is not None and not entries and not len(self.publisher) and not self.held:
            if replies.burst_pending:
                time.sleep(0.05)  # jobs held by other (maybe dead) workers: wait for them or their leases
            else:
                self._burst_done = True

    # ------------------------------------------------------------------ admitting
    def _admit(self) -> None:
        in_engine = self.held.in_state(JobState.IN_ENGINE)
        isolating = any(t.alone for t in in_engine)
        ready, failed = self.prompts.ready(self.held.waiting())
        for t, exc in failed:
            self._engine_refused(t, exc)
        for t in pick(ready, self.engine, self.s.max_waiting, isolating, self.lanes, in_engine):
            alone = t.state is JobState.SUSPECT
            if alone and not self.recovery.may_run_alone(t):
                continue
            if t.job.deadline is not None and time.time() >= t.job.deadline:
                self.finisher.finalize(t, "expired", "deadline passed before the job started")
                continue
            self._add_to_engine(t, alone)
            self.lanes.admitted(t)

    def _engine_refused(self, t: HeldJob, exc: Exception) -> None:
        """RequestRejected is the engine's verdict on the caller's input (too long, token out of vocab, ...): the
        job is rejected. Anything else, a ValueError included, is the engine's failure: retried (recovery)."""
        if isinstance(exc, RequestRejected):
            self.intake.reject(t, str(exc), exc.code if isinstance(exc, ContextLengthExceeded) else None)
            self.held.finish(t)
        else:
            self.recovery.admission_failed(t, exc)

    def _add_to_engine(self, t: HeldJob, alone: bool) -> None:
        try:
            self.loras.add_request(t, engine_priority(t))  # under its adapter, if it names one
        except Exception as exc:
            self._engine_refused(t, exc)
            return
        t.move(JobState.IN_ENGINE)
        t.alone, t.admitted_at = alone, time.time()
        t.attempts += 1
        self.admit_delays.admitted(t)

    # ------------------------------------------------------------------ stepping
    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.recovery.on_step_error(exc)
            return
        finally:
            self.turn_clock.lap("engine_step")
        self.recovery.step_succeeded()
        now = time.time()
        for out in outputs:
            t = self.held.by_request_id(out.request_id)
            self.counters.generated(self.loras.generated(t, out))  # counted per adapter too
            if t is not None and t.in_engine:
                settled = absorb(t, out, now, self.publisher)
                if settled is not None:
                    self.finisher.finalize(t, *settled)
        self.turn_clock.lap("outputs")

    # ------------------------------------------------------------------ figures
    def snapshot(self, costly: bool = False) -> WorkerSnapshot:
        """The loop's figures now; costly adds those that take a call each (engine.stats(), each door's depth)."""
        preemptions, seats, depths = costly_figures(self.engine, self.front_doors, self.log) if costly else (0, 0, {})
        return WorkerSnapshot(
            state="draining" if self.stopping else "running",
            held_jobs=len(self.held),
            stats=self.counters.by_status(),
            engine=EngineFigures.of(self.engine),
            tokens_generated=self.counters.tokens_generated,
            redis_outages=self.counters.redis_outages,
            preemptions=preemptions,
            seat_preemptions=seats,
            tenants=self.lanes.tenants.figures(self.held),
            loras=self.loras.figures(self.held),
            admit_delays=self.admit_delays.summary(),
            front_door_depths=depths,
        )
