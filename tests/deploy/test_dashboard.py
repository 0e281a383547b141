"""The Grafana dashboard cannot rot silently: every metric name and label its PromQL uses is on the /metrics of a
live worker and a live gateway (each after real traffic: a completion, a bad request, jobs in every band)."""

from __future__ import annotations

import copy
import urllib.request
from pathlib import Path

import httpx
import pytest

from pagedq.worker import Client
from pagedq.worker.testing.stub_engine import StubEngine
from tests.deploy import dashboard
from tests.gateway import conftest as gateway_fixtures
from tests.gateway.conftest import CHAT_TEMPLATE, gateway_thread, wait_live
from tests.worker.helpers import wait_for, worker_thread

redis_url = gateway_fixtures.redis_url
ROOT = Path(__file__).resolve().parent.parent.parent


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


@pytest.fixture
def live_metrics(redis_url: str) -> dashboard.Exposed:
    """The samples a worker (stub engine) and a gateway expose after a little of each kind of traffic."""
    engine = StubEngine(chat_template=CHAT_TEMPLATE)
    with (
        worker_thread(engine, redis_url, metrics_port=0, metrics_every_s=0.05) as worker,
        gateway_thread(redis_url) as base,
    ):
        wait_live(base)
        model = httpx.get(base + "/models", timeout=5).json()["data"][0]["id"]
        ok = httpx.post(base + "/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}, timeout=30)
        bad = httpx.post(base + "/completions", json={"model": model, "max_tokens": 2}, timeout=30)
        assert (ok.status_code, bad.status_code) == (200, 400), (ok.text, bad.text)
        client = Client(redis_url)
        for job_id in client.submit_many([dict(prompt="p", max_tokens=2, priority=p) for p in (1, 0, -1)]):
            assert client.result(job_id, timeout=20).status == "completed"
        port = worker.metrics.port
        wait_for(
            lambda: "pagedq_worker_heartbeat_timestamp_seconds{" in _get(f"http://127.0.0.1:{port}/metrics"),
            timeout=20,
            what="the worker's heartbeat in its metrics",
        )
        return dashboard.exposed(_get(f"http://127.0.0.1:{port}/metrics"), _get(base.removesuffix("/v1") + "/metrics"))


def test_every_dashboard_query_is_answered_by_the_live_metrics(live_metrics: dashboard.Exposed) -> None:
    board = dashboard.load()
    assert dashboard.problems(board, live_metrics) == []


def test_the_check_catches_a_renamed_metric_or_label(live_metrics: dashboard.Exposed) -> None:
    """Not vacuous: a misspelt metric, a label a metric lacks and a grouping label no metric has are all found."""
    board = copy.deepcopy(dashboard.load())
    first = next(p for p in board["panels"] if p.get("targets"))
    broken = 'sum by (shard) (rate(pagedq_jobs_finish_total{queue="x"}[5m])) + pagedq_kv_blocks{band="a"}'
    first["targets"][0]["expr"] = broken
    found = dashboard.problems(board, live_metrics)
    assert any("pagedq_jobs_finish_total is not on any scraped" in p for p in found), found
    assert any("pagedq_kv_blocks has no label 'band'" in p for p in found), found
    assert any("label 'shard'" in p for p in found), found


def test_the_dashboard_has_the_panels_operators_need() -> None:
    """The issue's list: queue depth and pending per band, jobs by status, tok/s, KV, sequences, TTFT and e2e per
    band, the gateway's rate, errors and latency, and worker heartbeats; on the datasource Grafana is given."""
    board = dashboard.load()
    names = dashboard.all_names(board)
    wanted = {
        "pagedq_queue_depth",
        "pagedq_pending_jobs",
        "pagedq_jobs_finished_total",
        "pagedq_generated_tokens_total",
        "pagedq_kv_blocks_used",
        "pagedq_kv_blocks_free",
        "pagedq_running_requests",
        "pagedq_waiting_requests",
        "pagedq_time_to_first_token_seconds_bucket",
        "pagedq_e2e_latency_seconds_bucket",
        "pagedq_gateway_requests_total",
        "pagedq_gateway_request_seconds_bucket",
        "pagedq_worker_heartbeat_timestamp_seconds",
    }
    assert wanted <= names, sorted(wanted - names)
    exprs = [expr for _, expr in dashboard.queries(board)]
    for histogram in ("pagedq_time_to_first_token_seconds_bucket", "pagedq_e2e_latency_seconds_bucket"):
        quantiles = {q for q in ("0.5", "0.99") for e in exprs if f"histogram_quantile({q}," in e and histogram in e}
        assert quantiles == {"0.5", "0.99"} and all("by (band, le)" in e for e in exprs if histogram in e)
    assert any('status=~"4.."' in e for e in exprs) and any('status=~"5.."' in e for e in exprs)
    datasource = (ROOT / "monitoring/grafana/provisioning/datasources/prometheus.yml").read_text()
    uids = {p["datasource"]["uid"] for p in board["panels"] if "datasource" in p}
    assert uids == {"prometheus"} and "uid: prometheus" in datasource and "url: http://prometheus:9090" in datasource
    provider = (ROOT / "monitoring/grafana/provisioning/dashboards/pagedq.yml").read_text()
    assert "path: /etc/grafana/dashboards" in provider


def test_the_dashboard_lays_out_as_grafana_draws_it() -> None:
    """Unique panel ids, every panel inside the 24-column grid, no two panels overlapping, a query per panel."""
    board = dashboard.load()
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"{panel['title']!r} overlaps another panel"
        cells |= mine
        assert panel["type"] == "row" or panel["targets"], panel["title"]
    assert (board["uid"], board["title"]) == ("pagedq", "pagedq")
