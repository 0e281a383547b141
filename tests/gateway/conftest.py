"""Fixtures for the gateway tests: a private redis-server, a worker thread on a tiny checkpoint and
`pagedq serve`'s app on uvicorn in a thread (or as a subprocess), talked to with the official openai SDK."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from pagedq.engine import LLMEngine
from pagedq.worker.gateway import create_app
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.ops.embedded_redis import EmbeddedRedis, free_port

from ..worker.helpers import PRIMARY_REDIS, REDIS_SERVERS, REPO, wait_for, worker_thread

# A minimal chat template (the tiny checkpoints have none): the oracle renders it with transformers.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture
def redis_url() -> Iterator[str]:
    """One fresh redis-server (the worker tests cover both server versions; the gateway adds no command)."""
    server = private_redis()
    try:
        yield server.url
    finally:
        server.stop()


def private_redis() -> EmbeddedRedis:
    """A started redis-server of the primary version, without persistence (stop() it)."""
    return EmbeddedRedis(binary=REDIS_SERVERS[PRIMARY_REDIS], extra_args=("--save", "", "--appendonly", "no")).start()


@pytest.fixture(scope="session")
def chat_llama_dir(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    """The tiny llama checkpoint with a chat template added to its tokenizer config."""
    folder = tmp_path_factory.mktemp("chat-llama")
    for item in tiny_llama_dir.iterdir():
        shutil.copy(item, folder / item.name)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


@contextlib.contextmanager
def gateway_thread(redis_url: str, **overrides: Any) -> Iterator[str]:
    """`pagedq serve`'s app on uvicorn in a thread, on 127.0.0.1; yields its base URL (…/v1)."""
    settings = GatewaySettings(redis_url=redis_url, port=free_port(), worker_cache_s=0.0, **overrides)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=settings.port, log_level="warning", access_log=False
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=20, what="gateway start")
    try:
        yield f"http://127.0.0.1:{settings.port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def start_gateway_process(redis_url: str, log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """`python -m pagedq.worker serve` as a subprocess; returns it and its base URL once /health answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDQ_WORKER_CACHE_S": "0"}
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedq.worker", "serve", "--redis", redis_url, "--port", str(port), *args],
            cwd=REPO,
            env=env,
            stdout=fh,
            stderr=fh,
        )

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code in (200, 503)
        except httpx.HTTPError:
            assert proc.poll() is None, log.read_text()
            return False

    wait_for(up, timeout=60, interval=0.1, what="gateway process")
    return proc, f"http://127.0.0.1:{port}/v1"


def wait_live(base_url: str) -> None:
    """Until the gateway sees a live worker (its first heartbeat)."""
    wait_for(lambda: httpx.get(base_url + "/models", timeout=5).json().get("data"), timeout=30, what="a live worker")


@contextlib.contextmanager
def served_model(model_dir: Path) -> Iterator[SimpleNamespace]:
    """Redis, one worker thread on `model_dir` and one gateway thread, for a test module: base (URL), sdk (the
    openai client), model (its id), url (Redis), engine."""
    server = private_redis()
    engine = LLMEngine(str(model_dir), device="cpu", num_kv_blocks=256)
    try:
        with worker_thread(engine, server.url), gateway_thread(server.url) as base:
            wait_live(base)
            sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            yield SimpleNamespace(base=base, sdk=sdk, model=sdk.models.list().data[0].id, url=server.url, engine=engine)
    finally:
        server.stop()


AS_IDS = {"return_tokens_as_token_ids": True}  # vLLM's extra: logprobs name tokens "token_id:<id>"


def llm_tokens(tokens: list[str]) -> list[int]:
    """Token ids from log-probability token names ("token_id:<id>", vLLM's return_tokens_as_token_ids)."""
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":", 1)[1]) for t in tokens]
