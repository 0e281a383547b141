"""The README's snippets run for real, so the front page keeps working (issue 18).

Every ```python block of README.md is run as written, with only its placeholders swapped for real things: the
engine's on a tiny random-weight checkpoint (with a chat template), the clients' and Celery's against a private
redis-server with a stub-engine worker in a thread, the openai SDK's against `pagedq serve`'s app on uvicorn in a
thread. The bulk front door is a command: its `pagedq bulk` line runs through the real CLI (in this process) on the
README's JSONL lines. A placeholder that is not found fails the test (it would otherwise run against a default).
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import signal
from pathlib import Path
from typing import Any

import pytest

from pagedq.engine import LLMEngine
from pagedq.worker import Client
from pagedq.worker.testing.stub_engine import StubEngine
from tests.gateway import conftest as gateway_fixtures
from tests.gateway.conftest import gateway_thread, wait_live
from tests.gateway.lora_adapters import write_adapter
from tests.worker.helpers import offline, worker_thread

# The gateway tests' fixtures, used here too: one fresh redis-server per test, the tiny llama with a chat template.
redis_url = gateway_fixtures.redis_url
chat_llama_dir = gateway_fixtures.chat_llama_dir

README = Path(__file__).resolve().parent.parent / "README.md"
LORA = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}  # the engine's options for the README's adapter


def sql_adapter(base: Path, tmp_path: Path) -> Path:
    """The README's LoRA adapter "sql": a random-weight PEFT folder for `base`."""
    return write_adapter(base, tmp_path / "sql-adapter", seed=1)


REDIS_PLACEHOLDER = '"redis://localhost:6379/0"'

# Each ```python block holds exactly one of these lines; each has its test below.
SNIPPETS = {
    "engine": "from pagedq.engine import LLM, SamplingParams",
    "client": "from pagedq.worker import Client",
    "async_client": "from pagedq.worker import AsyncClient",
    "celery": "from pagedq.worker.celery.app import generate",
    "openai": "from openai import OpenAI",
}


def blocks(language: str) -> list[str]:
    """The README's fenced blocks of one language, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(), flags=re.MULTILINE | re.DOTALL)


def snippet(key: str) -> str:
    found = [block for block in blocks("python") if SNIPPETS[key] in block]
    assert len(found) == 1, f"{len(found)} README python blocks hold {SNIPPETS[key]!r}"
    return found[0]


def run(key: str, replacements: dict[str, str]) -> dict[str, Any]:
    """Run one snippet with its placeholders replaced; returns its namespace."""
    code = snippet(key)
    for placeholder, value in replacements.items():
        assert placeholder in code, f"the README's {key} snippet no longer holds {placeholder}"
        code = code.replace(placeholder, value)
    printed: list[str] = []  # what the snippet prints (the worker thread's logs go to stdout too)

    def capture(*args: object, sep: str = " ", end: str = "\n", **_: object) -> None:
        printed.append(sep.join(map(str, args)) + end)

    namespace: dict[str, Any] = {"__name__": f"readme_{key}", "print": capture}
    exec(compile(code, f"README.md ({key} snippet)", "exec"), namespace)
    namespace["printed"] = "".join(printed)
    return namespace


def test_every_python_snippet_is_run_by_a_test() -> None:
    python = blocks("python")
    assert python, "no ```python block found in README.md"
    for block in python:
        keys = [key for key, line in SNIPPETS.items() if line in block]
        assert len(keys) == 1, f"a README python block is not run by tests/test_readme.py:\n{block}"
    assert len(python) == len(SNIPPETS)


def test_engine_snippet(chat_llama_dir: Path) -> None:
    ns = run("engine", {'"path/to/hf_checkpoint"': repr(str(chat_llama_dir))})
    outs, chats = ns["outs"], ns["chats"]
    assert len(outs) == 2 and outs[1].prompt_token_ids == [1, 2, 3]
    assert ns["text"] == outs[0].outputs[0].text and 1 <= len(outs[0].outputs[0].token_ids) <= 32
    again = ns["llm"].generate("Hello", ns["SamplingParams"](max_tokens=32, temperature=0.0))
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids  # greedy: the same answer
    assert len(chats) == 1 and chats[0].outputs[0].finish_reason in ("stop", "length")
    assert ns["picked"] in ("yes", "no")  # the constraint holds even on random weights


def test_client_snippet(redis_url: str, tmp_path: Path) -> None:
    with worker_thread(StubEngine(), redis_url, lora_modules=(f"sql={tmp_path}",)):
        ns = run("client", {REDIS_PLACEHOLDER: repr(redis_url)})
        record = ns["record"]
        assert record.status == "completed" and record.text
        assert ns["printed"] == record.text  # the streamed deltas add up to the final text
        assert record.text == offline("What is the capital of France?", max_tokens=32, temperature=0.0)[0]
        assert record.metadata == {"user": 7}
        assert Client(redis_url).cancel(ns["job_id"]) is False  # what the snippet's cancel line returned
        invoice = Client(redis_url).result(ns["invoice"], timeout=60)  # the stub engine ignores the schema
        assert invoice.status == "completed"
        tuned = Client(redis_url).result(ns["tuned"], timeout=60)
        base = offline("Top customers, as SQL:", max_tokens=32, temperature=0.0)[0]  # the stub hashes the name in
        assert tuned.status == "completed" and tuned.text != base


def test_async_client_snippet(redis_url: str) -> None:
    with worker_thread(StubEngine(), redis_url):
        ns = run("async_client", {REDIS_PLACEHOLDER: repr(redis_url)})
    texts = ns["texts"]
    assert len(texts) == 2 and all(isinstance(t, str) and t for t in texts)


def test_celery_snippet(redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import pagedq.worker.celery.app as celery_app

    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "PAGEDQ_CELERY_QUEUE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PAGEDQ_REDIS_URL", redis_url)  # the snippet's comment: else PAGEDQ_REDIS_URL
    importlib.reload(celery_app)  # the module's app reads its broker URL at import
    try:
        adapter = (f"sql={tmp_path}",)
        with worker_thread(StubEngine(), redis_url, celery_broker=redis_url, celery_poll_s=0.01, lora_modules=adapter):
            ns = run("celery", {})
        record = ns["record"]
        assert record["status"] == "completed"
        assert record["text"] == offline("What is the capital of France?", max_tokens=32, temperature=0.0)[0]
        assert ns["tuned"]["status"] == "completed"
    finally:
        monkeypatch.undo()
        importlib.reload(celery_app)


def test_bulk_snippet(
    redis_url: str, chat_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from pagedq.worker.cli.main import main

    (requests,) = blocks("jsonl")
    commands = [line for block in blocks("bash") for line in block.splitlines() if line.startswith("pagedq bulk ")]
    assert len(commands) == 1, commands
    argv = shlex.split(commands[0], comments=True)
    assert argv[:2] == ["pagedq", "bulk"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / argv[2]).write_text(requests)
    previous = signal.getsignal(signal.SIGTERM)  # the command installs its own SIGTERM handler
    try:
        # the real engine (a tiny random checkpoint with a chat template): the tool line's forced call is a grammar;
        # q4 runs under a real PEFT adapter
        engine = LLMEngine(str(chat_llama_dir), device="cpu", num_kv_blocks=128, **LORA)
        with worker_thread(engine, redis_url, lora_modules=(f"sql={sql_adapter(chat_llama_dir, tmp_path)}",)):
            code = main([*argv[1:], "--redis", redis_url, "--no-progress"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 0
    (summary,) = [json.loads(s) for s in capsys.readouterr().out.splitlines() if s.startswith('{"run_id"')]
    assert summary["completed"] == 4 and summary["errors"] == 0, summary
    lines = {line["custom_id"]: line for line in map(json.loads, (tmp_path / argv[3]).read_text().splitlines())}
    assert sorted(lines) == ["q1", "q2", "q3", "q4"]
    assert lines["q4"]["response"]["body"]["model"] == "sql"
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in lines.values())
    (choice,) = lines["q3"]["response"]["body"]["choices"]
    # tool_choice "required": finish_reason "tool_calls" (OpenAI's and vLLM's), or "length" when the random model
    # spends its 64 tokens on the whitespace JSON allows; either way only complete calls come back, never the
    # internal call list as content
    calls = choice["message"].get("tool_calls") or []
    assert choice["finish_reason"] in ("tool_calls", "length"), choice
    assert calls or choice["finish_reason"] == "length", choice
    assert not choice["message"].get("content"), choice
    for call in calls:
        assert call["function"]["name"] == "set_unit" and isinstance(json.loads(call["function"]["arguments"]), dict)


def test_openai_snippet(redis_url: str, chat_llama_dir, tmp_path: Path) -> None:
    # real logprobs for the scoring request; a real PEFT adapter for the LoRA one
    engine = LLMEngine(str(chat_llama_dir), device="cpu", num_kv_blocks=64, **LORA)
    adapter = (f"sql={sql_adapter(chat_llama_dir, tmp_path)}",)
    with worker_thread(engine, redis_url, lora_modules=adapter), gateway_thread(redis_url) as base:
        wait_live(base)
        ns = run("openai", {'"http://127.0.0.1:8000/v1"': repr(base)})
    assert ns["answer_logprob"] < 0 and ns["scored"].choices[0].text == ns["context"] + ns["answer"]
    assert [c.index for c in ns["many"].choices] == [0, 1]
    r = ns["r"]
    assert r.choices[0].message.content and r.usage.completion_tokens >= 1
    out = ns["printed"]
    assert out.startswith(r.choices[0].message.content)
    assert "completion_tokens" in out  # the stream's last chunk: usage (stream_options.include_usage)
    assert json.loads(ns["arguments"])["unit"] in ("celsius", "fahrenheit")  # a forced tool call, valid
    assert ns["tuned"].model == "sql" and ns["tuned"].usage.completion_tokens >= 1
