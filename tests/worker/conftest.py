"""Fixtures for the worker tests: a private redis-server per test (on every server version at hand).

The plain helpers live in tests/worker/helpers.py; test modules import them from there."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis import Redis

from pagedq.worker.ops.embedded_redis import EmbeddedRedis

from .helpers import (
    PRIMARY_REDIS,
    REDIS_SERVERS,
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every server version for the in-process tests; the primary one for the slow end-to-end ones (helpers.py's
    _redis_servers says why): the process tests would otherwise double the suite's longest part."""
    if "redis_url" in metafunc.fixturenames:
        slow = metafunc.definition.get_closest_marker("slow") is not None
        metafunc.parametrize("redis_url", [PRIMARY_REDIS] if slow else sorted(REDIS_SERVERS), indirect=True)


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh redis-server (no persistence) on a free port in a temp folder, killed after the test."""
    server = EmbeddedRedis(binary=REDIS_SERVERS[request.param], extra_args=("--save", "", "--appendonly", "no"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def r(redis_url: str) -> Iterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    client.close()
