"""Forced tool calls as agent loops read them, through the openai SDK, a real gateway, Redis and worker:
finish_reason "tool_calls" for a required list (and a call the model chose), "stop" for a named function (OpenAI's
and vLLM's), and a required list that a model keeps repeating: bounded by the grammar, each call once, and on a
cut by max_tokens its complete calls with finish_reason "length", never the internal JSON as content; streamed the
same way. A scripted engine writes the answers exactly (a repeating model, a cut); the tiny checkpoint runs the
real grammar (the bound, a tool whose parameters use $defs)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from types import SimpleNamespace

import jsonschema
import openai
import pytest

from pagedq.engine import LLMEngine
from pagedq.worker.testing.stub_engine import EOS_ID, FIRST_TEXT_ID, StubEngine, StubTokenizer

from ..worker.helpers import worker_thread
from .conftest import gateway_thread, private_redis, wait_live

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
NOW = [{"type": "function", "function": {"name": "now", "parameters": ZONE}}]
HI = [{"role": "user", "content": "What time is it?"}]
LONG = 500  # max_tokens: far more than the calls of a bounded list take
CALL = '{"name": "now", "parameters": {"zone": "utc"}}'
OTHER = '{"name": "now", "parameters": {"zone": "cet"}}'


class ByteTokenizer(StubTokenizer):
    """The stub's tokenizer, decoding its tokens back to the bytes they encode (JSON survives the round trip)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t - FIRST_TEXT_ID for t in ids if t >= FIRST_TEXT_ID).decode("utf-8", "replace")

    def get_chat_template(self, tools: list | None = None) -> str | None:
        return self.chat_template  # one template, without tools: the worker renders them in the Hermes form


class ScriptedEngine(StubEngine):
    """Answers every request with `script`, a character a token, then EOS (or max_tokens cuts it first). It
    enforces no grammar: it stands for a model whose constrained output is exactly this."""

    def __init__(self) -> None:
        super().__init__(chat_template=TEMPLATE)
        self.tokenizer = ByteTokenizer(TEMPLATE)
        self.script = b""

    def _next_token(self, req) -> int:
        pos = len(req.generated)
        return FIRST_TEXT_ID + self.script[pos] if pos < len(self.script) else EOS_ID


@pytest.fixture(scope="module")
def scripted() -> Iterator[SimpleNamespace]:
    server, engine = private_redis(), ScriptedEngine()
    try:
        with worker_thread(engine, server.url, model="stub"), gateway_thread(server.url) as base:
            wait_live(base)
            sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            yield SimpleNamespace(sdk=sdk, engine=engine)
    finally:
        server.stop()


def _answer(served: SimpleNamespace, script: str, **body) -> tuple[object, list]:
    """The answer to `script` whole, and streamed (its chunks; the status checked before the first byte)."""
    served.engine.script = script.encode()
    request = {"model": "stub", "messages": HI, "tools": NOW, "temperature": 0.0, "max_tokens": 400, **body}
    whole = served.sdk.chat.completions.create(**request)
    with served.sdk.chat.completions.with_streaming_response.create(**request, stream=True) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        chunks = list(response.parse())
    return whole, chunks


def _streamed_calls(chunks: list) -> list[tuple[str, str]]:
    """(name, arguments) of each streamed call, put together by index as the SDK's users do."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name, arguments = calls.setdefault(piece.index, ["", ""])
            calls[piece.index] = [name + (piece.function.name or ""), arguments + (piece.function.arguments or "")]
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))]


def _content(chunks: list) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_required_call_finishes_with_tool_calls_a_named_one_with_stop(scripted):
    required, chunks = _answer(scripted, f"[{CALL}]", tool_choice="required")
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("now", {"zone": "utc"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and _content(chunks) == ""
    assert [(name, json.loads(arguments)) for name, arguments in _streamed_calls(chunks)] == [("now", {"zone": "utc"})]

    named, chunks = _answer(scripted, '{"zone": "utc"}', tool_choice={"type": "function", "function": {"name": "now"}})
    assert named.choices[0].finish_reason == "stop" and named.choices[0].message.tool_calls[0].function.name == "now"
    assert chunks[-1].choices[0].finish_reason == "stop"

    chosen = f"<tool_call>\n{json.dumps({'name': 'now', 'arguments': {'zone': 'utc'}})}\n</tool_call>"
    auto, chunks = _answer(scripted, chosen)  # tool_choice auto, the default with tools
    (called,) = auto.choices[0].message.tool_calls
    assert auto.choices[0].finish_reason == "tool_calls" and called.function.name == "now"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_repeating_model_cut_by_max_tokens_gives_its_complete_calls_once(scripted):
    # what a small model writes under the unbounded list: the same call again and again until max_tokens cuts it
    script = f"[{CALL}, {CALL}, {OTHER}, {CALL}, " + '{"name": "n'
    cut, chunks = _answer(scripted, script + 'ow", "parameters": {}}]', tool_choice="required", max_tokens=len(script))
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and cut.usage.completion_tokens == len(script)
    assert choice.message.content is None  # never the internal list, cut or whole
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("now", {"zone": "utc"}), ("now", {"zone": "cet"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    # streamed: each call in its own tool_calls delta once complete, numbered 0, 1; no content; "length" at the end
    assert [(name, json.loads(arguments)) for name, arguments in _streamed_calls(chunks)] == calls
    assert _content(chunks) == "" and chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.tool_calls) == 2

    # cut before any call is complete: no calls, empty content, "length"
    nothing, chunks = _answer(scripted, script, tool_choice="required", max_tokens=10)
    assert nothing.choices[0].message.tool_calls is None and nothing.choices[0].message.content == ""
    assert nothing.choices[0].finish_reason == "length"
    assert _streamed_calls(chunks) == [] and _content(chunks) == "" and chunks[-1].choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------- the real grammar
@pytest.fixture(scope="module")
def grammar(chat_llama_dir, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """The tiny checkpoint behind a gateway that bounds a required list at 2 calls. Its context is widened (random
    weights either way): the tools' description in the prompt takes most of the 512 positions it has."""
    folder = tmp_path_factory.mktemp("wide-llama")
    for item in chat_llama_dir.iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    server = private_redis()
    engine = LLMEngine(str(folder), device="cpu", num_kv_blocks=256)
    try:
        with worker_thread(engine, server.url), gateway_thread(server.url, max_tool_calls=2) as base:
            wait_live(base)
            sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            yield SimpleNamespace(sdk=sdk, model=sdk.models.list().data[0].id, engine=engine)
    finally:
        server.stop()


def test_the_grammar_bounds_a_required_list(grammar):
    tokenizer = grammar.engine.tokenizer
    # the model may not close the list by itself: without a bound it repeats the one possible call until max_tokens
    closing = {str(t): -100 for t in range(tokenizer.vocab_size) if "]" in tokenizer.decode([t])}
    assert 0 < len(closing) <= 300
    for parallel, most in ((None, 2), (False, 1)):
        out = grammar.sdk.chat.completions.create(
            model=grammar.model,
            messages=HI,
            tools=NOW,
            tool_choice="required",
            max_tokens=LONG,
            temperature=0.0,
            logit_bias=closing,
            **({} if parallel is None else {"parallel_tool_calls": parallel}),
        )
        # closed by the grammar alone, once the list held `most` calls (each of them the one call possible)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and out.usage.completion_tokens < LONG, (parallel, out.usage)
        (call,) = choice.message.tool_calls  # the list's repeats come back once
        assert call.function.name == "now" and json.loads(call.function.arguments) == {"zone": "utc"}
        compact = json.dumps(json.loads(CALL), separators=(",", ":"))  # a call's fewest characters
        assert out.usage.completion_tokens >= most * len(tokenizer.encode(compact, add_special_tokens=False))


def test_a_required_tool_with_defs_and_recursion_is_served(grammar):
    tree = {
        "type": "object",
        "properties": {
            "unit": {"$ref": "#/$defs/unit"},
            "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
        },
        "required": ["unit"],
        "additionalProperties": False,
        "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
    }
    tools = [*NOW, {"type": "function", "function": {"name": "measure", "parameters": tree}}]
    out = grammar.sdk.chat.completions.create(
        model=grammar.model, messages=HI, tools=tools, tool_choice="required", max_tokens=200, temperature=0.0
    )
    calls = out.choices[0].message.tool_calls
    assert calls and out.choices[0].finish_reason == "tool_calls", out.choices[0]
    for call in calls:  # each call's arguments match its own parameters, their $defs and "#" as the client meant
        schema = tree if call.function.name == "measure" else ZONE
        jsonschema.validate(json.loads(call.function.arguments), schema)
