"""The gateway's spans (tracing on: pagedq/worker/telemetry/): OpenTelemetry's standard instrumentations of FastAPI
(a server span per request, outermost, so it covers what the intake refuses, without the per-message spans) and of
the gateway's Redis client (a client span per command or pipeline). The jobs a request submits carry its span as
their traceparent (pagedq/worker/client/core.py), and the worker continues the trace from there."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fastapi import FastAPI

from pagedq.worker.protocol.connection import AsyncRedis

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

# The probes and the scrapes: a trace each every few seconds, of no request. OTEL_PYTHON_FASTAPI_EXCLUDED_URLS
# (the instrumentation's own variable) replaces this list.
UNTRACED_PATHS = "/health,/metrics"


def instrument(app: FastAPI, redis: AsyncRedis, provider: TracerProvider) -> None:
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    excluded = None if os.environ.get("OTEL_PYTHON_FASTAPI_EXCLUDED_URLS") else UNTRACED_PATHS
    # exclude_spans: no span per ASGI message, which for a streamed answer would be one per token event
    FastAPIInstrumentor.instrument_app(
        app, tracer_provider=provider, excluded_urls=excluded, exclude_spans=["receive", "send"]
    )
    RedisInstrumentor.instrument_client(redis, tracer_provider=provider)
