"""Celery messages into the worker's own admission: the Celery front door, consumed inside the worker loop.

This is a front door of the service loop (pagedq/worker/service/front_door.py), built from the settings by
pagedq/worker/assembly.py. Each turn the worker polls the Celery queue without blocking (kombu `basic_get`: RPOP,
and the message enters kombu's `unacked` hash), turns each `pagedq.generate` message into a held job (the task id is the
job id) and admits it with the native jobs. When a job is finished its final record goes through the same
FINALIZE script as any job; then `settle()` stores the result in Celery's result backend
(`mark_as_done`, `mark_as_failure`, or `mark_as_revoked` for a cancelled or expired job, as Celery's
worker stores revoked and expired tasks; these also complete chords) and only then acks the message.
Revokes arrive as Celery broadcast control messages: pagedq/worker/celery/control.py.

A worker may serve several Celery queues (`--celery-queue a,b`, like `celery worker -Q a,b`); it owns
every message on them, as a Celery worker does: a task it does not know fails (FAILURE, acked).

Why basic_get rather than a BRPOP consumer: a BRPOP left in flight when the worker stops pops a message
nobody reads. With basic_get a message is always in the list or in the unacked hash (kombu's own
RPOP-then-HSET gap aside). Unacked messages come back after the broker's visibility_timeout: restore
runs here on a timer, because no kombu event loop does it for us.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from typing import Any

from celery.app.task import Context
from kombu.serialization import loads

from pagedq.worker.celery.control import ControlListener
from pagedq.worker.client.core import make_job
from pagedq.worker.protocol.errors import GenerationFailed, JobRejected
from pagedq.worker.protocol.job import valid_job_id
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.protocol.trace_context import from_headers
from pagedq.worker.service.admission import Intake
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.held import CELERY_ORIGIN, HeldJob

TASK_NAME = "pagedq.generate"
ACCEPT = {"application/json"}  # never unpickle what comes off the broker


class CeleryIntake:
    def __init__(
        self,
        app: Any,
        redis_client: Any,
        keys: QueueKeys,
        worker_name: str,
        log: Any,
        queues: list[str] | None = None,
        poll_interval_s: float = 0.05,
    ) -> None:
        self.app, self.r, self.keys, self.worker_name = app, redis_client, keys, worker_name
        from pagedq.worker.celery.app import queue_of

        self.queues = [app.amqp.queues[name] for name in queues or [queue_of(app)]]
        self.log = log.bind(celery_queue=self.name)
        self.conn = app.connection_for_read()
        self.channel = self.conn.default_channel
        for queue in self.queues:
            queue(self.channel).declare()  # the exchange binding producers route through
        self.control = ControlListener(app, redis_client, keys, f"pagedq@{worker_name}", self.log)
        self.visibility_timeout = float(self.channel.visibility_timeout)
        self.restore_every_s = min(max(self.visibility_timeout / 4, 0.25), 30.0)
        self._poll_interval_s = poll_interval_s
        self.pending: dict[str, tuple[Any, Context]] = {}  # job id -> (kombu message, request context)
        self._next_poll = 0.0
        self._next_restore = 0.0

    @classmethod
    def from_settings(cls, settings: WorkerSettings, redis_client: Any, log: Any) -> CeleryIntake:
        """The front door a worker's settings describe (broker, backend, queues, visibility timeout)."""
        from pagedq.worker.celery.app import make_app, parse_queues

        s = settings
        queues = parse_queues(s.celery_queue)
        app = make_app(
            s.celery_broker,
            backend_url=s.celery_backend,
            queue=queues[0],
            visibility_timeout_s=s.celery_visibility_timeout_s,
        )
        return cls(app, redis_client, QueueKeys(s.queue), s.name, log, queues=queues, poll_interval_s=s.celery_poll_s)

    @property
    def poll_interval_s(self) -> float:
        """After an empty poll, the wait before the next (the idle loop blocks no longer than this)."""
        return self._poll_interval_s

    @property
    def name(self) -> str:
        """The queues served, as `-Q` takes them."""
        return ",".join(queue.name for queue in self.queues)

    # ------------------------------------------------------------------ intake
    def poll(self, count: int, intake: Intake) -> list[HeldJob]:
        """Up to count new jobs, without blocking, held through the loop's intake. After an empty poll, wait
        poll_interval_s before the next."""
        now = time.monotonic()
        if count <= 0 or now < self._next_poll:
            return []
        messages: list[Any] = []
        for queue in self.queues:  # in the order given, like a Celery worker's -Q
            while len(messages) < count:
                message = self.channel.basic_get(queue.name, no_ack=False)
                if message is None:
                    break
                messages.append(message)
        if len(messages) < count:  # every queue is empty
            self._next_poll = now + self._poll_interval_s
        parsed = [p for p in (self._parse(m) for m in messages) if p is not None]
        return self._admit_parsed(parsed, intake) if parsed else []

    def _admit_parsed(self, parsed: list[tuple[Any, Context, Any, str | None]], intake: Intake) -> list[HeldJob]:
        # One round trip: finished already? (redelivered after a crash between FINALIZE and ack) and
        # count this delivery (a redelivered job is a suspect: it runs alone, see pagedq/worker/service/holding.py).
        pipe = self.r.pipeline(transaction=False)
        for _, ctx, _, _ in parsed:
            pipe.get(self.keys.final(ctx.id))
            pipe.hincrby(self.keys.celery_deliveries, ctx.id, 1)  # > 1: recovered from a dead worker
        replies = pipe.execute()
        jobs = []
        for i, (message, ctx, job, error) in enumerate(parsed):
            final, deliveries = replies[2 * i], int(replies[2 * i + 1])
            old = self.pending.get(ctx.id)
            if old is not None:  # a redelivery of a job we hold (visibility timeout passed): keep running,
                old[0].ack()  # answer through the newest delivery (restore dropped the old tag)
            self.pending[ctx.id] = (message, ctx)
            if final is not None:
                self.settle([ctx.id])
            elif error is not None:
                intake.reject_delivery(ctx.id, CELERY_ORIGIN, error)
            elif old is None:
                jobs.append(intake.track(CELERY_ORIGIN, None, job, recovered=deliveries > 1, enqueued_at=time.time()))
        return jobs

    def _parse(self, message: Any) -> tuple[Any, Context, Any, str | None] | None:
        """(message, request context, job or None, rejection reason or None); None for junk (acked)."""
        headers = message.headers or {}
        task_id, task = headers.get("id"), headers.get("task")
        if task_id and not (isinstance(task_id, str) and valid_job_id(task_id)):
            self._refuse_task_id(message, task_id, task)
            return None
        try:
            args, kwargs, embed = loads(message.body, message.content_type, message.content_encoding, accept=ACCEPT)
        except Exception as exc:
            if not task_id:
                self.log.error("celery_message_dropped", error=f"undecodable message without a task id: {exc!r}")
                message.ack()
                return None
            return message, Context(id=task_id, task=task), None, f"cannot decode the message: {exc}"
        if not task_id:  # protocol 1 messages carry the id in the body; Celery 4+ sends protocol 2
            self.log.error("celery_message_dropped", error="no task id in the headers (protocol 1?)")
            message.ack()
            return None
        ctx = _context(message, headers, args, kwargs, embed)
        try:
            return message, ctx, _job_from_task(task, task_id, args, kwargs, headers), None
        except JobRejected as exc:
            return message, ctx, None, str(exc)

    def _refuse_task_id(self, message: Any, task_id: Any, task: Any) -> None:
        """A task id outside the job id grammar names no pagedq key: fail the task in Celery's backend only."""
        error = JobRejected(f"invalid task id {str(task_id)[:64]!r}: a job id is [A-Za-z0-9_.:-]{{1,200}}")
        self.log.warning("job_rejected", job_id=repr(task_id)[:64], error=str(error))
        try:
            self.app.backend.mark_as_failure(str(task_id), error, request=Context(id=str(task_id), task=task))
        except Exception as exc:  # the backend refused the id too: nobody can wait on it anyway
            self.log.error("celery_result_store_failed", job_id=repr(task_id)[:64], error=repr(exc))
        message.ack()

    # ------------------------------------------------------------------ results
    def settle(self, done: list[str]) -> None:
        """Report finished jobs to Celery (result backend, chords, callbacks), then ack their messages.
        The final record in Redis is authoritative: the first one written wins over a rerun's."""
        if not done:
            return
        pipe = self.r.pipeline(transaction=False)
        for job_id in done:
            pipe.get(self.keys.final(job_id))
        finals = pipe.execute()
        settled = []
        for job_id, raw in zip(done, finals):
            message, ctx = self.pending.pop(job_id, (None, None))
            if message is None:
                continue
            try:
                self._report(ctx, json.loads(raw) if raw else None)
            except Exception as exc:  # backend down: leave unacked; it comes back after the visibility timeout
                self.log.error("celery_result_store_failed", job_id=job_id, error=repr(exc))
                continue
            message.ack()
            settled.append(job_id)
        if settled:
            self.r.hdel(self.keys.celery_deliveries, *settled)

    def _report(self, ctx: Context, record: dict | None) -> None:
        backend = self.app.backend
        if record is None:
            backend.mark_as_failure(
                ctx.id, GenerationFailed("the final record expired before it was reported"), request=ctx
            )
        elif record["status"] == "rejected":
            backend.mark_as_failure(ctx.id, JobRejected(record["error"]), request=ctx)
        elif record["status"] == "failed":
            backend.mark_as_failure(ctx.id, GenerationFailed(record["error"]), request=ctx)
        elif record["status"] in ("cancelled", "expired"):  # Celery's words for a revoked / an expired task
            # (the partial output stays in the pagedq final record: Client.result(task_id))
            backend.mark_as_revoked(ctx.id, "revoked" if record["status"] == "cancelled" else "expired", request=ctx)
        else:
            backend.mark_as_done(ctx.id, record, request=ctx)
            self._follow_up(ctx, record)

    def _follow_up(self, ctx: Context, record: dict) -> None:
        """Link callbacks and the next step of a chain (what Celery's tracer does after a task returns)."""
        for callback in ctx.callbacks or ():
            self.app.signature(callback).apply_async((record,), parent_id=ctx.id, root_id=ctx.root_id or ctx.id)
        if ctx.chain:
            chain = list(ctx.chain)
            self.app.signature(chain.pop()).apply_async(
                (record,), chain=chain, parent_id=ctx.id, root_id=ctx.root_id or ctx.id
            )

    # ------------------------------------------------------------------ timers, shutdown
    def maintain(self, now: float) -> bool:
        """Handle control messages (revokes); put messages unacked past the visibility timeout (their
        worker died) back on the queue. True if a revoke came in: the cancel set has new ids."""
        if now >= self._next_restore:
            self._next_restore = now + self.restore_every_s
            self.channel.qos.restore_visible(num=1000, interval=1)
        return self.control.drain()

    def depth(self) -> int:
        """Messages waiting in the Celery queues (all priority levels)."""
        # kombu's own size (LLEN over the priority lists); a passive queue_declare 404s on an empty queue
        return sum(int(self.channel._size(queue.name)) for queue in self.queues)

    def close(self) -> None:
        """Closing the channel puts every message still unacked (not finished) back on the queue at once."""
        self.control.close()
        try:
            self.conn.release()
        except Exception as exc:
            self.log.error("celery_close_failed", error=repr(exc))


def _context(message: Any, headers: dict, args: Any, kwargs: Any, embed: Any) -> Context:
    embed = embed if isinstance(embed, dict) else {}
    props = message.properties or {}
    return Context(
        id=headers["id"],
        task=headers.get("task"),
        args=args,
        kwargs=kwargs,
        group=headers.get("group"),
        group_index=headers.get("group_index"),
        root_id=headers.get("root_id"),
        parent_id=headers.get("parent_id"),
        chord=embed.get("chord"),
        callbacks=embed.get("callbacks"),
        errbacks=embed.get("errbacks"),
        chain=embed.get("chain"),
        ignore_result=headers.get("ignore_result", False),
        delivery_info=message.delivery_info,
        reply_to=props.get("reply_to"),
        correlation_id=props.get("correlation_id") or headers["id"],
    )


def _job_from_task(task: str | None, task_id: str, args: Any, kwargs: Any, headers: dict) -> Any:
    """The job a `pagedq.generate` call describes; JobRejected with the reason otherwise."""
    if task != TASK_NAME:
        raise JobRejected(f"unknown task {task!r}: this queue serves {TASK_NAME} only")
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        raise JobRejected("malformed message body: expected (args, kwargs, embed)")
    if len(args) > 1 or (args and "prompt" in kwargs):
        raise JobRejected(f"{TASK_NAME} takes the prompt as its only positional argument; pass the rest by keyword")
    if "id" in kwargs or "job_id" in kwargs:
        raise JobRejected("the Celery task id is the job id: pass task_id= to apply_async instead of id/job_id")
    if headers.get("eta") or headers.get("countdown"):
        raise JobRejected("eta/countdown is not supported: the worker admits jobs as soon as it can")
    fields = dict(kwargs)
    if args:
        fields["prompt"] = args[0]
    expires = headers.get("expires")
    if expires and fields.get("deadline") is None:  # Celery's expires is the job's deadline
        try:
            fields["deadline"] = _dt.datetime.fromisoformat(expires).timestamp()
        except (TypeError, ValueError):
            raise JobRejected(f"cannot parse expires {expires!r}") from None
    if "traceparent" not in fields:  # the producer's, in the headers (pagedq/worker/celery/app.py puts it there)
        fields.update(from_headers(headers))
    return make_job(job_id=task_id, **fields)
