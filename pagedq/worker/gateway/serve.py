"""`pagedq serve`: flags over GatewaySettings (PAGEDQ_* environment variables fill what flags leave out)."""

from __future__ import annotations

import argparse
from typing import Literal, cast, get_args, get_origin

from pydantic import ValidationError

from pagedq.worker.flags import Option, add_options
from pagedq.worker.gateway.settings import GatewaySettings


def _options() -> tuple[Option, ...]:
    """A flag and variable per GatewaySettings field (its name, e.g. --retry-after-s and PAGEDQ_RETRY_AFTER_S);
    the Redis URL and the API keys keep their own flags (--redis, --api-key)."""
    out = []
    for name, info in GatewaySettings.model_fields.items():
        if name in ("redis_url", "api_keys", "api_key_tenants"):  # secrets: the environment only
            continue
        annotation = info.annotation
        choices = tuple(get_args(annotation)) if get_origin(annotation) is Literal else None
        bounds = {key: getattr(m, key) for m in info.metadata for key in ("ge", "gt", "le", "lt") if hasattr(m, key)}
        pattern = next((m.pattern for m in info.metadata if getattr(m, "pattern", None)), None)
        out.append(
            Option(
                name,
                str if choices else cast(type, annotation),
                info.default,
                info.description or name,
                choices=choices,
                bounds=bounds,
                pattern=pattern,
            )
        )
    return tuple(out)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis",
        dest="redis_url",
        default=None,
        help="Redis URL (default: $PAGEDQ_REDIS_URL or redis://localhost:6379/0)",
    )
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=None,
        help="accepted bearer token (repeat for several; default: $PAGEDQ_API_KEYS, else none: open)",
    )
    add_options(p, _options())


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """GatewaySettings from the resolved flags (the parser already applied the environment to them); the Redis URL
    and API keys fall back to PAGEDQ_REDIS_URL / PAGEDQ_API_KEYS here. A bad value exits 2 with one line."""
    given = {k: v for k, v in vars(args).items() if k in GatewaySettings.model_fields and v is not None}
    try:
        return GatewaySettings(**given)
    except ValidationError as error:
        problems = "; ".join(f"{item['loc'][0]}={item.get('input')!r}: {item['msg']}" for item in error.errors())
        raise SystemExit(f"pagedq serve: error: {problems}") from None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedq.worker.gateway.app import create_app
    from pagedq.worker.logs import configure_logging

    settings = settings_from_args(args)
    configure_logging(settings.log_level)
    if not settings.accepted_keys and settings.host not in ("127.0.0.1", "localhost", "::1"):
        import structlog

        structlog.get_logger("pagedq.gateway").warning(
            "open_gateway",
            host=settings.host,
            hint="no API keys are configured: anyone who reaches this address can use it (--api-key)",
        )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
    )
    return 0
