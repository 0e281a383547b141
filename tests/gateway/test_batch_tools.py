"""Tools through the Batch API and `pagedq bulk`, against a real Redis, worker and gateway on the tiny model: a chat
line with tool_choice named / required / auto and a conversation with tool_calls and a tool message answers as the
chat endpoint does. Oracles: the same body through /v1/chat/completions (greedy: the same tool calls and content),
json + jsonschema on the arguments, the gateway's own job for the body (same job fields), and for /tokenize the
prompt the worker renders for that job (protocol/chat.py) and the endpoint's usage.prompt_tokens."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from pagedq.worker.bulk.lines import read_request
from pagedq.worker.bulk.run import BulkRun
from pagedq.worker.client.core import make_job
from pagedq.worker.protocol.connection import connect

from .conftest import served_model, wait_for

# Small tools (the tiny model's context is 512 tokens) with bounded arguments, so forced calls finish
CITY = {"type": "object", "properties": {"u": {"enum": ["c", "f"]}}, "required": ["u"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "w", "parameters": CITY}}]
NOW = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {"z": {}}}}}]
# a Hermes call forced by a regex, so the random model "decides" to call under tool_choice auto
FORCED_CALL = '<tool_call>\n\\{"name": "now", "arguments": \\{"z": "[a-z]{1,4}"\\}\\}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather?"}]
CALLED = {"id": "call_7", "type": "function", "function": {"name": "w", "arguments": '{"u": "c"}'}}
HISTORY = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [CALLED]},
    {"role": "tool", "tool_call_id": "call_7", "content": "12:00"},
]
NAMED = {"type": "function", "function": {"name": "w"}}
BODIES = {
    "named": {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 40},
    "required": {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 50,
    },
    "auto": {"messages": ASK, "tools": NOW, "structured_outputs": {"regex": FORCED_CALL}, "max_tokens": 90},
    # tool_choice none: the tools are not rendered (the tiny model's context), the history is (the Hermes form)
    "history": {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none", "max_tokens": 12},
}
BAD = {
    **BODIES["history"],
    "messages": [ASK[0], {**HISTORY[1], "tool_calls": [{**CALLED, "function": {"name": "w", "arguments": "{u"}}]}],
}


def _line(custom_id: str, body: dict) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "any", "temperature": 0.0, **body},
        }
    )


class _Killed(BulkRun):
    def _collect(self) -> int:
        raise KeyboardInterrupt


@pytest.fixture(scope="module")
def served(chat_llama_dir):
    with served_model(chat_llama_dir) as stack:
        yield stack


def _endpoint(served, body: dict) -> dict:
    """The chat endpoint's answer to the body (greedy), as JSON."""
    known = {k: v for k, v in body.items() if k != "structured_outputs"}
    extra = {"structured_outputs": body["structured_outputs"]} if "structured_outputs" in body else None
    out = served.sdk.chat.completions.create(model=served.model, temperature=0.0, extra_body=extra, **known)
    return out.model_dump()


def _answer(body: dict) -> tuple:
    """What must match between front doors: the calls' names and arguments, the content and the finish reason."""
    (choice,) = body["choices"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]
    return calls, choice["message"]["content"], choice["finish_reason"]


@pytest.fixture(scope="module")
def bodies(chat_llama_dir) -> dict[str, dict]:
    """BODIES, the forced calls biased away from whitespace: the random model would pad the JSON (as the grammar
    allows) past the few tokens the tiny context leaves."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_llama_dir))
    blank = {str(i): -100 for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()}
    blank.pop(str(tokenizer.eos_token_id), None)
    return {
        name: {**body, "logit_bias": blank} if name in ("named", "required") else body for name, body in BODIES.items()
    }


def test_batch_and_bulk_lines_with_tools_answer_as_the_chat_endpoint(served, bodies, tmp_path):
    expected = {name: _endpoint(served, body) for name, body in bodies.items()}
    content = "\n".join([*(_line(name, body) for name, body in bodies.items()), _line("bad", BAD)]) + "\n"
    sdk = served.sdk
    upload = sdk.files.create(file=("tools.jsonl", content.encode()), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(content)
    with pytest.raises(KeyboardInterrupt):  # killed once its jobs are enqueued (what SIGTERM does to the CLI)
        _Killed(connect(served.url), inp, out, progress=False).run()
    # the rerun awaits them: what their answers are parsed for comes again from the lines, re-read
    counts = BulkRun(connect(served.url), inp, out, progress=False, poll_s=0.02).run()
    done = wait_for(
        lambda: (b := sdk.batches.retrieve(batch.id)).status == "completed" and b,
        timeout=60,
        interval=0.1,
        what="batch",
    )
    batch_lines = {
        line["custom_id"]: line for line in map(json.loads, sdk.files.content(done.output_file_id).text.splitlines())
    }
    (batch_error,) = [json.loads(x) for x in sdk.files.content(done.error_file_id).text.splitlines()]
    bulk_lines = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    (bulk_error,) = [json.loads(x) for x in out.with_suffix(".errors.jsonl").read_text().splitlines()]
    assert counts["completed"] == counts["awaited"] == len(bodies) and counts["enqueued"] == 0
    assert counts["errors"] == 0 and counts["skipped"] == 1  # the bad line: answered before the kill
    for name, want in expected.items():
        for got in (batch_lines[name], bulk_lines[name]):
            body = got["response"]["body"]
            assert _answer(body) == _answer(want), name
            calls = body["choices"][0]["message"].get("tool_calls") or []
            assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    # OpenAI's and vLLM's finish_reason: a named call keeps the engine's "stop", a required list is "tool_calls"
    for name, finish in (("named", "stop"), ("required", "tool_calls")):
        calls, content_, reason = _answer(expected[name])
        assert calls and content_ is None and reason == finish, (
            name,
            expected[name]["choices"][0]["message"]["content"],
        )
        for _, arguments in calls:
            jsonschema.validate(json.loads(arguments), CITY)
    assert _answer(expected["history"])[0] == [] and _answer(expected["history"])[1]  # plain content
    calls, _, reason = _answer(expected["auto"])
    assert reason == "tool_calls" and calls[0][0] == "now"  # OpenAI's finish_reason for a call the model chose
    for error in (batch_error, bulk_error):
        assert error["custom_id"] == "bad" and error["error"]["code"] == "invalid_request"
        assert "messages.1.tool_calls.function.arguments" in error["error"]["message"]


def test_a_line_makes_the_job_the_chat_endpoint_makes():
    from pagedq.worker.gateway.chat import ChatEndpoint
    from pagedq.worker.gateway.schemas import ChatCompletionRequest
    from pagedq.worker.gateway.settings import GatewaySettings

    settings = GatewaySettings()
    for name, body in {**BODIES, "none": {**BODIES["named"], "tool_choice": "none"}}.items():
        endpoint = ChatEndpoint(ChatCompletionRequest(model="m", **body), "m", 0)
        (fields,) = endpoint.jobs_fields(settings)
        gateway_job = make_job(job_id="g", **fields)
        request = read_request(_line(name, body))
        line_job = make_job(job_id="l", **request.fields)
        for field in ("messages", "tools", "tool_call_parser", "structured_outputs", "max_tokens"):
            assert getattr(line_job, field) == getattr(gateway_job, field), (name, field)
        assert request.tools == endpoint.spec, name  # the answer is parsed for the same calls


@pytest.mark.parametrize("name", ["history", "named"])
def test_tokenize_renders_messages_and_tools_as_the_chat_job(served, chat_llama_dir, name):
    from transformers import AutoTokenizer

    from pagedq.worker.service.engine_input import engine_prompt

    body = BODIES[name]
    request = {"model": served.model, "messages": body["messages"]}
    if body.get("tool_choice") != "none":
        request["tools"] = body["tools"]  # rendered with the messages, as a chat job's (none: not rendered)
    got = httpx.post(served.base.removesuffix("/v1") + "/tokenize", json=request, timeout=30)
    assert got.status_code == 200, got.text
    tokens = got.json()["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(str(chat_llama_dir))
    job = make_job(job_id="t", **read_request(_line("t", body)).fields)
    assert tokens == engine_prompt(SimpleNamespace(tokenizer=tokenizer), job)  # the prompt the worker runs
    # the Hermes form (this template knows no tools): the tools in the system turn, the results in a user turn
    assert ("<tool_response>" if name == "history" else "<tools>") in tokenizer.decode(tokens)
    assert len(tokens) == _endpoint(served, body)["usage"]["prompt_tokens"]
