"""Mistakes at start a person can fix (Redis unreachable, wrong password, a cluster node, a bad URL, the metrics
port in use, a model path that is not a checkpoint) as one line on stderr, one JSON log line, exit status 2.

The `pagedq` entry point (pagedq/worker/cli/main.py main()) wraps whichever command it dispatches; wrapping twice
is a no-op. Only the exceptions recognised here are turned into a line; anything else propagates with its
traceback, since it is a bug to see, not a mistake to explain. A Redis outage after the worker started is not one
of these: the worker rides it out and exits with status 4 (pagedq/worker/service/recovery.py).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from redis.exceptions import AuthenticationError, ClusterError, RedisClusterException, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedq.worker.protocol.connection import CLUSTER_URL_SCHEME, ClusterUnsupported, is_cluster_url, redact
from pagedq.worker.protocol.errors import MetricsPortError
from pagedq.worker.protocol.registry import LoraModulesError

EXIT_STARTUP = 2
# Replies only a Redis Cluster node gives: a plain URL pointed at one of its nodes.
_CLUSTER_REPLIES = ("MOVED", "ASK", "CLUSTERDOWN", "CROSSSLOT", "TRYAGAIN")
_READABLE = "__pagedq_readable_errors__"  # marks a wrapped function, so wrapping twice is a no-op

CommandFunc = Callable[[argparse.Namespace], "int | None"]


@dataclass
class StartupProblem:
    """What went wrong, in one line, and the log fields that name the cause (never a password)."""

    cause: str
    message: str
    fields: dict[str, str | int] = field(default_factory=dict)


def with_readable_errors(func: CommandFunc) -> Callable[[argparse.Namespace], int]:
    """`func`, with the start-up mistakes explain() knows reported by report() (exit 2) instead of a traceback."""
    if getattr(func, _READABLE, False):
        return func  # type: ignore[return-value]

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args) or 0)
        except Exception as exc:
            problem = explain(exc, args)
            if problem is None:
                raise
            return report(problem, _command(args))

    setattr(run, _READABLE, True)
    return run


def report(problem: StartupProblem, command: str = "") -> int:
    """One JSON log line (event startup_failed) and one plain line on stderr; returns the exit status, 2."""
    import structlog

    if not structlog.is_configured():  # the command failed before it set up its log (status, bulk, dlq)
        from pagedq.worker.logs import configure_logging

        configure_logging()
    message = " ".join(problem.message.split())  # one line, whatever the underlying error held
    structlog.get_logger("pagedq").error(
        "startup_failed", command=command, cause=problem.cause, error=message, **problem.fields
    )
    print(f"{' '.join(['pagedq', command]).rstrip()}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_STARTUP


def explain(exc: BaseException, args: argparse.Namespace) -> StartupProblem | None:
    """The readable form of a known start-up mistake; None for anything else (a bug keeps its traceback)."""
    if isinstance(exc, MetricsPortError):
        return StartupProblem("metrics_port", str(exc), {"flag": exc.flag, "port": exc.port, "addr": exc.addr})
    if isinstance(exc, ClusterUnsupported):
        message = str(exc).replace(exc.url, redact(exc.url))
        return StartupProblem("cluster_unsupported", message, {"what": exc.what, "redis_url": redact(exc.url)})
    if isinstance(exc, LoraModulesError):
        return StartupProblem("lora_modules", str(exc), {"flag": "--lora-modules"})
    if getattr(args, "celery", False) and _is_broker_error(exc):
        return _broker_problem(exc, args)
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, ResponseError, RedisClusterException, ValueError)):
        problem = _redis_problem(exc, args)
        if problem is not None:
            return problem
    if isinstance(exc, (FileNotFoundError, ValueError)) and _raised_in(exc, _package_dir("pagedq.engine")):
        model = str(getattr(args, "model", None) or "the demo model")
        if isinstance(exc, FileNotFoundError):
            return StartupProblem("model", f"cannot load the model: {exc}", {"model": model})
        return StartupProblem("engine", str(exc), {"model": model})  # a bad setting: the engine's words suffice
    if isinstance(exc, FileNotFoundError) and exc.filename:  # e.g. `pagedq bulk` given a missing input file
        return StartupProblem("file_not_found", f"no such file: {exc.filename}", {"path": str(exc.filename)})
    return None


def _is_broker_error(exc: BaseException) -> bool:
    """kombu's error for a broker it cannot reach (the Celery front door connects at start)."""
    from kombu.exceptions import OperationalError

    return isinstance(exc, OperationalError)


def _broker_problem(exc: BaseException, args: argparse.Namespace) -> StartupProblem:
    """The Celery broker is the flag's, else $CELERY_BROKER_URL's, else the queue's Redis (main.py's order)."""
    if getattr(args, "celery_broker", None):
        source, url = "--celery-broker", str(args.celery_broker)
    elif os.environ.get("CELERY_BROKER_URL"):
        source, url = "CELERY_BROKER_URL", os.environ["CELERY_BROKER_URL"]
    else:
        source, url = _redis_source(args)
    shown = redact(url)
    message = f"cannot reach the Celery broker at {shown} ({source}): {_scrub(str(exc), url)}"
    return StartupProblem("celery_broker_unreachable", message, {"broker_url": shown, "source": source})


def _redis_problem(exc: BaseException, args: argparse.Namespace) -> StartupProblem | None:
    source, url = _redis_source(args)
    shown = redact(url)
    fields: dict[str, str | int] = {"redis_url": shown, "source": source}
    if isinstance(exc, AuthenticationError):  # before ConnectionError: it is one
        return StartupProblem(
            "redis_auth", f"Redis at {shown} ({source}) refused the credentials: {_scrub(str(exc), url)}", fields
        )
    if isinstance(exc, ClusterError) or (isinstance(exc, ResponseError) and _cluster_reply(exc)):
        reply = _scrub(f"{getattr(exc, 'status_code', None) or ''} {exc}".strip(), url)
        if is_cluster_url(url):
            return StartupProblem("redis_cluster", f"the Redis cluster at {shown} is not serving: {reply}", fields)
        return StartupProblem(
            "redis_cluster",
            f"Redis at {shown} ({source}) is a cluster node (it answered "
            f"{reply}): this is a cluster: use {_cluster_url(shown)}",
            fields,
        )
    # RedisClusterException: what a cluster client says when no node of the cluster answers.
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, RedisClusterException)):
        return StartupProblem(
            "redis_unreachable", f"cannot reach Redis at {shown} ({source}): {_scrub(str(exc), url)}", fields
        )
    # parse_url: redis-py's check of the URL (scheme, port, db); pagedq/worker/protocol/connection.py: the
    # cluster-aware one.
    if isinstance(exc, ValueError) and (
        _raised_in(exc, _package_dir("redis"), "parse_url") or _raised_in(exc, "pagedq/worker/protocol/connection.py")
    ):
        return StartupProblem(
            "redis_url", f"{source} {shown!r} is not a usable Redis URL: {_scrub(str(exc), url)}", fields
        )
    return None


def _cluster_reply(exc: ResponseError) -> bool:
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return code in _CLUSTER_REPLIES


def _cluster_url(shown: str) -> str:
    """The redis+cluster:// URL of the node a plain (already redacted) URL named; a cluster has no db number."""
    try:
        netloc = urlsplit(shown).netloc
    except ValueError:
        netloc = ""
    return f"{CLUSTER_URL_SCHEME}://{netloc or 'HOST:PORT'}"


def _redis_source(args: argparse.Namespace) -> tuple[str, str]:
    """Where the command's Redis URL came from (its flag, the environment or the default) and the URL."""
    from pagedq.worker.protocol.settings import configured_redis_url, redis_url

    explicit = getattr(args, "redis", None)
    if explicit:
        return "--redis", str(explicit)
    return ("PAGEDQ_REDIS_URL" if configured_redis_url() else "the default URL"), redis_url()


def _scrub(text: str, url: str) -> str:
    """A server's or library's message with the URL's password cut out, should it ever echo it."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return text
    return text.replace(password, "***") if password else text


def _raised_in(exc: BaseException, where: str, function: str | None = None) -> bool:
    """Whether a frame of the exception's traceback ran in the file or package at `where` (in `function`)."""
    return any(
        (frame.filename.startswith(where) or frame.filename.endswith(where))
        and (function is None or frame.name == function)
        for frame in traceback.extract_tb(exc.__traceback__)
    )


def _package_dir(name: str) -> str:
    """The folder of an importable package, found without importing it (engine imports torch)."""
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return str(Path(locations[0])) + "/" if locations else f"<no package {name}>"


def _command(args: argparse.Namespace) -> str:
    command = getattr(args, "command", None) or ""
    action = getattr(args, "bench_command", None) or getattr(args, "bench", None) or getattr(args, "action", None)
    return f"{command} {action}" if command and isinstance(action, str) else str(command)
