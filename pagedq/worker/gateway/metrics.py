"""Prometheus metrics and request logs of the gateway, as one pure-ASGI middleware (cheap per request).

Metrics live in the app's own registry (several apps in one process, as in tests, do not collide):
  pagedq_gateway_requests_total{route, status}     counter
  pagedq_gateway_request_seconds{route}            histogram (a stream: until its last byte)
  pagedq_gateway_open_streams                      gauge
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class GatewayMetrics:
    def __init__(self, open_streams: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pagedq_gateway_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "pagedq_gateway_request_seconds",
            "request latency (streams: to their end)",
            ["route"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.streams = Gauge("pagedq_gateway_open_streams", "SSE responses in progress", registry=self.registry)
        self.streams.set_function(open_streams)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ObserveRequests:
    """Counts, times and (for errors) logs every HTTP request; the route is the matched path template."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics
        self.log = structlog.get_logger("pagedq.gateway")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            elapsed = time.perf_counter() - start
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(elapsed)
            if status >= 400:
                self.log.info(
                    "request_failed",
                    method=scope.get("method"),
                    route=route,
                    status=status,
                    ms=round(elapsed * 1000, 3),
                )
            else:
                self.log.debug(
                    "request", method=scope.get("method"), route=route, status=status, ms=round(elapsed * 1000, 3)
                )
