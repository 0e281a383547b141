"""The gateway under pressure on its Redis side (issue 34, findings 3, 18 and 20): many open waits share one
blocking read (150 concurrent requests and a 256-prompt request on a pool of 8 connections), a failure after
submission answers in OpenAI's shape and cancels what was submitted, a stream whose client does not read stops
being read from Redis and is ended (its job cancelled) once its client has taken nothing for the send timeout,
and an unreachable Redis (a closed port, a listener that never answers) is a quick JSON 503. Last, the load test:
300 concurrent requests, half of them streamed, some never read."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from redis import Redis

from pagedq.worker.gateway import create_app
from pagedq.worker.gateway.app import Gateway
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.ops.embedded_redis import free_port
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.testing.stub_engine import StubEngine

from .conftest import wait_for, wait_live, worker_thread

pytestmark = pytest.mark.abuse
SHAPE = {"message", "type", "param", "code"}
KEYS = QueueKeys("default")


@contextlib.contextmanager
def gateway(redis_url: str, send_buffer: int | None = None, **overrides) -> Iterator[tuple[str, Gateway]]:
    """The app on uvicorn in a thread, as conftest's gateway_thread, also giving the Gateway it serves.
    send_buffer: the kernel's send buffer of its connections (a slow network: what a client does not read stays
    in the gateway's process sooner)."""
    settings = GatewaySettings(redis_url=redis_url, port=free_port(), worker_cache_s=0.0, **overrides)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", access_log=False))
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:  # accepted connections inherit it
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    listener.bind(("127.0.0.1", settings.port))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=20, what="gateway start")
    try:
        yield f"http://127.0.0.1:{settings.port}/v1", app.state.gateway
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        listener.close()


def unread_stream(base: str, body: dict) -> socket.socket:
    """A streamed request sent on a raw socket with a small receive buffer, whose answer is never read."""
    host, port = base.removeprefix("http://").split("/")[0].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
        + f"Host: {host}:{port}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


class CountingProxy:
    """A TCP proxy to a Redis server that counts the bytes Redis sends through it (what its client reads)."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.received = target_port, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
                threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
                threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        with contextlib.suppress(OSError), source, sink:
            while data := source.recv(65536):
                sink.sendall(data)
                if counted:
                    with self.lock:
                        self.received += len(data)

    def close(self) -> None:
        self.listener.close()


def sse_events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


def test_open_waits_share_one_read_150_requests_and_256_prompts_on_8_connections(redis_url):
    r = Redis.from_url(redis_url)
    with (
        worker_thread(StubEngine(step_delay_s=0.01), redis_url, model="stub"),
        # the subject is sharing, not timing: a generous reply timeout, so a loaded machine's waits for one of the
        # 8 connections are not 503s
        gateway(redis_url, redis_max_connections=8, redis_socket_timeout_s=60) as (base, _),
    ):
        wait_live(base)
        peak_clients = 0

        async def scenario() -> tuple[list, httpx.Response, str]:
            nonlocal peak_clients
            async with httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=400)) as h:
                waits = [
                    h.post("/completions", json={"model": "stub", "prompt": f"p{i}", "max_tokens": 30})
                    for i in range(150)
                ]
                many = {"model": "stub", "prompt": [f"q{i}" for i in range(256)], "max_tokens": 4}
                plain = h.post("/completions", json=many)

                async def streamed() -> str:
                    async with h.stream("POST", "/completions", json={**many, "stream": True}) as response:
                        assert response.status_code == 200
                        return (await response.aread()).decode()

                async def watch() -> None:
                    nonlocal peak_clients
                    while True:
                        peak_clients = max(peak_clients, int(r.info("clients")["connected_clients"]))
                        await asyncio.sleep(0.05)

                watcher = asyncio.ensure_future(watch())
                try:
                    answers = await asyncio.gather(*waits, plain, streamed())
                finally:
                    watcher.cancel()
                return list(answers[:150]), answers[150], answers[151]

        waits, plain, streamed = asyncio.run(scenario())
    assert Counter(w.status_code for w in waits) == {200: 150}
    assert all(w.json()["usage"]["completion_tokens"] == 30 for w in waits)
    assert plain.status_code == 200, plain.text
    assert sorted(c["index"] for c in plain.json()["choices"]) == list(range(256))
    events = sse_events(streamed)
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    finishes = [c for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finishes) == list(range(256))
    # the gateway's pool (8), the worker's connections and this test's own: not one per open wait
    assert peak_clients <= 20, peak_clients


def test_a_failed_read_after_submission_cancels_the_jobs_and_answers_in_openai_shape(redis_url):
    r = Redis.from_url(redis_url)
    # one job at a time and slow steps: the second prompt of each request is still queued when the first fails
    engine = StubEngine(step_delay_s=0.02, max_num_seqs=1)
    body = {"model": "stub", "prompt": ["first", "second"], "max_tokens": 200, "ignore_eos": True}
    with worker_thread(engine, redis_url, model="stub", max_waiting=1), gateway(redis_url) as (base, _):
        wait_live(base)

        def corrupt_a_result(mid_stream: bool) -> list[str]:
            """The request's job ids, once submitted; one of them gets an entry no reader can parse (mid_stream:
            after its first delta, so that the stream has started)."""
            ids = wait_for(lambda: [k.decode() for k in r.hkeys(KEYS.ids)] or None, what="submitted jobs")
            if mid_stream:
                wait_for(lambda: r.xlen(KEYS.result(ids[0])) > 0, what="the first delta")
            r.xadd(KEYS.result(ids[0]), {"type": "delta", "data": "not json"})
            return ids

        for stream in (False, True):
            with httpx.Client(base_url=base, timeout=30) as h:
                submitted: list[str] = []
                poke = threading.Thread(target=lambda out=submitted, s=stream: out.extend(corrupt_a_result(s)))
                poke.start()
                response = h.post("/completions", json={**body, "stream": stream})
                poke.join()
            wait_for(lambda ids=submitted: all(r.exists(KEYS.final(i)) for i in ids), what="both jobs settled")
            statuses = {json.loads(r.get(KEYS.final(i)))["status"] for i in submitted}
            if stream:
                assert response.status_code == 200
                events = sse_events(response.text)
                assert events[-1] == "[DONE]"
                error = json.loads(events[-2])["error"]
            else:
                assert response.status_code == 500 and response.headers["content-type"] == "application/json"
                error = response.json()["error"]
            assert set(error) == SHAPE and error["type"] == "server_error" and "cancelled" in error["message"]
            assert statuses == {"cancelled"}, statuses


def test_a_stream_whose_client_does_not_read_is_not_read_from_redis(redis_url):
    r = Redis.from_url(redis_url)
    body = {"model": "stub", "prompt": [f"p{i}" for i in range(32)], "max_tokens": 200, "ignore_eos": True}
    engine = StubEngine(max_model_len=4096)
    proxy = CountingProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    with (
        worker_thread(engine, redis_url, model="stub"),
        gateway(proxy.url, send_buffer=4096, stream_buffer=4) as (base, _),
    ):
        wait_live(base)
        before = proxy.received
        sock = unread_stream(base, {**body, "stream": True})
        try:
            wait_for(lambda: r.xlen(KEYS.completions) >= 32, timeout=60, what="every job finished in Redis")
            time.sleep(0.5)  # what the gateway would still read, it reads now
            sent = proxy.received - before
            job_ids = [fields[b"id"].decode() for _, fields in r.xrange(KEYS.completions)]
            produced = sum(
                len(v) for job_id in job_ids for _, fields in r.xrange(KEYS.result(job_id)) for v in fields.values()
            )
        finally:
            sock.close()
    proxy.close()
    # the gateway read a fraction of the results Redis holds for the stream (with RESP's framing: reading them all
    # costs more than `produced`; the bound leaves room for a loaded machine's larger reads)
    assert produced > 200_000, produced
    assert sent < produced / 2, (sent, produced)


def test_a_stream_whose_client_takes_nothing_is_ended_and_its_job_cancelled(redis_url):
    r = Redis.from_url(redis_url)
    body = {"model": "stub", "prompt": "never read", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    engine = StubEngine(step_delay_s=0.002, max_model_len=10_000)
    with (
        worker_thread(engine, redis_url, model="stub"),
        gateway(redis_url, send_buffer=4096, stream_buffer=4, stream_send_timeout_s=1) as (base, gw),
    ):
        wait_live(base)
        sock = unread_stream(base, body)
        try:
            wait_for(lambda: r.xlen(KEYS.completions) >= 1, timeout=30, what="the job's final record")
            wait_for(lambda: gw.streams.open == 0 and not gw.client.shared.waiters, what="the stream's end")
        finally:
            sock.close()
    (_, fields), *_ = r.xrange(KEYS.completions)
    record = json.loads(fields[b"data"])
    assert record["status"] == "cancelled" and len(record["token_ids"]) < 5000


def _silent_listener() -> tuple[socket.socket, int]:
    """A TCP listener that accepts connections (the kernel does) and never answers a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    return listener, listener.getsockname()[1]


@pytest.mark.parametrize("server", ["closed port", "silent listener"])
def test_an_unreachable_redis_is_a_quick_json_503(server):
    listener, port = _silent_listener() if server == "silent listener" else (None, free_port())
    overrides = {"redis_connect_timeout_s": 0.5, "redis_socket_timeout_s": 2.0, "retry_after_s": 3}
    try:
        with gateway(f"redis://127.0.0.1:{port}/0", **overrides) as (base, _), httpx.Client(timeout=15) as h:
            started = time.monotonic()
            health = h.get(base.removesuffix("/v1") + "/health")
            health_s = time.monotonic() - started
            started = time.monotonic()
            answers = [
                h.get(base + "/models"),
                h.post(base + "/completions", json={"model": "stub", "prompt": "x", "max_tokens": 2}),
            ]
            routes_s = time.monotonic() - started
    finally:
        if listener is not None:
            listener.close()
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert health_s < 1.5, health_s
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "3"
        error = answer.json()["error"]
        assert set(error) == SHAPE and error["code"] == "redis_unavailable"
    assert routes_s < 6, routes_s


def test_a_full_redis_is_a_json_503_and_nothing_is_stored(redis_url):
    """Compose's Redis never evicts (maxmemory, noeviction): when full it refuses every write, which the gateway
    answers as OpenAI's 503 with Retry-After, as an unreachable Redis."""
    r = Redis.from_url(redis_url)
    with gateway(redis_url, retry_after_s=3) as (base, _), httpx.Client(timeout=15) as h:
        r.config_set("maxmemory", 1)  # below what it holds already: every write is refused
        try:
            answer = h.post(base + "/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"{}\n")})
        finally:
            r.config_set("maxmemory", 0)
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "3"
    error = answer.json()["error"]
    assert set(error) == SHAPE and error["code"] == "redis_unavailable" and "full" in error["message"]
    assert r.keys("pagedq:*file*") == []


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_load_300_concurrent_requests_half_streamed_some_never_read(redis_url):
    """150 plain and 150 streamed requests at once, 20 of the streamed ones never read (each 4 prompts of 200
    tokens, on a small send buffer): every read one is a 200 that adds up, nothing is a 500, the results the
    gateway holds stay bounded, and once the unread clients leave no job is left unfinished."""
    r = Redis.from_url(redis_url)
    buffer, unread = 8, 20
    engine = StubEngine(max_model_len=4096)
    with (
        worker_thread(engine, redis_url, model="stub"),
        gateway(redis_url, send_buffer=4096, stream_buffer=buffer) as (base, gw),
    ):
        wait_live(base)
        rss_before, peaks = _rss_bytes(), {"buffered": 0, "rss": 0}

        async def scenario() -> list[tuple[bool, int, str]]:
            limits = httpx.Limits(max_connections=400)
            async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as h:

                async def one(i: int) -> tuple[bool, int, str]:
                    body = {"model": "stub", "prompt": f"p{i}", "max_tokens": 8, "ignore_eos": True}
                    if i % 2 == 0:
                        answer = await h.post("/completions", json=body)
                        return False, answer.status_code, answer.text
                    async with h.stream("POST", "/completions", json={**body, "stream": True}) as response:
                        return True, response.status_code, (await response.aread()).decode()

                async def watch() -> None:
                    while True:
                        health = (await h.get(base.removesuffix("/v1") + "/health")).json()
                        peaks["buffered"] = max(peaks["buffered"], health["buffered_results"])
                        peaks["rss"] = max(peaks["rss"], _rss_bytes() - rss_before)
                        await asyncio.sleep(0.05)

                watcher = asyncio.ensure_future(watch())
                try:
                    return await asyncio.gather(*(one(i) for i in range(300 - unread)))
                finally:
                    watcher.cancel()

        long_stream = {"model": "stub", "prompt": list("abcd"), "max_tokens": 200, "ignore_eos": True, "stream": True}
        never_read = [unread_stream(base, long_stream) for _ in range(unread)]
        try:
            answers = asyncio.run(scenario())
            wait_for(lambda: r.xlen(KEYS.completions) >= 300 - unread + 4 * unread, timeout=30, what="every job ran")
            held = gw.client.shared.buffered
        finally:
            for sock in never_read:
                sock.close()
        wait_for(lambda: gw.streams.open == 0 and not gw.client.shared.waiters, what="every stream closed")
        wait_for(lambda: r.hlen(KEYS.ids) == 0, what="no unfinished job")
    assert Counter(status for _, status, _ in answers) == {200: 300 - unread}
    for streamed, _, text in answers:
        if streamed:
            events = sse_events(text)
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
            assert "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"]) != ""
        else:
            assert json.loads(text)["usage"]["completion_tokens"] == 8
    # each prompt of an unread stream holds at most 2 x stream_buffer - 1 entries (and its stream its hand-off)
    assert held <= 4 * unread * (2 * buffer - 1), held
    assert peaks["buffered"] <= 4 * unread * (2 * buffer - 1) + (300 - unread) * (2 * buffer - 1), peaks
    assert peaks["rss"] < 300 * 2**20, peaks
