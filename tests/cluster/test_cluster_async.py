"""AsyncClient and the gateway (`pagedq serve`) on a real Redis Cluster, through a node that does not own the
queue's slot: redis.asyncio's RedisCluster for submit, stream, result, cancel, the live-worker lookup (MGET of
heartbeats), one completion with the openai SDK and a Batch API run (its file upload a MULTI/EXEC pipeline on
the queue's slot); and Celery with its broker on a plain Redis serving a queue on the cluster. The worker runs
the stub engine in a thread; the oracle is the stub's offline answer."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
from typing import Any

import openai
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from pagedq.worker.assembly import Worker
from pagedq.worker.client.async_client import AsyncClient
from pagedq.worker.client.sync_client import Client
from pagedq.worker.protocol.connection import connect
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.testing.stub_engine import StubEngine

from ..gateway.conftest import gateway_thread, wait_for
from ..worker.helpers import running
from .test_cluster_queue import offline, settings


def serving(url: str, queue: str, **overrides: Any) -> contextlib.AbstractContextManager[Worker]:
    worker = Worker(
        StubEngine(step_delay_s=0.002), connect(url), settings(queue, burst=False, model="stub-model", **overrides)
    )
    return running(worker)


def test_async_client_submit_stream_result_cancel(queue: str, url: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(url, queue) as client:
            assert isinstance(client.r, AsyncRedisCluster)
            streamed = await client.submit("async cluster", max_tokens=8, temperature=0, stream=True)
            many = await client.submit_many(
                [{"prompt": f"many {i}", "max_tokens": 3, "temperature": 0} for i in range(3)]
            )
            slow = await client.submit("slow one", max_tokens=1000, temperature=0)
            deltas = [d async for d in client.stream(streamed, timeout=10)]
            record = await client.result(streamed, timeout=10)
            assert record.text == offline("async cluster", max_tokens=8, temperature=0)
            assert "".join(d.text for d in deltas) == record.text
            results = await asyncio.gather(*(client.result(j, timeout=10) for j in many))
            assert [r.text for r in results] == [offline(f"many {i}", max_tokens=3, temperature=0) for i in range(3)]
            assert await client.cancel(slow)
            assert (await client.result(slow, timeout=10)).status == "cancelled"
            assert await client.queue_depth() == 0

    with serving(url, queue):
        asyncio.run(scenario())


def test_gateway_completion_and_batch(queue: str, url: str) -> None:
    prompts = {f"b{i}": f"batch line {i}" for i in range(3)}
    content = "".join(
        json.dumps(
            {
                "custom_id": cid,
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "stub-model", "prompt": p, "max_tokens": 4, "temperature": 0},
            }
        )
        + "\n"
        for cid, p in prompts.items()
    ).encode()
    with serving(url, queue), gateway_thread(url, queue=queue) as base:
        sdk = openai.OpenAI(base_url=base, api_key="x")
        assert [m.id for m in sdk.models.list().data] == ["stub-model"]
        done = sdk.completions.create(model="stub-model", prompt="gateway on a cluster", max_tokens=6, temperature=0)
        assert done.choices[0].text == offline("gateway on a cluster", max_tokens=6, temperature=0)
        upload = sdk.files.create(file=("requests.jsonl", content), purpose="batch")
        assert sdk.files.content(upload.id).content == content
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        finished = wait_for(
            lambda: (b := sdk.batches.retrieve(batch.id)).status == "completed" and b,
            timeout=30,
            interval=0.05,
            what="batch completed",
        )
        assert finished.output_file_id is not None
        output = [json.loads(x) for x in sdk.files.content(finished.output_file_id).text.splitlines()]
    texts = {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in output}
    assert texts == {cid: offline(p, max_tokens=4, temperature=0) for cid, p in prompts.items()}


def test_celery_broker_on_a_plain_redis_serves_a_queue_on_the_cluster(cluster, monkeypatch) -> None:
    """What docs/deployment.md offers instead of a cluster broker: kombu on a plain Redis, the queue on the cluster."""
    from pagedq.worker.ops.embedded_redis import EmbeddedRedis

    from .conftest import queue_on

    queue = queue_on(cluster, cluster.ports[1], "celery")
    url = cluster.url_avoiding(queue)
    with EmbeddedRedis(extra_args=("--save", "", "--appendonly", "no")) as broker:
        monkeypatch.setenv("CELERY_BROKER_URL", broker.url)
        import pagedq.worker.celery.app as celery_app

        importlib.reload(celery_app)  # the module's app reads its broker URL at import
        with serving(url, queue, celery_broker=broker.url, celery_poll_s=0.01):
            record = celery_app.generate.delay(prompt="via celery", max_tokens=5, temperature=0).get(timeout=20)
        assert record["status"] == "completed"
        assert record["text"] == offline("via celery", max_tokens=5, temperature=0)
        stored = Client(url, queue).final(record["id"])  # the final record is on the cluster
        assert stored is not None and stored.text == record["text"]


def test_worker_metrics_and_readiness_on_the_cluster(cluster) -> None:
    """/ready pings every master through its own probe client; /metrics reads the queue's depth from its slot."""
    from .conftest import queue_on
    from .test_cluster_cli import http_get

    queue = queue_on(cluster, cluster.ports[2], "metrics")
    url = cluster.url_avoiding(queue)
    Client(url, queue).submit("queued", max_tokens=2, band="bulk")
    with serving(url, queue, metrics_port=0, metrics_every_s=0.05) as w:
        assert w.metrics is not None
        port = w.metrics.port
        _, body = wait_for(lambda: (a := http_get(port, "/ready"))[0] == 200 and a, what="ready")
        assert json.loads(body) == {"ready": True, "engine_loaded": True, "redis": True}
        wait_for(lambda: Client(url, queue).queue_depth() == 0, what="the queued job done")
        done = f'pagedq_jobs_finished_total{{queue="{queue}",status="completed"}} 1.0'
        empty = f'pagedq_queue_depth{{band="bulk",queue="{queue}"}} 0.0'  # read from the slot's owner
        wait_for(lambda: all(x in http_get(port, "/metrics")[1] for x in (done, empty)), what="job counted, band empty")
        # KEDA's figure, XINFO GROUPS, is asked of the slot's owner too (Redis 7: 6.2 reports no lag)
        groups = connect(url).xinfo_groups(QueueKeys(queue).jobs_of("bulk"))
        if "lag" in groups[0]:
            lag = f'pagedq_queue_group_lag{{band="bulk",queue="{queue}"}} 0.0'
            wait_for(lambda: lag in http_get(port, "/metrics")[1], what="the group's lag from the cluster")
