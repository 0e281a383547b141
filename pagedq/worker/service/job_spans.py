"""A job's spans in the worker (tracing on: pagedq/worker/telemetry/), continuing the trace of its producer.

Nothing here runs per engine step. The held job already keeps the times of its life (read, admitted, first token)
and the engine's figures (prompt and cached tokens, preemptions: service/absorb.py), so its spans are written once,
when its final record is queued, with those times: the job span (`pagedq.job`, from the entry's enqueue time) and
its children `queue_wait`, `admission`, `prefill` and `decode`, the `first_token` and `preempted` events; and
`publish`, from the record queued to the round trip that wrote it (service/exchange.py), which ends the job
span too. The job span's
parent is the job's traceparent (the gateway's request span, a client's or a Celery producer's current span)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes, AttributeValue

from pagedq.worker.protocol.job import FinalRecord
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.held import CELERY_ORIGIN, HeldJob

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

FAILED = ("failed", "rejected")  # the statuses whose spans are errors (a cancel or an expiry is the caller's)
_PROPAGATOR = TraceContextTextMapPropagator()


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


class JobSpans:
    def __init__(self, provider: TracerProvider, settings: WorkerSettings) -> None:
        self.tracer = provider.get_tracer("pagedq.worker")
        self.keys, self.worker, self.queue = QueueKeys(settings.queue), settings.name, settings.queue
        self._queued: list[tuple[Span, Span]] = []  # (job span, publish span) of records not yet sent
        self._sending: list[tuple[Span, Span]] = []  # of records in the round trip under way
        self._sent_at = 0.0  # when that round trip started

    def settled(self, t: HeldJob, record: FinalRecord) -> None:
        """t's final record is queued: its spans up to now, and its publish span begun."""
        now = time.time()
        read_at = t.read_unix or now
        job = self._job_span(t, record)
        parent = trace.set_span_in_context(job)
        queue_wait: dict[str, AttributeValue] = {"pagedq.band": t.band, "pagedq.recovered": t.recovered}
        self._child("queue_wait", parent, t.enqueued_at, read_at, queue_wait)
        admitted = t.admitted_at if t.admitted_at is not None else now
        admission: dict[str, AttributeValue] = {
            "pagedq.priority": t.job.priority,
            "pagedq.attempts": t.attempts,
            "pagedq.engine.blocks_needed": t.blocks_needed,
            "pagedq.admission_tokens": t.admission_tokens,
            "pagedq.guarded": t.guarded,
        }
        self._child("admission", parent, read_at, admitted, admission)
        if t.admitted_at is not None:
            first = t.first_token_at if t.first_token_at is not None else now
            prefill: dict[str, AttributeValue] = {
                "pagedq.engine.prompt_tokens": t.prompt_tokens,
                "pagedq.engine.cached_tokens": t.cached_tokens,
            }
            self._child("prefill", parent, t.admitted_at, first, prefill)
        if t.first_token_at is not None:
            job.add_event("first_token", {"pagedq.ttft_s": t.first_token_at - t.enqueued_at}, _ns(t.first_token_at))
            tokens = record.usage.completion_tokens if record.usage is not None else 0
            seconds = max(now - t.first_token_at, 1e-9)
            decode: dict[str, AttributeValue] = {
                "pagedq.engine.completion_tokens": tokens,
                "pagedq.decode_tokens_per_s": tokens / seconds,
            }
            if record.finish_reason is not None:
                decode["pagedq.finish_reason"] = record.finish_reason
            self._child("decode", parent, t.first_token_at, now, decode)
        for count, at in enumerate(t.preempted_at, 1):
            job.add_event("preempted", {"pagedq.engine.preemptions": count}, _ns(at))
        publish = self.tracer.start_span("publish", parent, start_time=_ns(now))
        self._queued.append((job, publish))

    def sending(self) -> None:
        """The queued records go out in the round trip starting now."""
        self._sending += self._queued
        self._queued = []
        self._sent_at = time.time()

    def unsent(self) -> None:
        """That round trip did not reach Redis: they go in the next."""
        self._queued = self._sending + self._queued
        self._sending = []

    def sent(self, blocked: bool) -> None:
        """That round trip wrote them: their publish spans and job spans end, at its reply, or at its start when it
        also waited for new jobs (its writes landed before its read blocked)."""
        end = _ns(self._sent_at if blocked else time.time())
        for job, publish in self._sending:
            publish.end(end)
            job.end(end)
        self._sending = []

    def _job_span(self, t: HeldJob, record: FinalRecord) -> Span:
        carrier = {"traceparent": t.job.traceparent or "", "tracestate": t.job.tracestate or ""}
        producer = _PROPAGATOR.extract(carrier) if t.job.traceparent else None
        stream = "celery" if t.origin == CELERY_ORIGIN else self.keys.jobs_of(t.origin)
        attributes: dict[str, AttributeValue] = {
            "messaging.system": "redis",
            "messaging.operation.type": "process",
            "messaging.destination.name": stream,
            "messaging.message.id": t.entry_id or t.id,
            "pagedq.job.id": t.id,
            "pagedq.queue": self.queue,
            "pagedq.worker": self.worker,
            "pagedq.band": t.band,
            "pagedq.status": record.status,
            "pagedq.attempts": t.attempts,
            "pagedq.engine.preemptions": len(t.preempted_at),
        }
        if t.job.tenant is not None:
            attributes["pagedq.tenant"] = t.job.tenant
        if record.usage is not None:
            attributes["gen_ai.usage.input_tokens"] = record.usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = record.usage.completion_tokens
        if record.timings is not None:
            timings = record.timings.model_dump(exclude_none=True)
            attributes.update({f"pagedq.timings.{name}_s": value for name, value in timings.items()})
        span = self.tracer.start_span(
            "pagedq.job", producer, SpanKind.CONSUMER, attributes, start_time=_ns(t.enqueued_at)
        )
        if record.status in FAILED:
            span.set_status(Status(StatusCode.ERROR, record.error))
        return span

    def _child(self, name: str, parent: Context, start: float, end: float, attributes: Attributes) -> None:
        span = self.tracer.start_span(name, parent, attributes=attributes, start_time=_ns(start))
        span.end(_ns(max(end, start)))
