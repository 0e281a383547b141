"""The OpenTelemetry SDK set up from the OTEL_* variables (imported only when they ask for traces).

The SDK's own classes read most of them: the sampler (OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG), the resource
(OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES), the batch processor (OTEL_BSP_*) and the OTLP/HTTP exporter
(OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, _TIMEOUT, _COMPRESSION ...). Here: which exporters
(OTEL_TRACES_EXPORTER: otlp, the default, console or none, comma-separated)."""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

OTLP_PROTOCOL = "http/protobuf"  # the exporter the extra ships (the gRPC one would pull in grpcio)


def provider_from_env(service_name: str) -> TracerProvider:
    """The process's provider: a global SDK provider set before (an embedding application's), else a new one with
    the variables' exporters behind a batch processor each. ValueError naming a variable pagedq cannot honour."""
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {SERVICE_NAME: service_name}))
    for exporter in exporters_from_env():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def exporters_from_env() -> list[SpanExporter]:
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "otlp":
            protocol = (
                os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or OTLP_PROTOCOL
            )
            if protocol.strip() != OTLP_PROTOCOL:
                raise ValueError(f"OTLP protocol {protocol!r}: pagedq[otel] exports traces over {OTLP_PROTOCOL} only")
            exporters.append(OTLPSpanExporter())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name != "none":
            raise ValueError(f"OTEL_TRACES_EXPORTER names {name!r}: pagedq exports traces to otlp, console or none")
    return exporters
