"""Tenants at the gateway: the API key names the tenant (api_key_tenants), whose jobs carry it, and a tenant past
its max_tenant_queued unfinished jobs gets a 429 while another tenant's requests still go through."""

from __future__ import annotations

import json

import openai
import pytest

from pagedq.worker import Client
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.testing.stub_engine import StubEngine

from .conftest import gateway_thread, wait_for, worker_thread


def test_the_api_key_names_the_tenant_and_each_tenant_has_its_own_limit(redis_url):
    tenants = {"key-a": "acme", "key-b": "globex"}
    engine = StubEngine(step_delay_s=0.05)
    with (
        worker_thread(engine, redis_url, model="stub"),
        gateway_thread(redis_url, api_key_tenants=tenants, max_tenant_queued=2) as base,
    ):
        acme = openai.OpenAI(base_url=base, api_key="key-a", max_retries=0)
        globex = openai.OpenAI(base_url=base, api_key="key-b", max_retries=0)
        wait_for(lambda: acme.models.list().data, what="a live worker")
        # acme's two long jobs from another front door under the same limit (a bulk client, say)
        client = Client(redis_url, max_tenant_queued=2)
        held = [client.submit(prompt="long", max_tokens=2000, ignore_eos=True, tenant="acme") for _ in range(2)]
        with pytest.raises(openai.RateLimitError) as full:
            acme.completions.create(model="stub", prompt="one more", max_tokens=2)
        ok = globex.completions.create(model="stub", prompt="another tenant", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="key-c", max_retries=0).models.list()
        globex_jobs = {m.decode() for m in client.r.smembers(client.keys.tenant_queued("globex"))}
        for job_id in held:
            client.cancel(job_id)
        wait_for(lambda: client.queue_depth() == 0, what="acme's jobs cancelled")
        again = acme.completions.create(model="stub", prompt="now it fits", max_tokens=2)
    assert full.value.status_code == 429 and full.value.body["code"] == "queue_full"
    assert "acme" in full.value.body["message"]
    assert ok.usage.completion_tokens == 2 and again.usage.completion_tokens == 2
    assert globex_jobs == {ok.id.removeprefix("cmpl-")}  # the key's tenant rode on the job


def test_key_tenant_pairs_are_validated():
    assert GatewaySettings(api_key_tenants="k1=acme, k2=globex").accepted_keys == ["k1", "k2"]
    for bad in ("k1", "=acme", "k1=bad tenant"):
        with pytest.raises(ValueError, match=r"tenant|KEY=TENANT"):
            GatewaySettings(api_key_tenants=bad)
    assert json.dumps(GatewaySettings(api_keys=["x"], api_key_tenants={"y": "t"}).accepted_keys) == '["x", "y"]'
