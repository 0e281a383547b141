"""Tracing across the queue at the producers and the worker (issue 38, item 5): a job carries its producer's W3C
trace context (the native client's, a Celery producer's), validated like every job field, and the worker's span of
the job continues it; exported as OTLP/HTTP protobuf to a receiver run here; . The gateway's trace, and nothing
imported with tracing off: tests/gateway/test_tracing.py."""

from __future__ import annotations

import importlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar, cast

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_span_id, format_trace_id

from pagedq.worker import Client, JobRejected, telemetry
from pagedq.worker.protocol.job import FinalRecord
from pagedq.worker.protocol.keys import JOB_FIELD
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, fast_settings, wait_for, worker_thread

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def exported() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.use(provider)
    try:
        yield provider, exporter
    finally:
        telemetry.use(None)
        provider.shutdown()


def job_span(exporter: InMemorySpanExporter, job_id: str) -> ReadableSpan:
    def found() -> list[ReadableSpan]:
        return [
            s
            for s in exporter.get_finished_spans()
            if s.name == "pagedq.job" and (s.attributes or {}).get("pagedq.job.id") == job_id
        ]

    return wait_for(found, what=f"the span of job {job_id}")[0]


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"}, "traceparent"),
        ({"traceparent": PARENT.upper()}, "traceparent must be a W3C trace context"),
        ({"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"}, "ids not all zero"),
        ({"traceparent": "ff" + PARENT[2:]}, "version 00"),
        ({"traceparent": PARENT, "tracestate": "Bad Key=1"}, "tracestate member"),
        ({"traceparent": PARENT, "tracestate": ",".join(f"k{i}=v" for i in range(33))}, "33 members"),
        ({"traceparent": PARENT, "tracestate": "k=" + "v" * 600}, "at most 512 characters"),
        ({"tracestate": "k=v"}, "tracestate goes with a traceparent"),
    ],
)
def test_a_malformed_trace_context_is_refused_naming_it(fields, problem, redis_url, r):
    client = Client(redis_url)
    with pytest.raises(JobRejected, match=problem):
        client.submit("x", **fields)
    # a producer that writes the entry itself gets the job's one `rejected` record, naming the field
    job = {"id": "raw-1", "prompt": "x", **fields}
    r.xadd(KEYS.jobs_of("default"), {JOB_FIELD: json.dumps(job)})
    with worker_thread(StubEngine(), redis_url):
        record = client.result("raw-1", timeout=20)
    assert record.status == "rejected" and "trace" in (record.error or "")


def test_the_client_puts_the_callers_span_in_the_job_and_the_worker_continues_it(redis_url, r, exported):
    provider, exporter = exported
    client = Client(redis_url)
    untraced = client.submit("no span is current", max_tokens=2)
    with provider.get_tracer("producer").start_as_current_span("produce") as produce:
        job_id = client.submit("traced", max_tokens=3, temperature=0)
        given = client.submit("its own", max_tokens=2, traceparent=PARENT, tracestate="vendor=1")
    wire = {
        json.loads(f[JOB_FIELD.encode()])["id"]: json.loads(f[JOB_FIELD.encode()])
        for _, f in r.xrange(KEYS.jobs_of("default"))
    }
    context = produce.get_span_context()
    version, trace_id, span_id, flags = wire[job_id]["traceparent"].split("-")
    assert (version, trace_id, span_id) == ("00", format_trace_id(context.trace_id), format_span_id(context.span_id))
    assert int(flags, 16) & 1, "sampled"
    assert "traceparent" not in wire[untraced], "no span, no field: workers that predate it accept the job"
    assert (wire[given]["traceparent"], wire[given]["tracestate"]) == (PARENT, "vendor=1"), "the caller's own wins"

    with worker_thread(StubEngine(), redis_url):
        record = client.result(job_id, timeout=20)
        span = job_span(exporter, job_id)
        own = job_span(exporter, given)
        root = job_span(exporter, untraced)
    assert span.context.trace_id == context.trace_id and span.parent is not None
    assert span.parent.span_id == context.span_id
    assert own.parent is not None and format_span_id(own.parent.span_id) == PARENT.split("-")[2]
    assert own.context.trace_state.to_header() == "vendor=1"
    assert root.parent is None, "a job without a trace context starts its own trace"
    attributes = dict(span.attributes or {})
    assert attributes["gen_ai.usage.output_tokens"] == len(record.token_ids) == 3
    assert attributes["pagedq.worker"] == "w-test" and attributes["pagedq.attempts"] == 1


def test_a_celery_producers_span_reaches_the_worker(redis_url, exported, monkeypatch):
    provider, exporter = exported
    monkeypatch.setenv("PAGEDQ_REDIS_URL", redis_url)
    import pagedq.worker.celery.app as celery_app

    celery_app = importlib.reload(celery_app)  # the module's app reads its broker URL at import
    with worker_thread(StubEngine(), redis_url, celery_broker=redis_url, celery_poll_s=0.01):
        with provider.get_tracer("producer").start_as_current_span("produce") as produce:
            result = celery_app.generate.delay(prompt="via celery", max_tokens=2)
        assert result.get(timeout=20)["status"] == "completed"
        span = job_span(exporter, result.id)
    assert span.parent is not None and span.parent.span_id == produce.get_span_context().span_id
    assert dict(span.attributes or {})["messaging.destination.name"] == "celery"


class Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector's trace endpoint: records each POSTed body."""

    bodies: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        if self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf":
            self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


def test_spans_are_exported_over_otlp_http_as_the_otel_variables_say(redis_url, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    Receiver.bodies = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "worker-under-test")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    try:
        assert telemetry.start("pagedq-worker") is not None
        client = Client(redis_url)
        job_id = client.submit("exported", max_tokens=2, traceparent=PARENT)
        with worker_thread(StubEngine(), redis_url):
            assert client.result(job_id, timeout=20).status == "completed"
            wait_for(lambda: telemetry.provider().force_flush() and Receiver.bodies, what="an OTLP export")
    finally:
        telemetry.shutdown()
        telemetry.use(None)
        server.shutdown()
    spans = {}
    for body in Receiver.bodies:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
            for scope_spans in resource_spans.scope_spans:
                spans.update({s.name: (service, s) for s in scope_spans.spans})
    assert {"pagedq.job", "queue_wait", "admission", "prefill", "decode", "publish"} <= set(spans)
    service, job = spans["pagedq.job"]
    assert service == "worker-under-test"
    assert job.trace_id.hex() == PARENT.split("-")[1] and job.parent_span_id.hex() == PARENT.split("-")[2]
    assert {a.key: a.value.string_value for a in job.attributes}["pagedq.job.id"] == job_id
    assert spans["publish"][1].parent_span_id == job.span_id


def test_preemptions_seen_in_the_engines_outputs_become_events_of_the_job_span(exported):
    """The engine reports a request's preemptions in each output (RequestOutput.num_preemptions): absorb notes when
    each was seen, and the job span carries one `preempted` event per preemption and their count."""
    from pagedq.worker.protocol.job import build_job
    from pagedq.worker.service.absorb import absorb
    from pagedq.worker.service.engine_api import CompletionOutput, RequestOutput
    from pagedq.worker.service.held import HeldJob, JobKey
    from pagedq.worker.service.job_spans import JobSpans
    from pagedq.worker.service.publisher import Publisher

    provider, exporter = exported
    spans = JobSpans(provider, fast_settings())
    t = HeldJob(JobKey("default", "j1"), build_job(prompt="x", id="j1", traceparent=PARENT), read_unix=time.time())
    t.admitted_at = time.time()
    publisher = cast(Publisher, None)  # a job that does not stream queues no delta
    for step, (preempted, finished) in enumerate([(0, False), (2, False), (3, True)]):
        completion = CompletionOutput(0, "a", [3 + step], finish_reason="length" if finished else None)
        out = RequestOutput("default/j1", "x", [3], [completion], finished, num_preemptions=preempted)
        absorb(t, out, time.time(), publisher)
    assert len(t.preempted_at) == 3
    record = FinalRecord.model_construct(id="j1", status="completed", finish_reason="length", usage=None, timings=None)
    spans.settled(t, record)
    spans.sending()
    spans.sent(blocked=False)
    (job,) = [s for s in exporter.get_finished_spans() if s.name == "pagedq.job"]
    assert [(e.name, dict(e.attributes or {})) for e in job.events][1:] == [
        ("preempted", {"pagedq.engine.preemptions": n}) for n in (1, 2, 3)
    ]
    assert dict(job.attributes or {})["pagedq.engine.preemptions"] == 3


@pytest.mark.parametrize(
    "headers, fields",
    [
        ({"traceparent": PARENT, "tracestate": "a=1"}, {"traceparent": PARENT, "tracestate": "a=1"}),
        ({"traceparent": PARENT}, {"traceparent": PARENT}),
        ({"traceparent": PARENT.upper()}, {}),  # malformed: dropped, a new trace starts (W3C)
        ({"traceparent": PARENT, "tracestate": "BAD KEY"}, {}),
        ({"traceparent": 7}, {}),
        ({}, {}),
    ],
)
def test_a_messages_trace_headers_become_job_fields_or_are_dropped(headers, fields):
    from pagedq.worker.protocol.trace_context import from_headers

    assert from_headers(headers) == fields
