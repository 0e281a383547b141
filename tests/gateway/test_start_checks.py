"""`pagedq serve` says at start what would make every request a 503 (issue 35, item 9): no Redis at its URL, or no
worker serving its queue there (e.g. a worker started on another Redis)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from structlog.testing import capture_logs

from pagedq.worker.gateway.app import Gateway
from pagedq.worker.gateway.preflight import say_what_is_missing
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.ops.embedded_redis import free_port
from pagedq.worker.testing.stub_engine import StubEngine
from tests.worker.helpers import wait_for, worker_thread

from .conftest import start_gateway_process


def _check(redis_url: str) -> tuple[str | None, list[dict]]:
    settings = GatewaySettings(redis_url=redis_url, worker_cache_s=0.0, redis_connect_timeout_s=1.0)

    async def check() -> str | None:
        gateway = Gateway(settings, None)
        try:
            return await say_what_is_missing(settings, gateway._probe)
        finally:
            await gateway.client.aclose()

    with capture_logs() as logs:
        event = asyncio.run(check())
    return event, logs


def test_serve_says_at_start_that_no_redis_answers_at_its_url() -> None:
    port = free_port()
    event, logs = _check(f"redis://:hunter2@127.0.0.1:{port}/0")
    assert event == "redis_unreachable_at_start"
    [warning] = [entry for entry in logs if entry["event"] == event]
    assert warning["log_level"] == "warning" and "hunter2" not in str(warning)
    assert f"no Redis answers at redis://:***@127.0.0.1:{port}/0" in warning["hint"]
    assert "pagedq worker" in warning["hint"]


def test_serve_says_at_start_that_no_worker_serves_its_queue(redis_url: str) -> None:
    event, logs = _check(redis_url)
    assert event == "no_live_worker_at_start"
    [warning] = [entry for entry in logs if entry["event"] == event]
    assert "no worker serves queue 'default'" in warning["hint"] and "pagedq worker" in warning["hint"]


def test_serve_says_nothing_when_a_worker_serves_its_queue(redis_url: str) -> None:
    with worker_thread(StubEngine(), redis_url):
        wait_for(lambda: _check(redis_url)[0] is None, timeout=10, what="the worker's first heartbeat")


@pytest.mark.slow  # a `python -m pagedq.worker serve` process
def test_pagedq_serve_started_with_no_redis_at_its_url_says_so(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    proc, base_url = start_gateway_process(f"redis://127.0.0.1:{free_port()}/0", log)
    try:
        assert httpx.get(base_url.removesuffix("/v1") + "/health", timeout=5).status_code == 503
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    [warning] = [json.loads(line) for line in log.read_text().splitlines() if '"redis_unreachable_at_start"' in line]
    assert warning["level"] == "warning" and "no Redis answers at redis://127.0.0.1:" in warning["hint"]
