"""`pagedq serve`: flags over GatewaySettings (PAGEDQ_* environment variables fill what flags leave out)."""

from __future__ import annotations

import argparse
import types
from collections.abc import Mapping
from typing import Any, Literal, NoReturn, cast, get_args, get_origin

from pydantic import ValidationError

from pagedq.worker.flags import Option, add_options
from pagedq.worker.gateway.settings import GatewaySettings

SECRETS = (
    "redis_url",
    "api_keys",
    "api_key_tenants",
    "admin_api_keys",
)  # values never shown; the keys have no flag (argv is public)


def _options() -> tuple[Option, ...]:
    """A flag and variable per GatewaySettings field (its name, e.g. --retry-after-s and PAGEDQ_RETRY_AFTER_S);
    the Redis URL keeps its own flag (--redis); API keys come from the environment or --api-key-file only."""
    out = []
    for name, info in GatewaySettings.model_fields.items():
        if name in SECRETS:
            continue
        annotation = info.annotation
        nullable = get_origin(annotation) is types.UnionType and type(None) in get_args(annotation)
        if nullable:
            annotation = next(a for a in get_args(annotation) if a is not type(None))
        append = get_origin(annotation) is list
        if append:
            annotation = get_args(annotation)[0]
        choices = tuple(get_args(annotation)) if get_origin(annotation) is Literal else None
        bounds = {key: getattr(m, key) for m in info.metadata for key in ("ge", "gt", "le", "lt") if hasattr(m, key)}
        pattern = next((m.pattern for m in info.metadata if getattr(m, "pattern", None)), None)
        out.append(
            Option(
                name,
                str if choices else cast(type, annotation),
                None if append else info.default,
                info.description or name,
                choices=choices,
                bounds=bounds,
                pattern=pattern,
                nullable=nullable,
                append=append,
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
        action=_RefuseKeyFlag,
        nargs="?",
        help="refused: keys on a command line are visible to every local user; use PAGEDQ_API_KEYS, "
        "PAGEDQ_API_KEY_TENANTS or --api-key-file",
    )
    add_options(p, _options())


class _RefuseKeyFlag(argparse.Action):
    """--api-key KEY exits 2 without echoing KEY (argparse's "unrecognized arguments" would)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        parser.error(
            "--api-key is refused: keys on a command line are visible to every local user (ps); "
            "set PAGEDQ_API_KEYS (or PAGEDQ_API_KEY_TENANTS) or write them to a file given as --api-key-file"
        )


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """GatewaySettings from the resolved flags (the parser already applied the environment to them); the Redis URL
    and API keys fall back to PAGEDQ_REDIS_URL / PAGEDQ_API_KEYS / PAGEDQ_API_KEY_TENANTS here. A bad value exits
    2 with one line, which shows no secret's value."""
    given = {k: v for k, v in vars(args).items() if k in GatewaySettings.model_fields and v is not None}
    try:
        return GatewaySettings(**given)
    except ValidationError as error:
        problems = "; ".join(_problem(item) for item in error.errors())
        raise SystemExit(f"pagedq serve: error: {problems}") from None


def _problem(item: Mapping[str, Any]) -> str:
    where = str(item["loc"][0]) if item["loc"] else "settings"
    shown = "(hidden)" if where in SECRETS or not item["loc"] else repr(item.get("input"))
    return f"{where}={shown}: {item['msg']}"


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedq.worker.gateway.app import create_app
    from pagedq.worker.gateway.connections import server_config
    from pagedq.worker.logs import configure_logging

    settings = settings_from_args(args)
    configure_logging(settings.log_level)
    if not settings.accepted_keys and settings.host not in ("127.0.0.1", "localhost", "::1"):
        import structlog

        structlog.get_logger("pagedq.gateway").warning(
            "open_gateway",
            host=settings.host,
            hint="no API keys are configured: anyone who reaches this address can use it (PAGEDQ_API_KEYS)",
        )
    from pagedq.worker import telemetry

    telemetry.start("pagedq-gateway")  # before the app: it instruments itself when tracing is on
    try:
        uvicorn.Server(server_config(create_app(settings), settings)).run()
    finally:
        telemetry.shutdown()
    return 0
