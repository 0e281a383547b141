"""A job's W3C trace context (https://www.w3.org/TR/trace-context/): the `traceparent` and `tracestate` fields that let
the worker continue the producer's trace across the queue.

The fields are checked here as strictly as every other job field (a malformed one is refused, naming it), with no
OpenTelemetry import: a producer or worker without the `otel` extra reads and writes them all the same.
`current_fields()` reads the calling thread's trace context only where the application has loaded OpenTelemetry
itself, so a producer that does not trace pays one dictionary lookup per submission."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, Field

TRACEPARENT_CHARS = 55  # version 00: 2 + 1 + 32 + 1 + 16 + 1 + 2
# W3C: "vendors SHOULD propagate at least 512 characters" and at most 32 list members
MAX_TRACESTATE_CHARS = 512
MAX_TRACESTATE_MEMBERS = 32
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_KEY = r"(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_MEMBER = re.compile(rf"[ \t]*{_KEY}={_VALUE}[ \t]*")


def check_traceparent(value: str) -> str:
    """A job's traceparent: version 00 as the W3C spec writes it (lower-case hex, trace and parent ids not all
    zero); ValueError naming what is wrong otherwise."""
    if len(value) != TRACEPARENT_CHARS or _TRACEPARENT.fullmatch(value) is None:
        raise ValueError(
            "traceparent must be a W3C trace context of version 00: "
            "00-<32 lower-case hex trace id>-<16 lower-case hex parent id>-<2 hex flags>, ids not all zero"
        )
    return value


def check_tracestate(value: str) -> str:
    """A job's tracestate: at most 32 comma-separated key=value members, 512 characters, in the W3C grammar."""
    if len(value) > MAX_TRACESTATE_CHARS:
        raise ValueError(f"tracestate is {len(value)} characters, more than {MAX_TRACESTATE_CHARS}")
    members = [m for m in value.split(",") if m.strip(" \t")]
    if len(members) > MAX_TRACESTATE_MEMBERS:
        raise ValueError(f"tracestate has {len(members)} members, more than {MAX_TRACESTATE_MEMBERS}")
    bad = next((m for m in members if _MEMBER.fullmatch(m) is None), None)
    if bad is not None:
        raise ValueError(f"tracestate member {bad[:64]!r} is not key=value in the W3C grammar")
    return value


Traceparent = Annotated[str, Field(max_length=TRACEPARENT_CHARS), AfterValidator(check_traceparent)]
Tracestate = Annotated[str, Field(max_length=MAX_TRACESTATE_CHARS), AfterValidator(check_tracestate)]


def current_fields() -> dict[str, str]:
    """The calling context's trace as job fields ({} when nothing is traced): where the application has loaded
    OpenTelemetry and a span is current, its traceparent (and tracestate)."""
    if "opentelemetry.trace" not in sys.modules:  # the application does not trace: never import it for it
        return {}
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return {name: carrier[name] for name in ("traceparent", "tracestate") if carrier.get(name)}


def from_headers(headers: Mapping[str, Any]) -> dict[str, str]:
    """The trace context of a message's headers as job fields (a Celery message's: pagedq's producers and
    OpenTelemetry's Celery instrumentation put it there); one that is malformed is dropped, as W3C says (the
    receiver starts a new trace), since the headers are transport metadata, not the job's own fields."""
    try:
        context = {"traceparent": check_traceparent(headers["traceparent"])}
        if headers.get("tracestate"):
            context["tracestate"] = check_tracestate(headers["tracestate"])
        return context
    except (KeyError, TypeError, ValueError):
        return {}
