"""The commands on a real Redis Cluster, as subprocesses given a `redis+cluster://` URL of a node that does not
own the queue's slot: `pagedq bulk` while `pagedq worker --engine stub --burst` serves it, then `status` and
`dlq list`; `--celery` refusing a cluster in one line; the status crash of issue 12 (a MOVED reply read as a
count) now an error naming the reply; errors for bad cluster URLs; scripts reloaded on a cluster that forgot them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.cluster import RedisCluster, key_slot
from redis.exceptions import MovedError

from pagedq.worker.assembly import Worker
from pagedq.worker.client.sync_client import Client
from pagedq.worker.ops import status
from pagedq.worker.protocol.connection import ClusterUnsupported, connect, connect_async, probe_client
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.testing.stub_engine import StubEngine

from .conftest import Cluster
from .test_cluster_queue import offline, run_burst, settings

pytestmark = pytest.mark.slow  # the pagedq commands run as processes

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def pagedq(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedq.worker", *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bulk_worker_status_and_dlq_commands(cluster: Cluster, queue: str, url: str, tmp_path: Path) -> None:
    lines: list[dict[str, Any]] = [
        {"custom_id": f"c{i}", "prompt": f"bulk {i}", "max_tokens": 4, "temperature": 0} for i in range(6)
    ]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    bulk = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedq.worker",
            "bulk",
            str(source),
            str(out),
            "--redis",
            url,
            "--queue",
            queue,
            "--no-progress",
        ],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = Client(url, queue)
        end = time.monotonic() + 30
        while client.queue_depth() < len(lines) and time.monotonic() < end and bulk.poll() is None:
            time.sleep(0.05)
        assert client.queue_depth() == len(lines), bulk.communicate()[1] if bulk.poll() is not None else "no jobs"
        served = pagedq(
            "worker",
            "--redis",
            url,
            "--queue",
            queue,
            "--engine",
            "stub",
            "--burst",
            "--log-level",
            "warning",
            "--name",
            "cli-worker",
        )
        assert served.returncode == 0, served.stderr + served.stdout
        _, err = bulk.communicate(timeout=30)
        assert bulk.returncode == 0, err
    finally:
        if bulk.poll() is None:
            bulk.kill()
    results = {row["custom_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert sorted(results) == sorted(line["custom_id"] for line in lines)
    for line in lines:
        body = results[line["custom_id"]]["response"]["body"]
        assert body["choices"][0]["text"] == offline(line["prompt"], max_tokens=4, temperature=0)
    shown = pagedq("status", "--redis", url, "--queue", queue, "--json")
    assert shown.returncode == 0, shown.stderr
    st = json.loads(shown.stdout)["queues"][0]
    assert st["queue"] == queue and st["depth"] == 0 and st["dead_letters"] == 0
    listed = pagedq("dlq", "list", "--redis", url, "--queue", queue, "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr


def test_status_without_queue_finds_queues_on_every_master(cluster: Cluster) -> None:
    from .conftest import queue_on

    names = [queue_on(cluster, port, "discover") for port in cluster.ports]
    for name in names:
        Client(cluster.url_avoiding(name), name).submit("x", max_tokens=1)
    shown = pagedq("status", "--redis", cluster.url_avoiding(names[0]), "--json")
    assert shown.returncode == 0, shown.stderr
    found = {q["queue"]: q["depth"] for q in json.loads(shown.stdout)["queues"]}
    assert all(found.get(name) == 1 for name in names), found


def test_celery_with_a_cluster_url_fails_at_start_in_one_line(url: str, queue: str) -> None:
    res = pagedq("worker", "--redis", url, "--queue", queue, "--engine", "stub", "--burst", "--celery")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr  # a start-up error: exit 2
    lines = res.stderr.strip().splitlines()
    plain = [line for line in lines if not line.startswith("{")]
    logged = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(plain) == 1 and "does not support Redis Cluster" in plain[0] and "Celery" in plain[0], lines
    assert len(logged) == 1 and logged[0]["cause"] == "cluster_unsupported", lines
    with pytest.raises(ClusterUnsupported, match="does not support Redis Cluster") as refused:
        Worker(StubEngine(), connect(url), settings(queue, celery_broker="redis://127.0.0.1:1/0", celery_backend=url))
    assert f"({url})" in str(refused.value)  # the backend is the cluster here, the broker is plain


def test_status_through_a_plain_client_raises_the_moved_reply(cluster: Cluster, queue: str) -> None:
    owner = cluster.owner_of(key_slot(QueueKeys(queue).jobs.encode()))
    plain = Redis(port=next(p for p in cluster.ports if p != owner))
    with pytest.raises(MovedError):  # was: TypeError: 'MovedError' object is not iterable
        status.queue_status(plain, queue)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("redis+cluster://127.0.0.1:7000/3", "only database 0"),
        ("memcached://127.0.0.1:11211", "unknown Redis URL scheme 'memcached'"),
        ("127.0.0.1:6379", "not a Redis URL"),
    ],
)
def test_bad_urls_are_named(bad: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        connect(bad)
    with pytest.raises(ValueError, match=message):
        connect_async(bad)


def test_scripts_are_reloaded_when_the_cluster_forgets_them(cluster: Cluster, queue: str, url: str) -> None:
    client = Client(url, queue)
    first = client.submit("before flush", max_tokens=2, temperature=0)
    for port in cluster.ports:
        Redis(port=port).script_flush()
    second = client.submit("after flush", max_tokens=2, temperature=0)  # NOSCRIPT: loaded on every master
    run_burst(url, queue)
    assert client.result(first, timeout=5).ok and client.result(second, timeout=5).ok


def test_readiness_probe_pings_every_master(url: str) -> None:
    client = connect(url)
    probe = probe_client(client, 0.5)
    assert isinstance(probe, RedisCluster) and isinstance(client, RedisCluster)
    assert probe.ping() is True
    assert {n.port for n in probe.get_primaries()} == {n.port for n in client.get_primaries()}


def test_tls_cluster_scheme_maps_to_rediss_and_plain_urls_stay_single_server() -> None:
    from pagedq.worker.protocol.connection import _split, is_cluster_url

    # rediss+cluster cannot be connected to here (no TLS cluster): check the URL redis-py is handed
    assert _split("rediss+cluster://user:pw@node.example:7000/0?ssl_cert_reqs=none") == (
        True,
        "rediss://user:pw@node.example:7000?ssl_cert_reqs=none",
    )
    assert _split("redis://127.0.0.1:6379/2") == (False, "redis://127.0.0.1:6379/2")
    assert is_cluster_url("REDIS+CLUSTER://h:1") and not is_cluster_url("redis://h:1")
    assert isinstance(connect("redis://127.0.0.1:1/0"), Redis)  # lazy: nothing is dialled until a command


def http_get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of GET path on 127.0.0.1; HTTP errors are answers too."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
