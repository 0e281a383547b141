"""Tracing with OpenTelemetry: the optional extra `pagedq[otel]`, configured by the standard OTEL_* variables.

`pagedq worker` and `pagedq serve` call start() once: tracing is on when the variables ask for an exporter
(OTEL_TRACES_EXPORTER, or an OTLP endpoint: OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) and
OTEL_SDK_DISABLED is not true. Off, or without the extra, nothing here imports OpenTelemetry and provider() is None:
the worker builds no tracer and the gateway installs no instrumentation (docs/operations.md, Tracing).

The provider is pagedq's own, not OpenTelemetry's global one, unless the process set a global SDK provider before
(an application embedding the worker or the gateway): then that one is used. Tests hand theirs in with use()."""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

_provider: TracerProvider | None = None
T = TypeVar("T")


def requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the OTEL_* variables ask for traces (read without importing OpenTelemetry)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters == "none":
        return False
    endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return bool(exporters) or any(environ.get(name, "").strip() for name in endpoints)


def start(service_name: str) -> TracerProvider | None:
    """At a process's start: the tracer provider the OTEL_* variables describe (service_name unless
    OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names one), or None when they ask for no traces. Without the
    extra, a request for traces is logged and ignored: the process serves untraced."""
    global _provider
    if not requested():
        return None
    try:
        from pagedq.worker.telemetry.sdk import provider_from_env
    except ImportError as exc:
        import structlog

        structlog.get_logger("pagedq.telemetry").warning(
            "tracing_unavailable",
            error=repr(exc),
            hint="OTEL_* variables ask for traces, but the otel extra is missing: pip install 'pagedq[otel]'",
        )
        return None
    _provider = provider_from_env(service_name)
    return _provider


def provider() -> TracerProvider | None:
    """The tracer provider of this process's pagedq spans; None: nothing is traced."""
    return _provider


def use(tracer_provider: TracerProvider | None) -> None:
    """Trace with this provider from now on (None: stop tracing); what start() sets from the variables."""
    global _provider
    _provider = tracer_provider


def shutdown() -> None:
    """Export the spans still buffered (at a process's end)."""
    if _provider is not None:
        _provider.shutdown()


def run_untraced(callback: Callable[..., T], *args: object) -> T:
    """callback(*args) in a context of its own: a task it creates belongs to no request's trace, and where the
    instrumentations are loaded (the gateway traces) its Redis calls make no spans. For a background task that
    serves every request, such as the shared result reader, whose blocking reads would otherwise each be a trace."""
    return contextvars.Context().run(_untraced, callback, args)


def _untraced(callback: Callable[..., T], args: tuple[object, ...]) -> T:
    if "opentelemetry.instrumentation.utils" not in sys.modules:
        return callback(*args)
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    with suppress_instrumentation():
        return callback(*args)
