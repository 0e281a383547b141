"""Who may load and unload LoRA adapters through the gateway (issue 36): nobody unless allow_runtime_lora_updating
is on (the routes do not exist, as vLLM's); with API keys, only an admin key (a tenant's key gets 403), and a
gateway with keys but no admin key refuses to start. Stub worker, real Redis."""

from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError
from redis import Redis

from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.testing.stub_engine import StubEngine

from .conftest import gateway_thread, worker_thread
from .test_tenancy import PLAIN, TENANTS

ADMIN = "admin-key-1"


def _post(base: str, path: str, key: str | None, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(base + path, json=body, headers=headers, timeout=10)


def test_the_routes_are_off_by_default(redis_url, tmp_path):
    with worker_thread(StubEngine(), redis_url, model="stub"), gateway_thread(redis_url) as base:
        answer = _post(base, "/load_lora_adapter", None, {"lora_name": "a", "lora_path": str(tmp_path)})
        assert answer.status_code == 404
        assert not Redis.from_url(redis_url).exists(QueueKeys().loras)


def test_keys_without_an_admin_key_refuse_to_start():
    with pytest.raises(ValidationError, match="PAGEDQ_ADMIN_API_KEYS"):
        GatewaySettings(api_keys=[PLAIN], allow_runtime_lora_updating=True)
    GatewaySettings(allow_runtime_lora_updating=True)  # keyless: bound to this machine by default


def test_only_an_admin_key_loads_and_unloads(redis_url, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    body = {"lora_name": "a", "lora_path": str(folder)}
    with (
        worker_thread(StubEngine(), redis_url, model="stub"),
        gateway_thread(
            redis_url,
            api_key_tenants=TENANTS,
            api_keys=[PLAIN],
            admin_api_keys=[ADMIN],
            allow_runtime_lora_updating=True,
        ) as base,
    ):
        for key in ("key-a", PLAIN):
            refused = _post(base, "/load_lora_adapter", key, body)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
        assert _post(base, "/load_lora_adapter", "no-such-key", body).status_code == 401
        assert _post(base, "/load_lora_adapter", ADMIN, body).status_code == 200
        assert _post(base, "/unload_lora_adapter", "key-a", {"lora_name": "a"}).status_code == 403
        # the adapter serves every tenant: a tenant's request names it in `model`
        listed = httpx.get(base + "/models", headers={"Authorization": "Bearer key-a"}, timeout=10).json()["data"]
        assert {m["id"]: m.get("parent") for m in listed}["a"] == "stub"
        answer = httpx.post(
            base + "/completions",
            json={"model": "a", "prompt": "hi", "max_tokens": 4, "temperature": 0},
            headers={"Authorization": "Bearer key-b"},
            timeout=10,
        )
        assert answer.status_code == 200
        assert answer.json()["model"] == "a"
        assert _post(base, "/unload_lora_adapter", ADMIN, {"lora_name": "a"}).status_code == 200
        bad = _post(base, "/load_lora_adapter", ADMIN, {"lora_name": "bad name", "lora_path": str(folder)})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_name"
        long_path = _post(base, "/load_lora_adapter", ADMIN, {"lora_name": "b", "lora_path": "/" + "x" * 5000})
        assert long_path.status_code == 400
        extra = _post(base, "/load_lora_adapter", ADMIN, {**body, "surprise": 1})
        assert extra.status_code == 400
