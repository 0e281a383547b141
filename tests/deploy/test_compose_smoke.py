"""`docker compose --profile cpu up` without docker: the compose file and the Dockerfiles it builds are resolved as
docker would (tests/deploy/compose.py) and each service is run as a local process (tests/deploy/local_stack.py:
how host names, ports, paths and images are mapped). A real redis-server runs with the compose file's own
arguments, password and AOF included; the example producer's redis-cli script runs as written and its job
completes on the demo model; every healthcheck passes; the gateway answers on its published port; and the
dashboard's queries are answered by the running services' /metrics.

This catches what the schema check cannot: a renamed variable or flag, a wrong command, a broken healthcheck, a
service that imports what its image does not install."""

from __future__ import annotations

import json
import re
import secrets
import signal
import urllib.request
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from redis import AuthenticationError, Redis
from redis.exceptions import NoPermissionError, ResponseError

from tests.deploy import compose, dashboard
from tests.deploy.images import image_distributions, modules_not_in
from tests.deploy.local_stack import LocalStack
from tests.deploy.redis_acl import MOUNTED_AT, START, password_variables, producer_prefix, redis7_server

QUESTION = "What is the capital of France?"


def demo_build_dir(image: compose.Image) -> str:
    """Where the image's build stage converted the demo model (PAGEDQ_CACHE_DIR=... demo_model_path())."""
    (run,) = [r for r in image.runs(0) if "demo_model_path()" in r]
    match = re.search(r"PAGEDQ_CACHE_DIR=(\S+) python", run)
    assert match, run
    return match.group(1)


def removed_after_build(image: compose.Image) -> set[str]:
    """The distributions the build stage uninstalls before the runtime stage takes its virtualenv."""
    (run,) = [r for r in image.runs(0) if "pip uninstall" in r]
    return set(run.split("pip uninstall -y", 1)[1].split("&&")[0].split())


@pytest.mark.slow
def test_cpu_profile_runs_as_local_processes(tmp_path: Path, demo_model_dir: Path) -> None:
    passwords = {name: "smoke-" + secrets.token_hex(8) for name in password_variables()}
    project = compose.load(passwords)  # all a laptop sets: no PAGEDQ_MODEL_DIR, no GPU
    names = compose.enabled(project, {"cpu"})
    assert sorted(names) == ["gateway", "producer", "redis", "worker-cpu"]
    services = [compose.resolve(project, name) for name in names]
    cpu_image = next(s.image for s in services if s.name == "worker-cpu")
    assert cpu_image is not None
    build_dir = demo_build_dir(cpu_image)
    assert cpu_image.env["PAGEDQ_MODEL"] == f"{build_dir}/{demo_model_dir.name}"  # the model the build converted
    not_in_image = {
        "gateway": modules_not_in(image_distributions("gateway")),
        "worker-cpu": modules_not_in(image_distributions("worker-cpu", ["torch"]) - removed_after_build(cpu_image)),
    }
    assert {"torch", "triton"} <= not_in_image["gateway"]
    assert "triton" in not_in_image["worker-cpu"] and not {"torch", "xgrammar"} & not_in_image["worker-cpu"]

    paths = {build_dir: str(demo_model_dir.parent), MOUNTED_AT: str(START.parent)}
    stack = LocalStack(services, tmp_path, paths, not_in_image)
    grace = {svc.name: _seconds(project["services"][svc.name].get("stop_grace_period", "10s")) for svc in services}
    try:
        _run(stack, passwords)
        # `docker compose down`: SIGTERM, then SIGKILL after stop_grace_period; each service ends cleanly before
        codes = stack.stop(grace)
        # uvicorn shuts down, then re-raises the SIGTERM it caught: -15 here, 0 as a container's PID 1 (which
        # a signal's default action never ends); -9 would mean it outlived its grace period
        assert codes.pop("gateway") in (0, -signal.SIGTERM)
        assert codes == {"producer": 0, "worker-cpu": 0, "redis": 0}, codes  # the worker drained and exited 0
    finally:
        stack.stop()


def _seconds(duration: str) -> float:
    """A compose duration ("45s", "1m30s")."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert parts, duration
    return sum(float(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit] for n, unit in parts)


def _run(stack: LocalStack, passwords: dict[str, str]) -> None:
    redis = stack.services["redis"]
    assert redis.argv[:2] == ["sh", f"{MOUNTED_AT}/start.sh"] and redis.image_name == "redis:7-alpine"
    redis_port = stack.addresses.local[("redis", 6379)]
    # the image's entrypoint runs `sh start.sh ARGS` as given (start.sh renders the ACL users, then runs
    # redis-server ARGS); only where it listens and writes, and the server binary (Redis 7), are ours
    local = ["--port", str(redis_port), "--bind", "127.0.0.1", "--dir", str(stack.workdir)]
    acl_file = {"REDIS_ACL_FILE": str(stack.workdir / "users.acl"), "REDIS_SERVER": redis7_server()}
    stack.start("redis", [*stack.argv(redis, redis.argv), *local], env=acl_file)
    stack.wait_healthy("redis", timeout_s=20)
    for name in ("worker-cpu", "gateway", "producer"):  # each waits for Redis's healthcheck, as compose does
        assert stack.services[name].depends_on == {"redis": "service_healthy"}, name
        stack.start(name)

    # the worker loads the demo model in ~10 s here, then answers in ~1 s
    code = stack.wait_exit("producer", timeout_s=120, keep_running=["redis", "worker-cpu", "gateway"])
    printed = stack.log("producer")
    assert code == 0, printed + stack.log("worker-cpu")
    record = json.loads(printed.strip().splitlines()[-1])  # the script's last line: the final record
    assert record["status"] == "completed" and record["worker"] == "worker-cpu-1", record
    assert "paris" in record["text"].lower(), record["text"]

    for name in ("redis", "worker-cpu", "gateway"):  # every healthcheck, compose's or the image's, passes
        stack.wait_healthy(name, timeout_s=30)

    gateway = stack.services["gateway"]
    client = OpenAI(base_url=f"http://127.0.0.1:{stack.addresses.published(gateway, 8000)}/v1", api_key="unused")
    (model,) = [m.id for m in client.models.list().data]
    assert model == "SmolLM2-135M-Instruct"
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0
    )
    content = reply.choices[0].message.content or ""
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8
    assert content and record["text"].startswith(content), (content, record["text"])  # greedy: the same start
    # structured outputs: xgrammar in the CPU image, without the triton it declares (docker/requirements.py)
    schema = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Rome"]}}, "required": ["capital"]}
    constrained = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    assert json.loads(constrained.choices[0].message.content or "") in ({"capital": "Paris"}, {"capital": "Rome"})
    # /tokenize loads the tokenizer the worker published, with transformers and no torch: the image's packages
    base = f"http://127.0.0.1:{stack.addresses.published(gateway, 8000)}"
    tokens = httpx.post(f"{base}/tokenize", json={"model": model, "prompt": QUESTION}, timeout=30).json()
    text = httpx.post(f"{base}/detokenize", json={"model": model, "tokens": tokens["tokens"]}, timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and text["prompt"] == QUESTION, (tokens, text)

    # Redis runs with the compose file's arguments: ACL users with passwords, the append-only file on, a memory
    # limit that evicts nothing; the producer's user read its own result above and reads no other
    with pytest.raises((AuthenticationError, ResponseError)):
        Redis(port=redis_port).ping()
    authed = Redis(port=redis_port, password=passwords["REDIS_PASSWORD"])
    assert authed.config_get("appendonly") == {"appendonly": "yes"}
    assert authed.config_get("appendfsync") == {"appendfsync": "everysec"}
    assert authed.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert {line.split()[1] for line in authed.acl_list()} == {"default", "worker", "gateway", "producer"}
    assert record["id"].startswith(producer_prefix())
    producer = Redis(port=redis_port, username="producer", password=passwords["REDIS_PRODUCER_PASSWORD"])
    with pytest.raises(NoPermissionError):
        producer.xrange("pagedq:{default}:completions")

    # the dashboard's queries, against the services compose runs
    worker_metrics = stack.addresses.local[("worker-cpu", 9100)]
    texts = [
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for port in (worker_metrics, stack.addresses.published(gateway, 8000))
    ]
    assert dashboard.problems(dashboard.load(), dashboard.exposed(*texts)) == []
