"""`pagedq serve`: flags over GatewaySettings (PAGEDQ_* environment variables fill what flags leave out)."""

from __future__ import annotations

import argparse

from ..settings import GatewaySettings


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", dest="redis_url", default=None, help="Redis URL (default: $PAGEDQ_REDIS_URL or "
                   "redis://localhost:6379/0)")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--queue", default=None, help="queue (default: $PAGEDQ_QUEUE or default)")
    p.add_argument("--api-key", dest="api_keys", action="append", default=None,
                   help="accepted bearer token (repeat for several; default: $PAGEDQ_API_KEYS, else none: open)")
    p.add_argument("--max-queue-depth", type=int, default=None, help="429 beyond this many unfinished jobs")
    p.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                   help="log level (default: the settings' log_level)")


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    given = {k: v for k, v in vars(args).items() if k in GatewaySettings.model_fields and v is not None}
    return GatewaySettings(**given)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..cli import configure_logging
    from .app import create_app

    settings = settings_from_args(args)
    configure_logging(settings.log_level)
    if not settings.api_keys and settings.host not in ("127.0.0.1", "localhost", "::1"):
        import structlog

        structlog.get_logger("pagedq.gateway").warning(
            "open_gateway", host=settings.host,
            hint="no API keys are configured: anyone who reaches this address can use it (--api-key)")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                access_log=False, lifespan="on")
    return 0
