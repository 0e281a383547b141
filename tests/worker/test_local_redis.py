"""`pagedq worker` given no Redis URL meets the other commands at their default (issue 35, item 9): it serves the
Redis answering on its local port, else starts a private one there, else on a free port it names; and a Ctrl-C
drains the worker against its private Redis, which stops only after the drain."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from pagedq.worker import Client
from pagedq.worker.ops.embedded_redis import EmbeddedRedis, free_port
from pagedq.worker.ops.local_redis import answers, local_url
from tests.gateway.conftest import gateway_thread, wait_live

from .helpers import REPO, wait_for


def _worker(port: int, log: Path, *args: str) -> subprocess.Popen:
    """`pagedq worker` with no Redis configured, in its own process group (as a shell runs a foreground command)."""
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"], "PAGEDQ_LOCAL_REDIS_PORT": str(port)}
    command = [sys.executable, "-m", "pagedq.worker", "worker", "--engine", "stub", "--block-ms", "100", *args]
    with open(log, "ab") as fh:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=fh, stderr=fh, start_new_session=True)


def _events(log: Path, event: str) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if f'"{event}"' in line]


@pytest.mark.slow  # a `python -m pagedq.worker` process
def test_a_worker_given_no_url_starts_redis_where_serve_looks_and_a_ctrl_c_drains_before_it_stops(
    tmp_path: Path,
) -> None:
    port, log = free_port(), tmp_path / "worker.log"
    worker = _worker(port, log, "--stub-step-delay", "0.05")
    try:
        wait_for(lambda: _events(log, "worker_started"), timeout=60, what="the worker's start")
        [started] = _events(log, "embedded_redis_started")
        assert started["url"] == local_url(port) and started["level"] == "info"
        # `pagedq serve`'s default names localhost: the gateway finds the worker without a flag on either side
        with gateway_thread(f"redis://localhost:{port}/0") as base_url:
            wait_live(base_url)
            sdk = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
            answer = sdk.completions.create(model="stub", prompt="hello", max_tokens=3)
            assert answer.choices[0].finish_reason == "length" and answer.usage is not None
            assert answer.usage.completion_tokens == 3
        with Client(local_url(port)) as client:
            job_id = client.submit(prompt="in flight at the Ctrl-C", max_tokens=60, ignore_eos=True, stream=True)
            next(iter(client.stream(job_id, timeout=30)))  # its first tokens: the job is in the engine
            os.killpg(worker.pid, signal.SIGINT)  # a Ctrl-C at the terminal: the whole foreground group
            interrupted = time.monotonic()
            record = client.result(job_id, timeout=20)
        assert record.status == "completed" and len(record.token_ids) == 60
        assert worker.wait(timeout=20) == 0, log.read_text()[-3000:]
        assert time.monotonic() - interrupted < 15  # the drain, not a wait against a dead Redis
        assert not answers(local_url(port)), "the private Redis outlived its worker"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


@pytest.mark.slow  # a `python -m pagedq.worker` process
def test_a_worker_given_no_url_serves_the_redis_already_on_its_port(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with EmbeddedRedis() as server:
        with Client(server.url) as client:
            job_id = client.submit(prompt="served from the Redis on the default port", max_tokens=3)
        worker = _worker(server.port, log, "--burst")
        assert worker.wait(timeout=120) == 0, log.read_text()[-3000:]
        [used] = _events(log, "local_redis_used")
        assert used["url"] == local_url(server.port) and not _events(log, "embedded_redis_started")
        with Client(server.url) as client:
            assert client.result(job_id, timeout=10).status == "completed"
        assert server.proc is not None and server.proc.poll() is None  # not the worker's to stop


@pytest.mark.slow  # a `python -m pagedq.worker` process
def test_a_worker_whose_port_is_held_by_something_else_names_the_url_to_give_serve(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with socket.socket() as holder:  # listens, never answers PING
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        worker = _worker(held, log, "--burst")
        assert worker.wait(timeout=120) == 0, log.read_text()[-3000:]
    [started] = _events(log, "embedded_redis_started")
    assert started["level"] == "warning" and started["url"] != local_url(held)
    assert f"port {held} is held by something that is not a Redis" in started["reason"]
    assert f"pagedq serve --redis {started['url']}" in started["reason"]
