"""What the worker does when something fails: a poison job, a broken engine, an unreachable Redis.

- A step raises: the culprit is one of the jobs in the batch. All leave the engine; each is rerun alone
  (a suspect), least tried first, so only the culprit keeps failing, and it is dead-lettered once it has
  used max_attempts runs (a run in a failed batch counts; no job is condemned without a run alone).
- A job kills its worker (a segfault, an OOM kill): every job that worker held is recovered (its own pending
  list at restart, or XAUTOCLAIM by another worker) as a suspect, charged one run for the lost one, and run
  alone; each run alone is recorded in the queue's runs hash before it starts, so the next crash is charged
  to the one job that was running. Only that job reaches max_attempts; the others complete.
- The engine itself is broken (a lost GPU, a CUDA error that poisons the context): then every job fails
  alone, and dead-lettering them in turn would empty the whole queue into the dead-letter stream. Once
  `engine_failure_limit` different jobs have each failed alone with no good step in between, the worker
  asks the engine for one token of a one-token canary prompt. If that works, the jobs are poison after all
  (several at once) and isolation goes on; if not, the fault is the worker's: it stops without settling
  anything (exit status 3) and hands its jobs back (leases.py): healthy workers take them at once.
- The engine raises taking a job in (preparing its prompt, add_request) with anything but RequestRejected (the
  caller's fault: the job is rejected): the engine's failure. It is a failed run of that job: retried as a suspect,
  dead-lettered after max_attempts.
- Redis is unreachable (a restart, a failover): the worker keeps stepping the jobs it holds; their deltas and
  final records wait in the publisher's buffer and go out with the first round trip once Redis answers. Past
  `redis_outage_s` it exits (status 4) and, nothing being acknowledged, the jobs are redelivered. A pipeline
  whose reply was lost may be sent twice: final records are written once whatever happens (FINALIZE), and
  clients skip deltas by position.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedq.worker.protocol import scripts
from pagedq.worker.service.admission import Intake
from pagedq.worker.service.context import ServiceContext
from pagedq.worker.service.engine_api import RequestOutput, SamplingParams, WorkerEngine
from pagedq.worker.service.held import HeldJob, JobState
from pagedq.worker.service.leases import Leases, never_ran

EXIT_ENGINE_BROKEN = 3  # process status when the breaker stopped the worker: restart it
EXIT_REDIS_LOST = 4  # process status when Redis stayed unreachable past redis_outage_s
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)
CANARY_MAX_STEPS = 8  # a one-token request finishes in one step; a few more allow for a busy scheduler
PING_EVERY_S = (0.05, 1.0)  # first and longest wait between pings while Redis is down (doubling)
_canary_ids = itertools.count()


class EngineBreaker:
    """Counts distinct jobs failing alone since the last good step; `limit` of them means a broken engine."""

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


def wait_for_redis(redis_client: Any, step: Callable[[], bool], give_up_at: Callable[[], float]) -> None:
    """Ping until Redis answers. Between pings run `step` (one engine step; False when there was nothing to do,
    then sleep instead). Once time.monotonic() passes give_up_at() the last connection error is raised."""
    wait, next_ping = PING_EVERY_S[0], 0.0
    while True:
        now = time.monotonic()
        if now >= next_ping:
            try:
                redis_client.ping()
                return
            except REDIS_DOWN:
                if now >= give_up_at():
                    raise
            next_ping, wait = now + wait, min(wait * 2, PING_EVERY_S[1])
        if not step():
            time.sleep(max(0.0, min(next_ping, give_up_at()) - time.monotonic()))


class Recovery:
    """The loop's failure handling, called by the loop with the jobs at hand; it holds what it acts on."""

    def __init__(self, ctx: ServiceContext, engine: WorkerEngine, intake: Intake, leases: Leases) -> None:
        self.r, self.s, self.keys, self.log, self.counters = ctx.redis, ctx.settings, ctx.keys, ctx.log, ctx.counters
        self.held, self.stop = ctx.held, ctx.stop
        self.engine, self.intake, self.publisher, self.leases = engine, intake, intake.publisher, leases
        self.breaker = EngineBreaker(ctx.settings.engine_failure_limit)

    def step_succeeded(self) -> None:
        self.breaker.step_succeeded()

    def leave_engine(self, t: HeldJob) -> RequestOutput | None:
        """Abort t in the engine; its state is the caller's to set next."""
        try:
            return self.engine.abort_request(t.request_id)
        except Exception as exc:
            self.log.error("abort_failed", job_id=t.id, error=repr(exc))
            return None

    def leave_unstarted(self) -> int:
        """A drain finishes what runs, not what waits: the jobs in the engine's waiting queue that never ran leave it,
        to be handed back to the stream at stop (Leases.hand_back) for another worker, not run late by this one."""
        unstarted = [t for t in self.held.in_state(JobState.IN_ENGINE) if never_ran(t)]
        for t in unstarted:
            self.leave_engine(t)
        return len(unstarted)

    def on_step_error(self, exc: Exception) -> None:
        """A step raised: with one job in the batch it is the culprit, otherwise every job becomes a suspect."""
        batch = self.held.in_state(JobState.IN_ENGINE)
        self.log.error("engine_step_failed", error=repr(exc), batch=len(batch))
        for t in batch:
            self.leave_engine(t)
        if len(batch) == 1:
            self.job_error(batch[0], exc)
            return
        for t in batch:
            t.move(JobState.SUSPECT)
            t.reset_output()

    def admission_failed(self, t: HeldJob, exc: Exception) -> None:
        """The engine raised taking t in (preparing it or adding it) with anything but RequestRejected: the
        engine's failure, not the job's verdict. It counts as a failed run of t (else an engine that always fails
        there would retry t forever) and goes where any failed run goes (job_error); it counts towards the breaker
        only when nothing else is in the engine (a failure alone, and the canary's steps would eat other outputs)."""
        t.attempts += 1
        self.job_error(t, exc, alone=not self.engine.has_unfinished_requests())

    def job_error(self, t: HeldJob, exc: Exception, alone: bool = True) -> None:
        """A run of t failed (alone: with nothing else in the engine): t is retried as a suspect, or dead-lettered
        once it has used max_attempts runs."""
        t.last_error = f"{type(exc).__name__}: {exc}"
        self.log.warning("job_attempt_failed", job_id=t.id, attempts=t.attempts, error=t.last_error)
        if alone and self.breaker.job_failed_alone(t.id) and not self._engine_answers_canary():
            self._stop_now("engine_broken", EXIT_ENGINE_BROKEN, exc, failed_alone=self.breaker.num_failed_alone)
        elif t.attempts >= self.s.max_attempts:
            self.intake.dead_letter(t, "the job failed in the engine")
            self.held.finish(t)
            return
        t.move(JobState.SUSPECT)
        t.reset_output()

    def may_run_alone(self, t: HeldJob) -> bool:
        """Before a suspect runs alone: record the run in Redis first (if its worker dies during it, the job
        is charged), unless it has already used max_attempts runs and has failed alone at least once; then
        it is dead-lettered. A job is never condemned for a batch it was only part of."""
        if t.runs_alone > 0 and t.attempts >= self.s.max_attempts:
            self.intake.dead_letter(
                t, "its worker died each time it ran alone" if t.recovered else "the job failed in the engine"
            )
            self.held.finish(t)
            return False
        self.r.hincrby(self.keys.runs, t.id, 1)  # before the run, so that a crash during it is charged to it
        t.runs_alone += 1
        return True

    def _engine_answers_canary(self) -> bool:
        """One greedy token for a one-token prompt, alone in the engine (isolation left nothing else in it)."""
        request_id = f"pagedq-canary-{next(_canary_ids)}"
        try:
            self.engine.add_request(request_id, [0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            for _ in range(CANARY_MAX_STEPS):
                if any(out.request_id == request_id and out.finished for out in self.engine.step()):
                    self.breaker.step_succeeded()
                    self.log.warning("engine_answers_canary", detail="several poison jobs, not a broken engine")
                    return True
        except Exception as exc:
            self.log.error("engine_canary_failed", error=repr(exc))
        with contextlib.suppress(Exception):  # a broken engine may not even abort: the worker is stopping anyway
            self.engine.abort_request(request_id)
        return False

    def ride_out_outage(self, exc: Exception, step: Callable[[], None]) -> None:
        """Redis is unreachable: keep generating (step: the loop's engine step), buffer the results, reconnect;
        or give up past the limit."""
        self.log.warning("redis_unavailable", error=repr(exc), held=len(self.held), buffered=len(self.publisher))
        started = time.monotonic()

        def step_if_busy() -> bool:
            if not self.engine.has_unfinished_requests():
                return False
            step()
            return True

        try:
            wait_for_redis(self.r, step_if_busy, lambda: min(started + self.s.redis_outage_s, self.stop.by))
        except REDIS_DOWN as lost:
            self._stop_now("redis_lost", EXIT_REDIS_LOST, lost, seconds=round(time.monotonic() - started, 3))
            return
        self.leases.ensure_group()  # a Redis that came back empty has neither the group nor the scripts
        scripts.load_all(self.r)
        self.counters.outage_ridden_out()
        self.log.info("redis_reconnected", seconds=round(time.monotonic() - started, 3), buffered=len(self.publisher))

    def _stop_now(self, event: str, exit_code: int, exc: Exception, **fields: Any) -> None:
        """Stop at once and settle nothing more: the jobs are fine, the worker's engine or Redis is not."""
        self.log.error(event, error=repr(exc), unacknowledged=len(self.held), **fields)
        self.stop.now(exit_code)
