"""The Redis `pagedq worker` serves when none is configured (neither --redis nor PAGEDQ_REDIS_URL).

Every other command (`pagedq serve`, `Client()`, `status`, `bulk`, `dlq`) defaults to the Redis on localhost:6379,
so the worker meets them there: it uses the Redis answering on 127.0.0.1 at its local port (6379 by default), else
starts a private redis-server on that port, else (the port is held by something that is not a Redis answering
PING without a password) on a free port, and says which URL to give the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis import Redis
from redis.exceptions import RedisError

from pagedq.worker.ops.embedded_redis import EmbeddedRedis, port_is_free

NOT_CONFIGURED = "no Redis configured (neither --redis nor PAGEDQ_REDIS_URL)"


@dataclass
class LocalRedis:
    """The URL the worker serves, the private server it started (stopped after the worker's drain), and why."""

    url: str
    server: EmbeddedRedis | None
    event: str
    reason: str
    warn: bool = False  # the other commands' default URL does not reach it


def local_url(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


def answers(url: str, timeout_s: float = 0.5) -> bool:
    """Whether a Redis at `url` answers PING (without a password)."""
    client = Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except RedisError:
        return False
    finally:
        client.close()


def local_redis(port: int) -> LocalRedis:
    """The Redis for a worker given none; `port` 0: a private server on a free port, whatever runs elsewhere."""
    if port:
        if answers(local_url(port)):
            return LocalRedis(
                local_url(port),
                None,
                "local_redis_used",
                f"{NOT_CONFIGURED}: using the Redis that answers on port {port}, "
                "the default of pagedq serve, Client() and the other commands",
            )
        try:  # taken between the probe and the start: a free port below
            server = EmbeddedRedis(port=port).start() if port_is_free(port) else None
        except RuntimeError:
            server = None
        if server is not None:
            return LocalRedis(
                server.url,
                server,
                "embedded_redis_started",
                f"{NOT_CONFIGURED} and none on port {port}: started a private redis-server there, the default "
                "of pagedq serve, Client() and the other commands; it stops when the worker has drained",
            )
    server = EmbeddedRedis().start()
    held = f"port {port} is held by something that is not a Redis answering PING" if port else "--local-redis-port 0"
    return LocalRedis(
        server.url,
        server,
        "embedded_redis_started",
        f"{NOT_CONFIGURED} and {held}: started a private redis-server on a free port; "
        f"give its URL to the others: pagedq serve --redis {server.url} (or PAGEDQ_REDIS_URL={server.url})",
        warn=bool(port),
    )
