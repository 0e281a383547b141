"""Operations: /health, Prometheus metrics (requests by route and status, latency histogram, open streams),
structlog JSON logs of `pagedq serve` (a subprocess, configured from flags and PAGEDQ_* variables)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedq.worker.testing.stub_engine import StubEngine

from .conftest import gateway_thread, start_gateway_process, wait_for, wait_live, worker_thread


def _samples(root: str) -> dict[tuple, float]:
    text = httpx.get(root + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_routes_statuses_latency_and_open_streams(redis_url):
    with worker_thread(StubEngine(step_delay_s=0.01), redis_url, model="stub"), gateway_thread(redis_url) as base:
        root = base.removesuffix("/v1")
        wait_live(base)
        sdk = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        for _ in range(2):
            sdk.completions.create(model="stub", prompt="hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            sdk.completions.create(model="stub", prompt="hi", extra_body={"nope": 1})
        stream = sdk.completions.create(model="stub", prompt="hi", max_tokens=200, stream=True)
        next(iter(stream))
        during = _samples(root)
        list(stream)
        after = _samples(root)
        health = httpx.get(root + "/health").json()
    route = "/v1/completions"
    assert after[("pagedq_gateway_requests_total", (("route", route), ("status", "200")))] == 3
    assert after[("pagedq_gateway_requests_total", (("route", route), ("status", "400")))] == 1
    assert after[("pagedq_gateway_request_seconds_count", (("route", route),))] == 4
    assert during[("pagedq_gateway_open_streams", ())] == 1 and after[("pagedq_gateway_open_streams", ())] == 0
    assert health == {"status": "ok", "redis": "ok", "live_workers": 1, "open_streams": 0, "buffered_results": 0}


@pytest.mark.slow
def test_serve_process_logs_json_and_reads_env_settings(redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDQ_API_KEYS", "env-key-1,env-key-2")
    log = tmp_path / "gateway.log"
    with worker_thread(StubEngine(), redis_url, model="stub"):
        proc, base = start_gateway_process(redis_url, log)
        try:
            sdk = openai.OpenAI(base_url=base, api_key="env-key-2", max_retries=0)
            served = [m.id for m in wait_for(lambda: sdk.models.list().data, what="a live worker")]
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=base, api_key="other", max_retries=0).models.list()
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    started = [e for e in events if e["event"] == "gateway_started"]
    assert started and started[0]["auth"] is True and started[0]["host"] == "127.0.0.1"
    failed = [e for e in events if e["event"] == "request_failed"]
    assert failed and failed[0]["status"] == 401 and failed[0]["route"] == "/v1/models"
    assert served == ["stub"]
