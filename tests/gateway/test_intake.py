"""The gateway's front, before any route runs (pagedq/worker/gateway/intake.py, connections.py): the key from the
headers before a body byte is read, a body cap per route, deadlines for slow clients, a cap on connections,
Host/Origin on a keyless gateway, and API keys kept off command lines and out of error messages.

The bytes on the wire matter here, so most requests are raw sockets against `pagedq serve`'s own uvicorn setup
(connections.server_config) in a thread, with a real Redis."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from pagedq.worker.cli.main import build_parser
from pagedq.worker.gateway import create_app
from pagedq.worker.gateway.connections import server_config
from pagedq.worker.gateway.serve import settings_from_args
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.ops.embedded_redis import free_port

from .conftest import wait_for

pytestmark = pytest.mark.abuse

KEYS = {"key-a": "acme", "key-b": "globex"}
JSON = b"Content-Type: application/json\r\n"
KEYED_JSON = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/batches")


@contextlib.contextmanager
def serving(redis_url: str, **overrides: Any) -> Iterator[int]:
    """The app as `pagedq serve` runs it (header deadline, connection cap) in a thread; yields its port."""
    settings = GatewaySettings(redis_url=redis_url, port=free_port(), worker_cache_s=0.0, **overrides)
    server = uvicorn.Server(server_config(create_app(settings), settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=20, what="gateway start")
    try:
        yield settings.port
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def exchange(port: int, request: bytes, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Sends `request` as it is and reads one answer until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def head(method: str, path: str, port: int, *extra: bytes) -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode() + b"".join(extra) + b"\r\n"


def test_a_request_without_a_key_is_refused_before_its_body_is_read(redis_url):
    """300 MB announced and none sent: the 401 comes from the headers alone, and the connection is closed."""
    with serving(redis_url, api_key_tenants=KEYS) as port:
        for path in ("/v1/completions", "/v1/files", "/tokenize", "/detokenize"):
            started = time.monotonic()
            status, headers, body = exchange(port, head("POST", path, port, JSON, b"Content-Length: 300000000\r\n"))
            assert status == 401, (path, body)
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
            assert headers["connection"] == "close" and time.monotonic() - started < 2
        wrong = exchange(port, head("POST", "/v1/completions", port, b"Authorization: Bearer key-c\r\n", JSON))
        assert wrong[0] == 401


def test_a_deep_body_is_401_without_a_key_and_a_400_naming_the_nesting_with_one(redis_url):
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with serving(redis_url, api_key_tenants=KEYS) as port:
        base = f"http://127.0.0.1:{port}/v1/chat/completions"
        keyless = httpx.post(base, content=deep, headers={"content-type": "application/json"})
        keyed = {"content-type": "application/json", "authorization": "Bearer key-a"}
        answers = [httpx.post(f"http://127.0.0.1:{port}{path}", content=deep, headers=keyed) for path in KEYED_JSON]
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key"
    for answer in answers:  # parse_body on the completion routes, FastAPI's parsing on the others
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"] == "the JSON body is nested too deeply"


def test_a_body_over_its_route_cap_is_413_before_it_is_read_or_once_it_streams_past(redis_url):
    key = b"Authorization: Bearer key-a\r\n"
    with serving(redis_url, api_key_tenants=KEYS, max_json_bytes=4096) as port:
        announced = exchange(port, head("POST", "/v1/chat/completions", port, key, JSON, b"Content-Length: 4097\r\n"))
        upload = exchange(port, head("POST", "/v1/files", port, key, b"Content-Length: 300000000\r\n"))
        chunk = b"1000\r\n" + b" " * 4096 + b"\r\n"  # whitespace: valid JSON padding, past the cap on its own
        streamed = exchange(
            port, head("POST", "/v1/completions", port, key, JSON, b"Transfer-Encoding: chunked\r\n") + chunk * 2
        )
        closing = b"Connection: close\r\nContent-Length: 2\r\n"
        fits = exchange(port, head("POST", "/v1/completions", port, key, JSON, closing) + b"{}")
    for status, headers, body in (announced, upload, streamed):
        assert status == 413 and headers["connection"] == "close", body
        error = json.loads(body)["error"]
        assert error["code"] == "body_too_large" and error["type"] == "invalid_request_error"
    assert "4096 bytes" in json.loads(announced[2])["error"]["message"]
    assert str(200 * 1024 * 1024 + 1024 * 1024) in json.loads(upload[2])["error"]["message"]  # the file cap
    assert fits[0] == 400 and "model" in json.loads(fits[2])["error"]["message"]  # read, parsed, validated


def _trickle(port: int, count: int, first: bytes) -> list[socket.socket]:
    conns = []
    for _ in range(count):
        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn.sendall(first)
        conn.setblocking(False)
        conns.append(conn)
    return conns


def _closed(conn: socket.socket, more: bytes, answers: dict[socket.socket, bytes] | None = None) -> bool:
    """Sends one more byte; True once the server has closed (or answered and closed) the connection. What the
    server sent goes to `answers`."""
    try:
        data = conn.recv(65536)
        if answers is not None:
            answers[conn] = answers.get(conn, b"") + data
        if data == b"":
            return True
    except BlockingIOError:
        pass
    except OSError:
        return True
    try:
        conn.send(more)
    except BlockingIOError:
        pass
    except OSError:
        return True
    return False


def test_slow_clients_are_closed_after_their_deadline_while_others_are_served(redis_url):
    """Connections trickling their headers, or their body, a byte at a time are closed (the body's with a 408);
    a normal request is answered meanwhile."""
    with serving(redis_url, header_timeout_s=1.0, body_timeout_s=1.0, body_min_rate=1_000_000) as port:
        slow_headers = _trickle(port, 40, f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-A: ".encode())
        slow_bodies = _trickle(port, 10, head("POST", "/v1/completions", port, JSON, b"Content-Length: 1000\r\n"))
        idle = _trickle(port, 10, b"")
        started = time.monotonic()
        served, answers = [], {}
        open_conns = set(slow_headers + slow_bodies + idle)
        while open_conns and time.monotonic() - started < 6:
            served.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code)
            for conn in list(open_conns):
                if _closed(conn, b"a" if conn not in idle else b"", answers):
                    open_conns.discard(conn)
            time.sleep(0.2)
        elapsed = time.monotonic() - started
        for conn in slow_headers + slow_bodies + idle:
            conn.close()
    assert not open_conns and 0.8 < elapsed < 5
    assert served and set(served) == {200}
    for conn in slow_bodies:
        assert b" 408 " in answers[conn] and b'"code":"timeout"' in answers[conn], answers[conn]


def test_headers_past_their_cap_are_431_and_the_connection_closed(redis_url):
    """Headers sent at full speed are cut at max_header_bytes (httptools has no cap of its own)."""
    with serving(redis_url, max_header_bytes=4096) as port:
        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
        # one write, all read at once: the server then closes with nothing unread (no reset)
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + (b"X-Big: " + b"a" * 1024 + b"\r\n") * 6)
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := conn.recv(65536):
                answer += chunk
        conn.close()
        fine = httpx.get(f"http://127.0.0.1:{port}/health", headers={"x-small": "a" * 1024})
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 431 Request Header Fields Too Large", answer[:200]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "headers_too_large" and "4096 bytes" in error["message"]
    assert fine.status_code == 200


def test_connections_are_capped(redis_url):
    """max_connections is uvicorn's limit_concurrency: past it a request gets 503; once the idle connections
    are closed by the header deadline, requests are served again."""
    with serving(redis_url, max_connections=5, header_timeout_s=1.0) as port:
        idle = _trickle(port, 5, b"")
        time.sleep(0.2)  # accepted by the server before the next one
        crowded = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
        for conn in idle:
            wait_for(lambda conn=conn: _closed(conn, b""), timeout=5, what="the idle connection closed")
            conn.close()
        later = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
    assert crowded == 503 and later == 200


def test_a_keyless_gateway_checks_host_and_origin(redis_url):
    """DNS rebinding (a foreign Host) and cross-site posts (a foreign Origin) get 403; same-origin, local names,
    IP addresses and allowed_hosts pass. With keys, the Host check stays off unless allowed_hosts is set."""
    upload = {"files": {"file": ("in.jsonl", b'{"custom_id": "a"}\n')}, "data": {"purpose": "batch"}}
    with serving(redis_url, allowed_hosts=["gw.internal"]) as port:
        base = f"http://127.0.0.1:{port}"

        def post(**headers: str) -> httpx.Response:
            return httpx.post(base + "/v1/files", headers=headers, **upload)

        rebound = post(host=f"attacker.example:{port}")
        cross = post(origin="http://attacker.example")
        opaque = post(origin="null")
        same = post(origin=base)
        local = post(host=f"localhost:{port}", origin=f"http://localhost:{port}")
        allowed = post(host="gw.internal", origin="http://gw.internal")
        health = httpx.get(base + "/health", headers={"host": "attacker.example"})
    for refused in (rebound, cross, opaque, health):
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden_host", refused.text
    assert "attacker.example" in rebound.json()["error"]["message"]
    assert [r.status_code for r in (same, local, allowed)] == [200, 200, 200]
    assert same.json()["object"] == "file"
    with serving(redis_url, api_key_tenants=KEYS) as port:
        keyed = httpx.get(
            f"http://127.0.0.1:{port}/v1/models",
            headers={"host": "anything.example", "origin": "http://elsewhere.example", "authorization": "Bearer key-a"},
        )
    assert keyed.status_code == 200


def test_api_keys_come_from_the_environment_or_a_file_never_argv_and_errors_hide_them(
    redis_url, tmp_path, monkeypatch, capsys
):
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["serve", "--api-key", "sekrit-argv"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "PAGEDQ_API_KEYS" in err and "--api-key-file" in err and "sekrit-argv" not in err

    monkeypatch.setenv("PAGEDQ_API_KEY_TENANTS", "good=acme,sekrit-env-key")
    with pytest.raises(SystemExit) as malformed:
        settings_from_args(build_parser().parse_args(["serve"]))
    assert "KEY=TENANT" in str(malformed.value) and "pair 2" in str(malformed.value)
    assert "sekrit" not in str(malformed.value) and "good" not in str(malformed.value)
    with pytest.raises(ValueError) as direct:
        GatewaySettings(api_key_tenants="sekrit=not a tenant")
    assert "sekrit" not in str(direct.value)
    monkeypatch.delenv("PAGEDQ_API_KEY_TENANTS")

    key_file = tmp_path / "keys"
    key_file.write_text("# one key or KEY=TENANT a line\nfile-plain\n\nfile-acme=acme\n")
    monkeypatch.setenv("PAGEDQ_API_KEY_FILE", str(key_file))
    settings = settings_from_args(build_parser().parse_args(["serve", "--redis", redis_url, "--port", "0"]))
    assert settings.accepted_keys == ["file-plain", "file-acme"] and settings.api_key_tenants == {"file-acme": "acme"}
    key_file.write_text("fine\nsekrit=bad tenant\n")
    with pytest.raises(SystemExit) as bad_line:
        settings_from_args(build_parser().parse_args(["serve"]))
    assert "line 2" in str(bad_line.value) and "sekrit" not in str(bad_line.value)

    key_file.write_text("file-plain\n")
    with serving(redis_url, api_key_file=key_file) as port:
        models = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(models, headers={"authorization": "Bearer file-plain"}).status_code == 200
        assert httpx.get(models).status_code == 401
