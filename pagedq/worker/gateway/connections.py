"""The gateway's HTTP server: uvicorn, with what it lacks against slow clients.

uvicorn has no timeout on a request's headers (its issue #157, "--timeout-request-start", open since 2018):
`timeout_keep_alive` runs only between requests and any byte cancels it, so a connection that trickles its
headers, or never sends one, is held for ever. HeaderDeadline closes a connection whose request headers are not
complete header_timeout_s after it opened or after its previous response (nginx's client_header_timeout). A body's
arrival is timed in intake.py, where the route reads it; the number of open connections and of requests in
progress is uvicorn's own `limit_concurrency` (max_connections: its plain-text 503 beyond).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from pagedq.worker.gateway.settings import GatewaySettings

if TYPE_CHECKING:  # the attributes HeaderDeadline uses, which uvicorn's two HTTP protocols share
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Protocol
else:
    _Protocol = object


class HeaderDeadline(_Protocol):
    """Mixed into uvicorn's HTTP protocol (httptools, else h11): a deadline on each request's headers."""

    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:  # this data completed a request's headers
            self._disarm()

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
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def protocol_class(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's default HTTP protocol with a header deadline of `header_timeout_s`."""
    return type("GatewayHTTPProtocol", (HeaderDeadline, AutoHTTPProtocol), {"header_timeout_s": header_timeout_s})


def server_config(app: object, settings: GatewaySettings) -> uvicorn.Config:
    """How `pagedq serve` runs `app` (tests run the same in a thread)."""
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=settings.host,
        port=settings.port,
        http=protocol_class(settings.header_timeout_s),
        ws="none",  # no WebSocket route: an upgrade would leave the header deadline armed on a finished protocol
        limit_concurrency=settings.max_connections,
        log_level="warning",
        access_log=False,
        lifespan="on",
    )
