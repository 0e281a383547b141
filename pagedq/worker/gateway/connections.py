"""The gateway's HTTP server: uvicorn, with what it lacks against slow clients.

uvicorn has no timeout on a request's headers (its issue #157, "--timeout-request-start", open since 2018):
`timeout_keep_alive` runs only between requests and any byte cancels it, so a connection that trickles its
headers, or never sends one, is held for ever. Nor does its httptools protocol bound their size (h11's does):
headers sent at full speed pile up in memory. HeaderDeadline closes a connection whose request headers are not
complete header_timeout_s after it opened or after its previous response (nginx's client_header_timeout), and
answers 431 to headers past max_header_bytes. A body's arrival is timed in intake.py, where the route reads it;
the number of open connections and of requests in progress is uvicorn's own `limit_concurrency`
(max_connections: its plain-text 503 beyond).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.settings import GatewaySettings

if TYPE_CHECKING:  # the attributes HeaderDeadline uses, which uvicorn's two HTTP protocols share
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Protocol
else:
    _Protocol = object


class HeaderDeadline(_Protocol):
    """Mixed into uvicorn's HTTP protocol (httptools, else h11): a deadline and a size cap on each request's
    headers. The timer is armed exactly while a request's headers are awaited."""

    header_timeout_s = 10.0
    max_header_bytes = 64 * 1024
    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:  # this data completed a request's headers
            self._disarm()
        elif self._header_timer is not None:  # all of it belongs to headers still incomplete
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes and not self.transport.is_closing():
                self._disarm()
                self.transport.write(_headers_too_large(self.max_header_bytes))
                self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        idle = self.cycle is None or self.cycle.response_complete  # else a pipelined request is under way
        if idle and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_bytes = 0
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def _headers_too_large(limit: int) -> bytes:
    error = OpenAIError(431, f"the request's headers are larger than {limit} bytes", code="headers_too_large")
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def protocol_class(settings: GatewaySettings) -> type[asyncio.Protocol]:
    """uvicorn's default HTTP protocol with the settings' header deadline and size cap."""
    limits = {"header_timeout_s": settings.header_timeout_s, "max_header_bytes": settings.max_header_bytes}
    return type("GatewayHTTPProtocol", (HeaderDeadline, AutoHTTPProtocol), limits)


def server_config(app: object, settings: GatewaySettings) -> uvicorn.Config:
    """How `pagedq serve` runs `app` (tests run the same in a thread)."""
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=settings.host,
        port=settings.port,
        http=protocol_class(settings),
        ws="none",  # no WebSocket route: an upgrade would leave the header deadline armed on a finished protocol
        limit_concurrency=settings.max_connections,
        log_level="warning",
        access_log=False,
        lifespan="on",
    )
