"""The compose stack's Redis ACL users (deploy/redis/users.acl, rendered by deploy/redis/start.sh as compose's redis
service runs it) on a real redis-server: each service does its work with its own user and nothing more, and a
producer reads only the results of its own jobs (issue 34, finding 14)."""

from __future__ import annotations

import asyncio
import fnmatch
import json
import subprocess
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from redis import Redis
from redis.exceptions import NoPermissionError, OutOfMemoryError

from pagedq.worker import AsyncClient, Client
from pagedq.worker.client.core import make_job
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.testing.stub_engine import StubEngine
from tests.deploy import compose
from tests.deploy.redis_acl import START, AclRedis, acl_redis, key_patterns, password_variables, producer_prefix
from tests.gateway.conftest import CHAT_TEMPLATE, gateway_thread, wait_live
from tests.worker.helpers import worker_thread

KEYS = QueueKeys("default")


@pytest.fixture
def server(tmp_path: Path):
    with acl_redis(tmp_path) as running:
        yield running


def _denied(call, *args: object) -> None:
    with pytest.raises(NoPermissionError):
        call(*args)


@pytest.mark.abuse
def test_a_producer_reads_its_own_results_and_no_one_elses(server: AclRedis) -> None:
    prefix = producer_prefix()
    other = Client(server.url("gateway"))  # another producer of the queue: the gateway, for any tenant
    theirs = other.submit("their prompt", max_tokens=4, job_id="tenant-b.secret-1")
    with Client(server.url("producer"), job_id_prefix=prefix) as producer:
        mine = producer.submit("my prompt", max_tokens=4)
        cancelled = producer.submit("cancel me", max_tokens=4)
        assert mine.startswith(prefix) and producer.cancel(cancelled)  # SUBMIT and CANCEL run under its user
        with pytest.raises(JobRejected, match="job_id_prefix"):
            producer.submit("not mine", job_id="tenant-b.secret-2")
        with worker_thread(StubEngine(), server.url("worker")):  # the worker's own user, end to end
            assert producer.result(mine, timeout=20).status == "completed"
            assert producer.result(cancelled, timeout=20).status == "cancelled"
            assert other.result(theirs, timeout=20).status == "completed"
            assert [d.text for d in producer.stream(producer.submit("again", max_tokens=3, stream=True), timeout=20)]

        # the other job's result, by its id or by pattern, through the Client or raw commands: refused
        _denied(producer.result, theirs, 1)
        _denied(producer.final, theirs)
        raw = producer.r
        _denied(raw.xread, {KEYS.result(theirs): "0-0"})
        _denied(raw.get, KEYS.final(theirs))
        _denied(raw.keys, "pagedq:*")
        _denied(raw.scan, 0, "pagedq:{default}:result:*")
        _denied(raw.xrange, KEYS.result(theirs))
        # nor the shared streams: every final record (completions), every prompt (the job streams), dead letters
        for stream in (KEYS.completions, KEYS.jobs, KEYS.jobs_of("bulk"), KEYS.dead):
            _denied(raw.xread, {stream: "0-0"})
            _denied(raw.xrange, stream)
        _denied(raw.hgetall, KEYS.ids)
        # nor a script of its own that reads them: the commands a script runs are checked too
        _denied(raw.eval, "return redis.call('GET', KEYS[1])", 1, KEYS.final(theirs))
        _denied(raw.execute_command, "FUNCTION", "LIST")


@pytest.mark.abuse
def test_the_services_users_have_no_administrative_command(server: AclRedis) -> None:
    for user in ("worker", "gateway", "producer"):
        with Redis.from_url(server.url(user)) as r:
            _denied(r.keys, "*")
            _denied(r.flushall)
            _denied(r.config_get, "*")
            _denied(r.execute_command, "ACL", "LIST")
            _denied(r.set, "not-pagedq", "1")  # only pagedq's keys
    with Redis.from_url(server.url("default")) as operator:
        assert operator.config_get("appendonly")  # the operator's user: everything


def test_the_gateway_user_serves_the_api(server: AclRedis) -> None:
    engine = StubEngine(chat_template=CHAT_TEMPLATE)
    with worker_thread(engine, server.url("worker")), gateway_thread(server.url("gateway")) as base:
        wait_live(base)
        sdk = OpenAI(base_url=base, api_key="unused")
        (model,) = [m.id for m in sdk.models.list().data]
        reply = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert reply.choices[0].message.content and reply.usage and reply.usage.completion_tokens == 4
        streamed = sdk.completions.create(model=model, prompt="Hi", max_tokens=3, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
        uploaded = sdk.files.create(file=("in.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
        assert sdk.files.content(uploaded.id).content == b'{"custom_id": "a"}\n'
        assert httpx.get(base.removesuffix("/v1") + "/health", timeout=5).status_code == 200


def test_start_renders_hashes_and_puts_no_password_on_a_command_line(server: AclRedis, tmp_path: Path) -> None:
    rendered = (tmp_path / "users.acl").read_text()
    assert (tmp_path / "users.acl").stat().st_mode & 0o077 == 0  # owner-only
    cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode()
    environ = Path(f"/proc/{server.process.pid}/environ").read_bytes().decode()
    assert "redis-server" in cmdline  # start.sh exec'd the server (which rewrites its title)
    for password in server.passwords.values():
        assert password not in rendered and password not in cmdline and password not in environ
    assert "#{" not in rendered and len(rendered.splitlines()) == len(password_variables())
    with Redis.from_url(server.url("default")) as operator:
        users = {line.split()[1] for line in operator.acl_list()}
        assert operator.config_get("aclfile") == {"aclfile": str(tmp_path / "users.acl")}
    assert users == {"default", "worker", "gateway", "producer"}


def test_the_producer_patterns_name_the_queue_by_its_hash_tag() -> None:
    """On a Redis Cluster each queue lives in the slot of its {tag}: the patterns spell the tag as the keys do (an
    ACL glob takes braces literally), so one pattern set serves a single Redis and a cluster alike."""
    prefix = producer_prefix()
    patterns = key_patterns("producer")
    assert patterns and all(p.startswith(KEYS.base + ":") for p in patterns), patterns
    mine = [
        KEYS.jobs,
        KEYS.jobs_of("bulk"),
        KEYS.ids,
        KEYS.cancelled,
        KEYS.result(prefix + "1"),
        KEYS.final(prefix + "1"),
    ]
    assert all(any(fnmatch.fnmatchcase(key, p) for p in patterns) for key in mine)
    theirs = [KEYS.result("other.1"), KEYS.final("other.1"), KEYS.completions, KEYS.dead, KEYS.file("f"), KEYS.workers]
    assert not any(fnmatch.fnmatchcase(key, p) for key in theirs for p in patterns)
    assert key_patterns("worker") == key_patterns("gateway") == ["pagedq:*"]


def test_start_refuses_a_missing_password_naming_it(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "REDIS_PASSWORD": "set", "REDIS_ACL_FILE": str(tmp_path / "u.acl")}
    out = subprocess.run(["sh", str(START)], env=env, capture_output=True, text=True, timeout=10)
    assert out.returncode == 1 and "set REDIS_WORKER_PASSWORD" in out.stderr, out


@pytest.mark.abuse
def test_a_full_redis_refuses_writes_and_evicts_nothing(tmp_path: Path) -> None:
    """Compose's memory policy, with its own arguments and a tiny maxmemory: submitting fails once Redis is full,
    and every job queued before stays queued (noeviction)."""
    args = compose.resolve(compose.load(dict.fromkeys(password_variables(), "pw")), "redis").argv
    assert args[:2] == ["sh", "/etc/pagedq/redis/start.sh"]
    policy = args[args.index("--maxmemory-policy") + 1]
    assert policy == "noeviction"
    queued: list[str] = []
    with acl_redis(tmp_path, *args[2:], "--maxmemory", "3mb") as full, Redis.from_url(full.url("default")) as operator:
        assert operator.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        producer = Client(full.url("producer"), job_id_prefix=producer_prefix())
        with producer, pytest.raises(OutOfMemoryError):
            for _ in range(10_000):
                queued.append(producer.submit("x" * 20_000, max_tokens=1))
        assert len(queued) > 10  # it filled up, then refused
        entries = operator.xrange(KEYS.jobs)
        assert [json.loads(fields[b"job"])["id"] for _, fields in entries] == queued


def test_the_async_client_keeps_to_its_prefix_too(server: AclRedis) -> None:
    prefix = producer_prefix()
    with pytest.raises(ValueError, match="job_id_prefix"):
        AsyncClient(server.url("producer"), job_id_prefix="producer.*")  # a glob would widen its ACL pattern

    async def run() -> list[str]:
        async with AsyncClient(server.url("producer"), job_id_prefix=prefix) as producer:
            ids = await producer.submit_many([{"prompt": "a", "max_tokens": 1}, make_job("b", job_id=prefix + "b")])
            with pytest.raises(JobRejected, match="job_id_prefix"):
                await producer.submit_many([{"prompt": "c"}, make_job("d")])  # all or none
            return ids

    ids = asyncio.run(run())
    assert ids[0].startswith(prefix) and ids[1] == prefix + "b"
    with Redis.from_url(server.url("default")) as operator:
        assert operator.xlen(KEYS.jobs) == 2
