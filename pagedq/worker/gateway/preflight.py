"""What `pagedq serve` says once at start when every request would be a 503: no Redis answers at its URL, or no
worker serves its queue there yet (a worker on another Redis: the gateway and the workers must share one URL).

A warning, not an exit: under an orchestrator the gateway may start before Redis or the workers, and it serves as
soon as they are up (/health says which is missing meanwhile).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.protocol.connection import redact

# What the new user most often lacks: the worker started without a URL serves the default one (docs/worker.md)
START_WORKER = (
    "start a worker on the same Redis: `pagedq worker` (with no --redis it uses, or starts, the Redis on "
    "127.0.0.1:6379, this command's default) or `pagedq worker --redis URL` with this command's URL"
)


async def say_what_is_missing(settings: GatewaySettings, probe: Callable[[], Awaitable[list[dict]]]) -> str | None:
    """Log a warning naming what is missing (the event's name, returned; None when all is there). `probe` pings
    Redis and returns the queue's live workers (the gateway's /health probe)."""
    log = structlog.get_logger("pagedq.gateway")
    shown = redact(settings.redis_url)
    try:
        live = await asyncio.wait_for(probe(), settings.redis_connect_timeout_s)
    except Exception as exc:
        reason = "no answer in time" if isinstance(exc, asyncio.TimeoutError) else str(exc)
        log.warning(
            "redis_unreachable_at_start",
            redis_url=shown,
            error=reason.replace(settings.redis_url, shown),
            hint=f"no Redis answers at {shown} (--redis, PAGEDQ_REDIS_URL): every request is answered 503 until "
            f"one does; start Redis there, or {START_WORKER}",
        )
        return "redis_unreachable_at_start"
    if not live:
        log.warning(
            "no_live_worker_at_start",
            redis_url=shown,
            queue=settings.queue,
            hint=f"no worker serves queue {settings.queue!r} at {shown} yet: requests are answered 503 "
            f"(no_live_worker) until one does; {START_WORKER}",
        )
        return "no_live_worker_at_start"
    return None
