"""Redis clients from URLs: the one place pagedq turns a URL into a client (sync or asyncio).

Decision (issue 12): a Redis Cluster is named by the URL scheme, `redis+cluster://HOST:PORT[/0]` (or
`rediss+cluster://` for TLS), anywhere a Redis URL is accepted: `--redis` flags, PAGEDQ_REDIS_URL,
Client(url), AsyncClient(url) and the gateway. Any node of the cluster may be given: the client reads the
slot map from it and sends each command to the node owning its key's slot (following MOVED/ASK).
`redis://`, `rediss://` and `unix://` stay plain single-server clients.

Why this works on a cluster: every key of a queue carries the `{queue}` hash tag (pagedq/worker/protocol/keys.py), so a
queue lives in one slot and its Lua scripts (which name all their keys in KEYS), pipelines and
transactions are single-slot. A cluster has only database 0. Celery's broker (kombu) does not speak
Redis Cluster, so the Celery front door refuses a cluster URL (refuse_cluster).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster

from pagedq.worker.protocol.errors import PagedQError

# cluster scheme -> the plain scheme redis-py parses (the cluster client takes the same URL otherwise)
CLUSTER_URL_SCHEME = "redis+cluster"  # what error messages suggest
CLUSTER_SCHEMES = {CLUSTER_URL_SCHEME: "redis", "rediss+cluster": "rediss"}
PLAIN_SCHEMES = ("redis", "rediss", "unix")

SyncRedis = redis.Redis | redis.cluster.RedisCluster
AsyncRedis = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster


class ClusterUnsupported(PagedQError, ValueError):
    """A part of pagedq that cannot run on a Redis Cluster was given a cluster URL: a configuration error, which
    the CLI reports in one line (pagedq/worker/cli/startup_errors.py)."""

    def __init__(self, what: str, url: str) -> None:
        super().__init__(
            f"{what} does not support Redis Cluster ({url}): give it a plain redis:// URL "
            "(the queue itself may stay on the cluster)"
        )
        self.what, self.url = what, url


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme.lower() in CLUSTER_SCHEMES


def _split(url: str) -> tuple[bool, str]:
    """(is a cluster, the URL redis-py parses); ValueError naming the URL for an unknown scheme or a cluster
    database other than 0."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"not a Redis URL: {url!r} (expected redis://HOST:PORT/DB or redis+cluster://HOST:PORT)")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in PLAIN_SCHEMES:
        return False, url
    if scheme not in CLUSTER_SCHEMES:
        known = ", ".join(f"{s}://" for s in (*PLAIN_SCHEMES, *CLUSTER_SCHEMES))
        raise ValueError(f"unknown Redis URL scheme {parts.scheme!r} in {url!r} (expected one of {known})")
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, got {parts.path!r} in {url!r}")
    return True, urlunsplit((CLUSTER_SCHEMES[scheme], parts.netloc, "", parts.query, parts.fragment))


def connect(url: str) -> SyncRedis:
    """A sync client for url: redis.cluster.RedisCluster for a cluster URL, else redis.Redis."""
    cluster, plain = _split(url)
    if cluster:
        return redis.cluster.RedisCluster.from_url(plain)
    return redis.Redis.from_url(plain)


@dataclass(frozen=True)
class ConnectionLimits:
    """How many connections a client opens at most and how long it waits, for a server that is unreachable or
    silent (an error, not a hang). None: redis-py's default (no timeouts, a pool that fails past 100)."""

    max_connections: int | None = None
    connect_timeout_s: float | None = None
    socket_timeout_s: float | None = None  # also how long a call waits for a free connection of a full pool


def connect_async(url: str, limits: ConnectionLimits | None = None) -> AsyncRedis:
    """connect() for asyncio: redis.asyncio.cluster.RedisCluster or redis.asyncio.Redis. With limits, a full pool
    makes a call wait (up to socket_timeout_s) for a free connection rather than fail at once."""
    cluster, plain = _split(url)
    if limits is None:
        if cluster:
            return redis.asyncio.cluster.RedisCluster.from_url(plain)
        return redis.asyncio.Redis.from_url(plain)
    timeouts = {"socket_timeout": limits.socket_timeout_s, "socket_connect_timeout": limits.connect_timeout_s}
    if cluster:  # one pool per node, each of max_connections
        sized = {} if limits.max_connections is None else {"max_connections": limits.max_connections}
        return redis.asyncio.cluster.RedisCluster.from_url(plain, **sized, **timeouts)
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        plain, max_connections=limits.max_connections or 100, timeout=limits.socket_timeout_s, **timeouts
    )
    return redis.asyncio.Redis.from_pool(pool)


def refuse_cluster(what: str, *urls: str | None) -> None:
    """Stop (ClusterUnsupported) when one of urls names a cluster: `what` cannot use one."""
    for url in urls:
        if url and is_cluster_url(url):
            raise ClusterUnsupported(what, url)


def probe_client(client: SyncRedis, timeout_s: float) -> SyncRedis:
    """A separate client to the same server(s) as client, with short timeouts (a readiness probe that never
    waits behind the worker's blocking reads)."""
    if isinstance(client, redis.cluster.RedisCluster):
        kwargs = {k: v for k, v in client.nodes_manager.connection_kwargs.items() if k not in ("host", "port")}
        nodes = [redis.cluster.ClusterNode(n.host, n.port) for n in client.get_primaries()]
        kwargs.update(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return redis.cluster.RedisCluster(startup_nodes=nodes, **kwargs)
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    return redis.Redis(
        connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, max_connections=4, **kwargs)
    )


def redact(url: str) -> str:
    """`url` with its password (if any) replaced by ***, for messages and logs."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not even a URL (a bad port, a stray bracket): show its scheme only
        return url.split("://", 1)[0] + "://..." if "://" in url else "..."
    if not password:
        return url
    netloc = parts.netloc.replace(f":{password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
