"""The autoscaling signals in a worker's /metrics: vLLM's names behind `--metrics-compat vllm` (scraped from a real
worker after real jobs on the stub engine, against the jobs' own final records and the engine), and the queue's lag
per band as KEDA's redis-streams lagCount reads it (XINFO GROUPS, Redis 7; Redis itself is the oracle)."""

from __future__ import annotations

import pytest
from redis import Redis

from pagedq.worker import Client
from pagedq.worker.cli.main import build_parser, settings_from_args
from pagedq.worker.ops.metrics import Metrics
from pagedq.worker.protocol.keys import GROUP
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, scrape, wait_for, worker_thread

MODEL = (("model_name", "SmolTest"),)
DEFAULT = (("band", "default"),)


def _group(r: Redis) -> dict:
    return next(g for g in r.xinfo_groups(KEYS.jobs) if g["name"] in (GROUP, GROUP.encode()))


def test_vllm_names_match_the_final_records_and_the_engine(redis_url, r):
    client = Client(redis_url)
    ids = client.submit_many([dict(prompt="w " * (1 + i), max_tokens=1 + i % 4, temperature=0) for i in range(12)])
    engine = StubEngine(step_delay_s=0.002, num_kv_blocks=256, max_num_seqs=1)
    settings = dict(metrics_port=0, metrics_every_s=0.05, metrics_compat="vllm", model="/models/SmolTest/")
    with worker_thread(engine, redis_url, max_waiting=1, **settings) as worker:
        port = worker.metrics.port
        finals = [client.result(j, timeout=20) for j in ids]
        assert {f.status for f in finals} == {"completed"}
        m = wait_for(
            lambda: (
                (s := scrape(port)).get(("vllm:e2e_request_latency_seconds_count", MODEL)) == 12
                and s[("vllm:num_requests_waiting", MODEL)] == 0
                and s[("vllm:kv_cache_usage_perc", MODEL)] == 0
                and s
            ),
            timeout=10,
            what="12 finished jobs and an idle engine in the vllm:* metrics",
        )
        assert m[("vllm:prompt_tokens_total", MODEL)] == sum(f.usage.prompt_tokens for f in finals) > 12
        assert m[("vllm:generation_tokens_total", MODEL)] == sum(f.usage.completion_tokens for f in finals) > 12
        assert m[("vllm:time_to_first_token_seconds_count", MODEL)] == 12
        assert m[("vllm:time_to_first_token_seconds_sum", MODEL)] == pytest.approx(
            sum(f.timings.ttft for f in finals), abs=1e-3
        )
        assert m[("vllm:e2e_request_latency_seconds_sum", MODEL)] == pytest.approx(
            sum(f.timings.total for f in finals), abs=1e-3
        )
        assert m[("vllm:num_requests_running", MODEL)] == 0

        # A long job running alone, one read ahead (max_waiting 1), two nobody has read: running 1, waiting 1
        # (this worker's), and the two unread are the queue's lag, which Redis counts itself on Redis 7.
        long_id = client.submit(prompt="long", max_tokens=1500, temperature=0)
        wait_for(lambda: engine.num_running_requests == 1, what="the long job running")
        client.submit_many([dict(prompt=f"q {i}", max_tokens=2) for i in range(3)])
        redis_counts_lag = "lag" in _group(r)
        m = wait_for(
            lambda: (
                (s := scrape(port))[("vllm:num_requests_waiting", MODEL)] == 1
                and s[("pagedq_queue_lag", DEFAULT)] == 2
                and (not redis_counts_lag or s.get(("pagedq_queue_group_lag", DEFAULT)) == 2)
                and s
            ),
            timeout=10,
            what="one job waiting in the worker and two in the queue",
        )
        assert m[("vllm:num_requests_running", MODEL)] == 1
        used = 1 - engine.num_free_blocks / engine.num_total_blocks
        assert m[("vllm:kv_cache_usage_perc", MODEL)] == pytest.approx(used) and used > 0
        if redis_counts_lag:
            assert _group(r)["lag"] == 2 and m[("pagedq_queue_group_lag_unknown", DEFAULT)] == 0
        else:  # Redis 6.2 has no lag to read: no series rather than a made-up one
            assert ("pagedq_queue_group_lag", DEFAULT) not in m
        client.cancel(long_id)


def test_without_the_compat_flag_no_vllm_names(redis_url):
    with worker_thread(StubEngine(), redis_url, metrics_port=0, metrics_every_s=0.05) as worker:
        m = wait_for(lambda: scrape(worker.metrics.port), what="a scrape")
        assert not [name for name, _ in m if name.startswith("vllm:")]


def test_a_lag_redis_cannot_count_reads_zero_as_in_keda(redis_url, r):
    """Two jobs delivered, the newer one finished and deleted, a third queued: Redis 7 answers NULL for the lag
    (a deleted entry newer than the oldest left), which KEDA reads as 0; the gauge says so and flags it."""
    r.xgroup_create(KEYS.jobs, GROUP, id="0", mkstream=True)
    older, newer = (r.xadd(KEYS.jobs, {"job": "{}"}) for _ in range(2))
    r.xreadgroup(GROUP, "w", {KEYS.jobs: ">"}, count=2)
    r.xack(KEYS.jobs, GROUP, newer)
    r.xdel(KEYS.jobs, newer)
    r.xadd(KEYS.jobs, {"job": "{}"})
    metrics = Metrics(0, "default", r)
    try:
        metrics._queue_state(r)
        m = scrape(metrics.port)
    finally:
        metrics.close()
    assert m[("pagedq_queue_lag", DEFAULT)] == 1  # depth - pending: exact
    if "lag" in _group(r):
        assert _group(r)["lag"] is None
        assert m[("pagedq_queue_group_lag", DEFAULT)] == 0
        assert m[("pagedq_queue_group_lag_unknown", DEFAULT)] == 1
    else:
        assert ("pagedq_queue_group_lag", DEFAULT) not in m
    assert older


def test_metrics_compat_is_a_flag_and_a_variable(monkeypatch):
    parser = build_parser()
    args = parser.parse_args(["worker", "--engine", "stub", "--metrics-compat", "vllm"])
    assert settings_from_args(args, "cpu", "m").metrics_compat == "vllm"
    monkeypatch.setenv("PAGEDQ_METRICS_COMPAT", "vllm")
    assert settings_from_args(parser.parse_args(["worker", "--engine", "stub"]), "cpu", "m").metrics_compat == "vllm"
    monkeypatch.setenv("PAGEDQ_METRICS_COMPAT", "prometheus")
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--engine", "stub"])
