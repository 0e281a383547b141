"""The worker's HTTP endpoints: /metrics, /health (liveness), /ready (readiness), 404 for anything else.

Against a real Redis: readiness follows a redis-server that is killed and relaunched; liveness follows a
worker loop held inside an engine step.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

import pagedq.worker.ops.metrics as worker_metrics
from pagedq.worker import Client
from pagedq.worker.ops.embedded_redis import EmbeddedRedis
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import REDIS_SERVERS, wait_for, worker_thread


def get(port: int, path: str) -> tuple[int, str, str]:
    """(status, content type, body) of GET path; HTTP errors are answers too."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


class GatedEngine(StubEngine):
    """A stub engine whose step waits while the gate is closed: a worker loop stuck in the engine."""

    def __init__(self) -> None:
        super().__init__(step_delay_s=0.002)
        self.gate = threading.Event()
        self.gate.set()
        self.in_step = threading.Event()

    def step(self):
        self.in_step.set()
        self.gate.wait()
        return super().step()


def test_paths_serve_metrics_health_ready_and_404(redis_url):
    with worker_thread(StubEngine(), redis_url, metrics_port=0, metrics_every_s=0.05) as w:
        port = w.metrics.port
        status, ctype, body = wait_for(lambda: (a := get(port, "/ready"))[0] == 200 and a, what="ready")
        assert ctype == "application/json"
        assert json.loads(body) == {"ready": True, "engine_loaded": True, "redis": True}
        status, ctype, body = get(port, "/health")
        health = json.loads(body)
        assert status == 200 and health["alive"] is True and 0 <= health["last_turn_age_s"] < 5
        status, ctype, body = get(port, "/metrics")
        assert status == 200 and ctype.startswith("text/plain") and "pagedq_kv_blocks{" in body
        assert "pagedq_kv_blocks_total" not in body  # a gauge: no counter suffix
        for path in ("/", "/healthz", "/metrics/x", "/favicon.ico"):
            status, ctype, body = get(port, path)
            assert status == 404 and "no such path" in json.loads(body)["error"], path


def test_liveness_fails_while_the_loop_is_stuck_and_recovers(redis_url, monkeypatch):
    monkeypatch.setattr(worker_metrics, "LIVENESS_STALE_S", 0.5)
    engine = GatedEngine()
    with worker_thread(engine, redis_url, metrics_port=0, metrics_every_s=0.02) as w:
        port = w.metrics.port
        wait_for(lambda: get(port, "/health")[0] == 200 and get(port, "/ready")[0] == 200, what="live and ready")
        engine.gate.clear()
        engine.in_step.clear()
        Client(redis_url).submit(prompt="stuck", max_tokens=3)
        assert engine.in_step.wait(10), "the worker never stepped the engine"
        _, _, body = wait_for(lambda: (a := get(port, "/health"))[0] == 503 and a, timeout=10, what="liveness failing")
        # >=: the age is reported rounded to the millisecond, so a turn 0.5004 s old reads 0.5
        assert json.loads(body)["alive"] is False and json.loads(body)["last_turn_age_s"] >= 0.5
        assert get(port, "/ready")[0] == 503  # a stuck worker is not ready either
        engine.gate.set()
        wait_for(lambda: get(port, "/health")[0] == 200, what="liveness back once the loop turns")


@pytest.fixture(params=sorted(REDIS_SERVERS))
def killable_redis(request):
    server = EmbeddedRedis(binary=REDIS_SERVERS[request.param], extra_args=("--save", "", "--appendonly", "no"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_readiness_follows_redis(killable_redis):
    with worker_thread(
        StubEngine(), killable_redis.url, metrics_port=0, metrics_every_s=0.05, redis_outage_s=60.0
    ) as w:
        port = w.metrics.port
        wait_for(lambda: get(port, "/ready")[0] == 200, what="ready")
        killable_redis.kill()
        _, _, body = wait_for(
            lambda: (a := get(port, "/ready"))[0] == 503 and a, timeout=10, what="not ready without Redis"
        )
        ready = json.loads(body)
        assert ready["ready"] is False and ready["redis"] is False and ready["engine_loaded"] is True
        assert "redis_error" in ready
        assert get(port, "/health")[0] == 200  # still alive: the outage is being ridden out
        killable_redis.relaunch()
        wait_for(lambda: get(port, "/ready")[0] == 200, timeout=20, what="ready again once Redis is back")
