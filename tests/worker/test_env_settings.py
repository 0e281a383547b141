"""PAGEDQ_REDIS_URL configures every command and client that talks to Redis (protocol/settings.py), and the worker
starts a private redis-server only when nothing configures one, saying so in its log."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from redis import Redis

from pagedq.worker import AsyncClient, Client
from pagedq.worker.ops.embedded_redis import free_port
from pagedq.worker.protocol.keys import QueueKeys

from .helpers import REPO


def _worker(env_url: str | None, tmp_path, *args: str, local_port: int = 0) -> subprocess.CompletedProcess:
    # the local port: a free one, never 6379 (a developer's Redis, or another test's)
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/local/bin:/usr/bin:/bin", "PAGEDQ_LOCAL_REDIS_PORT": str(local_port)}
    if env_url is not None:
        env["PAGEDQ_REDIS_URL"] = env_url
    return subprocess.run(
        [sys.executable, "-m", "pagedq.worker", "worker", "--engine", "stub", "--burst", "--block-ms", "100", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_clients_connect_to_the_url_in_the_environment(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDQ_REDIS_URL", redis_url)
    with Client() as client:
        job_id = client.submit(prompt="hello", max_tokens=2)

    async def submit_async() -> str:
        async with AsyncClient() as aclient:
            return await aclient.submit(prompt="hello again", max_tokens=2)

    async_id = asyncio.run(submit_async())
    queued = [json.loads(f[b"job"])["id"] for _, f in Redis.from_url(redis_url).xrange(QueueKeys().jobs)]
    assert queued == [job_id, async_id]


@pytest.mark.slow  # a `python -m pagedq.worker` process
def test_the_worker_serves_the_redis_of_the_environment(redis_url: str, tmp_path) -> None:
    with Client(redis_url) as client:
        job_id = client.submit(prompt="served through the environment's Redis", max_tokens=3)
    proc = _worker(redis_url, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "embedded_redis_started" not in proc.stderr + proc.stdout
    with Client(redis_url) as client:
        record = client.result(job_id, timeout=10)
    assert record.status == "completed" and len(record.token_ids) == 3


@pytest.mark.slow  # a `python -m pagedq.worker` process
def test_the_worker_says_why_it_starts_a_private_redis(tmp_path) -> None:
    port = free_port()
    proc = _worker(None, tmp_path, local_port=port)
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = [
        json.loads(line) for line in (proc.stderr + proc.stdout).splitlines() if "embedded_redis_started" in line
    ]
    assert len(started) == 1
    assert "neither --redis nor PAGEDQ_REDIS_URL" in started[0]["reason"]
    assert started[0]["url"] == f"redis://127.0.0.1:{port}/0"
    assert f"none on port {port}: started a private redis-server there" in started[0]["reason"]


@pytest.mark.slow  # a `python -m pagedq.worker` process
def test_the_worker_takes_its_queue_and_stub_engine_from_the_environment(redis_url: str, tmp_path) -> None:
    with Client(redis_url, queue="envq") as client:
        job_id = client.submit(prompt="queue named by PAGEDQ_QUEUE", max_tokens=3)
    env = {
        "PYTHONPATH": str(REPO),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "PAGEDQ_REDIS_URL": redis_url,
        "PAGEDQ_QUEUE": "envq",
        "PAGEDQ_ENGINE": "stub",
        "PAGEDQ_BURST": "1",
        "PAGEDQ_BLOCK_MS": "100",
        "PAGEDQ_NAME": "env-named",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pagedq.worker", "worker"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = [json.loads(line) for line in proc.stderr.splitlines() if "worker_started" in line]
    assert started and started[0]["queue"] == "envq" and started[0]["worker"] == "env-named"
    with Client(redis_url, queue="envq") as client:
        assert client.result(job_id, timeout=10).status == "completed"


@pytest.mark.slow  # a `python -m pagedq.worker` process
def test_a_status_run_imports_no_torch_and_reads_its_queues_from_the_environment(redis_url: str) -> None:
    code = (
        "import sys\nfrom pagedq.worker.cli.main import main\nmain(['status', '--json'])\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    env = {
        "PYTHONPATH": str(REPO),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "PAGEDQ_REDIS_URL": redis_url,
        "PAGEDQ_QUEUE": "q1, q2",
    }
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [q["queue"] for q in json.loads(proc.stdout)["queues"]] == ["q1", "q2"]
    assert proc.stderr.strip().splitlines()[-1] == "False"
