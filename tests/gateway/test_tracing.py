"""Tracing across the queue (issue 38, item 5): one trace from an HTTP request at the gateway to the final record
at the worker, read from the OpenTelemetry SDK's in-memory exporter. The gateway's FastAPI server span is the
parent of its Redis spans and of the job's span in the worker, whose children are the job's stages. With tracing
off, or the extra missing, pagedq imports nothing of OpenTelemetry. Producers and OTLP: tests/worker/test_tracing.py."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pagedq.worker import telemetry
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.testing.stub_engine import StubEngine

from .conftest import REPO, gateway_thread, wait_for, wait_live, worker_thread

STAGES = ("queue_wait", "admission", "prefill", "decode", "publish")


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    """pagedq's spans in this process go to an in-memory exporter for the test (telemetry.use: no global state)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.use(provider)
    try:
        yield exporter
    finally:
        telemetry.use(None)
        provider.shutdown()


def named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def test_one_trace_from_the_http_request_to_the_final_record(redis_url: str, exported: InMemorySpanExporter):
    with worker_thread(StubEngine(), redis_url, model="stub"), gateway_thread(redis_url) as base:
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        exported.clear()  # the probes of the start-up
        answer = sdk.completions.create(model="stub", prompt="trace me", max_tokens=5, temperature=0)
        spans = wait_for(
            lambda: (s := exported.get_finished_spans()) and named(s, "pagedq.job") and s, what="the job's span"
        )

    (server,) = [s for s in spans if s.kind is SpanKind.SERVER and s.name == "POST /v1/completions"]
    assert server.attributes is not None and server.attributes.get("http.response.status_code", 200) == 200
    trace_id = server.context.trace_id
    (job,) = named(spans, "pagedq.job")
    assert job.context.trace_id == trace_id, "the worker continues the gateway's trace"
    assert job.parent is not None and job.parent.span_id == server.context.span_id
    assert job.kind is SpanKind.CONSUMER

    # the gateway's Redis commands: client spans under the request (SUBMIT's EVALSHA among them)
    redis_spans = [s for s in spans if s.kind is SpanKind.CLIENT and s.context.trace_id == trace_id]
    assert redis_spans and any("EVALSHA" in s.name for s in redis_spans), [s.name for s in redis_spans]
    by_id = {s.context.span_id: s for s in spans}
    for span in redis_spans:  # each one's chain of parents leads to the server span
        while span.parent is not None and span.parent.span_id in by_id:
            span = by_id[span.parent.span_id]
        assert span is server
    # the shared result reader's blocking reads belong to no request: they make no spans, in this trace or their own
    assert {s.context.trace_id for s in spans if s.kind is SpanKind.CLIENT} == {trace_id}
    assert not [s.name for s in spans if s.name.startswith("XREAD")]

    stages = {name: named(spans, name) for name in STAGES}
    assert all(len(found) == 1 for found in stages.values()), {k: len(v) for k, v in stages.items()}
    stage = {name: found[0] for name, found in stages.items()}
    for span in stage.values():
        assert span.parent is not None and span.parent.span_id == job.context.span_id
    # one after the other, from the enqueue to the record written
    assert job.start_time == stage["queue_wait"].start_time
    order = [stage[name] for name in STAGES]
    assert all(a.end_time <= b.start_time + 1000 for a, b in itertools.pairwise(order))  # 1 µs of float rounding
    assert stage["publish"].end_time == job.end_time

    attributes = dict(job.attributes or {})
    assert answer.usage is not None
    assert attributes["pagedq.status"] == "completed" and attributes["pagedq.band"] == "default"
    assert attributes["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens == 5
    assert attributes["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
    assert attributes["messaging.destination.name"] == QueueKeys("default").jobs_of("default")
    assert answer.id.endswith(str(attributes["pagedq.job.id"]))
    assert {"pagedq.timings.queue_wait_s", "pagedq.timings.ttft_s", "pagedq.timings.total_s"} <= set(attributes)
    assert [e.name for e in job.events] == ["first_token"]
    assert dict(stage["prefill"].attributes or {})["pagedq.engine.prompt_tokens"] == answer.usage.prompt_tokens
    decode = dict(stage["decode"].attributes or {})
    assert decode["pagedq.engine.completion_tokens"] == 5 and decode["pagedq.finish_reason"] == "length"


@pytest.mark.slow  # a worker in a subprocess, twice
def test_nothing_of_opentelemetry_is_imported_when_tracing_is_off_or_the_extra_missing(redis_url):
    """The worker and the client serve a job with OpenTelemetry unimportable and OTEL_* asking for traces (a
    warning, then untraced); with it installed and tracing off, they and the gateway's app load none of the SDK, the
    exporters, the instrumentations or pagedq's own tracing modules beyond what redis-py and FastAPI load of
    OpenTelemetry themselves where it is installed (their own built-in telemetry)."""
    code = (
        "import json, sys\n"
        "hide = sys.argv[1] == 'hidden'\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if hide and name.split('.')[0] == 'opentelemetry':\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import redis\n"
        "if not hide:\n"
        "    import fastapi, starlette.testclient\n"
        "theirs = set(sys.modules)  # what redis-py and FastAPI load of OpenTelemetry themselves\n"
        "from redis import Redis\n"
        "from pagedq.worker import Client, telemetry\n"
        "from pagedq.worker.assembly import Worker\n"
        "from pagedq.worker.service.config import WorkerSettings\n"
        "from pagedq.worker.testing.stub_engine import StubEngine\n"
        "started = telemetry.start('pagedq-worker')\n"
        "client = Client(sys.argv[2])\n"
        "job_id = client.submit('x', max_tokens=2)\n"
        "Worker(StubEngine(), Redis.from_url(sys.argv[2]), WorkerSettings(name='w', burst=True)).run()\n"
        "status = client.result(job_id, timeout=10).status\n"
        "if not hide:\n"
        "    from pagedq.worker.gateway import create_app\n"
        "    from pagedq.worker.gateway.settings import GatewaySettings\n"
        "    create_app(GatewaySettings(redis_url=sys.argv[2]))\n"
        "ours = ('pagedq.worker.telemetry.sdk', 'pagedq.worker.service.job_spans', 'pagedq.worker.gateway.tracing')\n"
        "loaded = [m for m in set(sys.modules) - theirs if m.startswith(('opentelemetry', *ours))]\n"
        "print(json.dumps({'status': status, 'started': started is not None, 'loaded': sorted(loaded)}))\n"
    )
    runs = {}
    for mode, env in (("hidden", {"OTEL_TRACES_EXPORTER": "console"}), ("off", {})):
        clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        result = subprocess.run(
            [sys.executable, "-c", code, mode, redis_url],
            env={**clean, **env, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        runs[mode] = (json.loads(result.stdout.strip().splitlines()[-1]), result.stdout + result.stderr)
    hidden, output = runs["hidden"]
    assert hidden == {"status": "completed", "started": False, "loaded": []}
    assert "tracing_unavailable" in output and "pagedq[otel]" in output
    assert runs["off"][0] == {"status": "completed", "started": False, "loaded": []}
