"""LoRA adapters through every front door (issue 36) on the real engine and a tiny checkpoint with real PEFT adapter
folders: the native clients, Celery, `pagedq bulk` lines, the gateway's completions (streamed too), chat, Responses
and Batch API, each equal to the engine's own output with the same LoRARequest and unlike the base model's; the
load and unload endpoints reaching the worker; /v1/models; a bad adapter's error while the worker keeps serving."""

from __future__ import annotations

import asyncio
import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from redis import Redis

from pagedq.engine import LLMEngine
from pagedq.engine.lora.request import LoRARequest
from pagedq.worker import Client, JobRejected
from pagedq.worker.bulk.runner import BulkRun
from pagedq.worker.client.async_client import AsyncClient
from pagedq.worker.protocol.chat import ChatMessage, render_conversation
from pagedq.worker.service.engine_api import RequestOutputKind, SamplingParams

from .conftest import gateway_thread, private_redis, wait_for, wait_live, worker_thread
from .lora_adapters import write_adapter

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Hello there"}]
TOKENS = 8
LORA_OPTIONS = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}


def _engine(model: Path) -> LLMEngine:
    return LLMEngine(str(model), device="cpu", num_kv_blocks=256, **LORA_OPTIONS)


def _direct(
    engine: LLMEngine, prompt: str | list[int], lora: LoRARequest | None, ignore_eos: bool = True
) -> SimpleNamespace:
    """The engine's own greedy answer (text, token ids) for one request: the oracle of every front door."""
    params = SamplingParams(
        max_tokens=TOKENS, temperature=0.0, ignore_eos=ignore_eos, output_kind=RequestOutputKind.FINAL_ONLY
    )
    engine.add_request("oracle", prompt, params, lora=lora)
    while True:
        for out in engine.step():
            if out.finished:
                return SimpleNamespace(text=out.outputs[0].text, ids=list(out.outputs[0].token_ids))


@pytest.fixture(scope="module")
def stack(chat_llama_dir, tmp_path_factory):
    """Redis, a worker thread serving adapter `sql` from its --lora-modules (and Celery), a gateway with run-time
    adapter updates on; the oracle's answer per adapter for PROMPT (.completion) and for CHAT (.chat)."""
    folder = tmp_path_factory.mktemp("adapters")
    paths = {name: str(write_adapter(chat_llama_dir, folder / name, seed)) for name, seed in (("sql", 1), ("chat", 2))}
    paths["too-big"] = str(write_adapter(chat_llama_dir, folder / "too-big", 3, rank=16))  # over max_lora_rank 8
    paths["other-base"] = str(write_adapter(chat_llama_dir, folder / "other-base", 4, hidden_size=32))
    oracle_engine = _engine(chat_llama_dir)
    chat_ids = oracle_engine.tokenizer.encode(
        render_conversation(oracle_engine.tokenizer, [ChatMessage(**m) for m in CHAT], None, None),
        add_special_tokens=False,
    )
    oracle = {}
    for name in ("base", "sql", "chat"):
        lora = None if name == "base" else LoRARequest(name, paths[name])
        oracle[name] = SimpleNamespace(
            completion=_direct(oracle_engine, PROMPT, lora),
            chat=_direct(oracle_engine, chat_ids, lora),
            chat_to_eos=_direct(oracle_engine, chat_ids, lora, ignore_eos=False),  # the Responses API has no ignore_eos
        )
    # each adapter changes the output, in both forms
    assert (
        len({tuple(o.completion.ids) for o in oracle.values()})
        == len({tuple(o.chat.ids) for o in oracle.values()})
        == 3
    )
    server = private_redis()
    try:
        with (
            worker_thread(
                _engine(chat_llama_dir),
                server.url,
                model=str(chat_llama_dir),
                lora_modules=(f"sql={paths['sql']}",),
                celery_broker=server.url,
                celery_poll_s=0.01,
            ) as worker,
            gateway_thread(server.url, allow_runtime_lora_updating=True) as base,
        ):
            wait_live(base)
            sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            yield SimpleNamespace(
                base=base, sdk=sdk, url=server.url, paths=paths, oracle=oracle, worker=worker, model=chat_llama_dir.name
            )
    finally:
        server.stop()


GREEDY = {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}
EXTRA = {"ignore_eos": True}  # vLLM's extra body field: every answer runs the full TOKENS


def test_native_clients_and_celery(stack, monkeypatch):
    client = Client(stack.url)
    sql, base = stack.oracle["sql"].completion.ids, stack.oracle["base"].completion.ids
    record = client.result(client.submit(PROMPT, lora="sql", **GREEDY), timeout=30)
    assert record.status == "completed" and record.token_ids == sql
    assert client.result(client.submit(PROMPT, **GREEDY), timeout=30).token_ids == base

    async def via_async() -> list[int]:
        async with AsyncClient(stack.url) as aclient:
            job_id = await aclient.submit(PROMPT, lora="sql", **GREEDY)
            return (await aclient.result(job_id, timeout=30)).token_ids

    assert asyncio.run(via_async()) == sql

    monkeypatch.setenv("PAGEDQ_REDIS_URL", stack.url)
    import pagedq.worker.celery.app as celery_app

    celery_app = importlib.reload(celery_app)  # the module's app reads its broker URL at import
    assert celery_app.generate.delay(prompt=PROMPT, lora="sql", **GREEDY).get(timeout=30)["token_ids"] == sql
    with pytest.raises(JobRejected, match="unknown LoRA adapter 'nobody'"):
        celery_app.generate.delay(prompt=PROMPT, lora="nobody", max_tokens=2).get(timeout=30)
    unknown = client.result(client.submit(PROMPT, lora="nobody", max_tokens=2), timeout=30)
    assert unknown.status == "rejected" and "unknown LoRA adapter 'nobody'" in (unknown.error or "")


def test_adapters_and_the_base_mixed_in_one_batch(stack):
    """The same prompt under the adapter and the base model, submitted together: the worker admits them into the
    same steps, and each equals its own oracle (the prefix cache, keyed by adapter, shares nothing across them)."""
    client = Client(stack.url)
    names = ["sql", None, "sql", None, "sql", None]
    job_ids = client.submit_many([{"prompt": PROMPT, "lora": name, **GREEDY} for name in names])
    for name, job_id in zip(names, job_ids):
        assert client.result(job_id, timeout=30).token_ids == stack.oracle[name or "base"].completion.ids


def test_bulk_lines(stack, tmp_path):
    """A plain line's `lora`, an OpenAI line's `model` naming the adapter, and the base model's id."""
    lines = [
        {"custom_id": "plain", "prompt": PROMPT, "lora": "sql", **GREEDY},
        {"custom_id": "openai", "body": {"model": "sql", "prompt": PROMPT, **GREEDY}},
        {"custom_id": "base", "body": {"model": stack.model, "prompt": PROMPT, **GREEDY}},
    ]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    counts = BulkRun(Redis.from_url(stack.url), source, out, progress=False).run()
    assert counts["completed"] == 3
    bodies = {row["custom_id"]: row["response"]["body"] for row in map(json.loads, out.read_text().splitlines())}
    assert bodies["plain"]["choices"][0]["text"] == stack.oracle["sql"].completion.text
    assert bodies["openai"]["choices"][0]["text"] == stack.oracle["sql"].completion.text
    assert bodies["openai"]["model"] == "sql"
    assert bodies["base"]["choices"][0]["text"] == stack.oracle["base"].completion.text


def test_openai_model_field_selects_the_adapter(stack):
    sdk, sql, base = stack.sdk, stack.oracle["sql"], stack.oracle["base"]
    listed = {m.id: m for m in sdk.models.list().data}
    assert listed["sql"].parent == stack.model and listed["sql"].root == stack.paths["sql"]
    assert listed[stack.model].parent is None
    assert sdk.models.retrieve("sql").parent == stack.model

    done = sdk.completions.create(model="sql", prompt=PROMPT, max_tokens=TOKENS, temperature=0, extra_body=EXTRA)
    assert done.model == "sql" and done.choices[0].text == sql.completion.text != base.completion.text
    plain = sdk.completions.create(model=stack.model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, extra_body=EXTRA)
    assert plain.choices[0].text == base.completion.text
    chunks = sdk.completions.create(
        model="sql", prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True, extra_body=EXTRA
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == sql.completion.text

    chat = sdk.chat.completions.create(model="sql", messages=CHAT, max_tokens=TOKENS, temperature=0, extra_body=EXTRA)
    assert chat.model == "sql" and chat.choices[0].message.content == sql.chat.text != base.chat.text
    streamed = sdk.chat.completions.create(
        model="sql", messages=CHAT, max_tokens=TOKENS, temperature=0, stream=True, extra_body=EXTRA
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == sql.chat.text
    response = sdk.responses.create(
        model="sql", input=CHAT[0]["content"], max_output_tokens=TOKENS, temperature=0, store=False
    )
    assert response.model == "sql" and response.output_text == sql.chat_to_eos.text

    # /tokenize names an adapter like a request does: its base model's tokenizer
    root = stack.base.removesuffix("/v1")
    by_adapter = httpx.post(root + "/tokenize", json={"model": "sql", "prompt": PROMPT}, timeout=30).json()
    by_base = httpx.post(root + "/tokenize", json={"model": stack.model, "prompt": PROMPT}, timeout=30).json()
    assert by_adapter == by_base and by_adapter["count"] == len(stack.worker.engine.tokenizer.encode(PROMPT))

    with pytest.raises(openai.NotFoundError) as caught:
        sdk.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    assert "sql" in caught.value.message  # the served names are listed


def test_batch_lines_name_the_adapter(stack):
    sdk = stack.sdk
    lines = [
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": PROMPT, **GREEDY},
        }
        for cid, model in (("a", "sql"), ("b", stack.model))
    ]
    upload = sdk.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_for(lambda: (b := sdk.batches.retrieve(batch.id)).status == "completed" and b, timeout=60, interval=0.1)
    bodies = {
        row["custom_id"]: row["response"]["body"]
        for row in map(json.loads, sdk.files.content(done.output_file_id).text.splitlines())
    }
    assert bodies["a"]["model"] == "sql" and bodies["a"]["choices"][0]["text"] == stack.oracle["sql"].completion.text
    assert bodies["b"]["choices"][0]["text"] == stack.oracle["base"].completion.text


def _post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.base + path, json=body, timeout=10)


def test_load_and_unload_through_the_gateway_reach_the_worker(stack):
    sdk, chat = stack.sdk, stack.oracle["chat"]
    loaded = _post(stack, "/load_lora_adapter", {"lora_name": "chat", "lora_path": stack.paths["chat"]})
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    again = _post(stack, "/load_lora_adapter", {"lora_name": "chat", "lora_path": stack.paths["chat"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    relative = _post(stack, "/load_lora_adapter", {"lora_name": "rel", "lora_path": "adapters/rel"})
    assert relative.status_code == 400 and relative.json()["error"]["param"] == "lora_path"
    assert {m.id: m.parent for m in sdk.models.list().data}["chat"] == stack.model

    done = sdk.completions.create(model="chat", prompt=PROMPT, max_tokens=TOKENS, temperature=0, extra_body=EXTRA)
    assert done.choices[0].text == chat.completion.text
    assert "chat" in {lora.name for lora in stack.worker.engine.list_loras()}

    unloaded = _post(stack, "/unload_lora_adapter", {"lora_name": "chat"})
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    assert "chat" not in {m.id for m in sdk.models.list().data}
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="chat", prompt=PROMPT, max_tokens=2)
    wait_for(
        lambda: "chat" not in {lora.name for lora in stack.worker.engine.list_loras()},
        timeout=10,
        what="the worker to unload the adapter",
    )
    assert _post(stack, "/unload_lora_adapter", {"lora_name": "chat"}).status_code == 404
    assert _post(stack, "/unload_lora_adapter", {"lora_name": "sql"}).status_code == 400  # a worker's own module


def test_a_bad_adapter_is_the_requests_error_and_the_worker_keeps_serving(stack, tmp_path):
    sdk = stack.sdk
    for name, path, problem in (
        ("too-big", stack.paths["too-big"], "rank"),
        ("other-base", stack.paths["other-base"], "an adapter of another base model"),
        ("missing", str(tmp_path / "nothing-here"), "no such folder"),
    ):
        assert _post(stack, "/load_lora_adapter", {"lora_name": name, "lora_path": path}).status_code == 200
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.completions.create(model=name, prompt=PROMPT, max_tokens=2)
        assert f"LoRA adapter {name!r}" in caught.value.message and problem in caught.value.message
        assert _post(stack, "/unload_lora_adapter", {"lora_name": name}).status_code == 200
    done = sdk.completions.create(model="sql", prompt=PROMPT, max_tokens=TOKENS, temperature=0, extra_body=EXTRA)
    assert done.choices[0].text == stack.oracle["sql"].completion.text
