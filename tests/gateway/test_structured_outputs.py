"""Structured outputs through the openai SDK, a real gateway, Redis and worker: response_format (json_object,
json_schema), vLLM's structured_outputs in extra_body, tools with tool_choice "required" or a named function
(tool_calls in OpenAI's shape, streamed too), and every bad constraint a 400 naming it. Oracles: json + jsonschema
on the outputs, the SDK's own parsing of the responses and chunks."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import openai
import pytest

from engine import LLMEngine
from worker.ops.embedded_redis import EmbeddedRedis

from .conftest import REDIS_SERVERS, gateway_thread, wait_live, worker_thread

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 20}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius? Answer with JSON."}]


@pytest.fixture(scope="module")
def served(request):
    """Redis, one worker and a gateway on the model the test module asks for."""
    model_dir = request.getfixturevalue(request.param)
    binary = REDIS_SERVERS.get("redis-system") or next(iter(REDIS_SERVERS.values()))
    server = EmbeddedRedis(binary=binary, extra_args=("--save", "", "--appendonly", "no")).start()
    engine = LLMEngine(str(model_dir), device="cpu", num_kv_blocks=256)
    try:
        with worker_thread(engine, server.url), gateway_thread(server.url) as base:
            wait_live(base)
            sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            yield SimpleNamespace(sdk=sdk, model=sdk.models.list().data[0].id)
    finally:
        server.stop()


@pytest.mark.parametrize("served", ["chat_llama_dir"], indirect=True)
@pytest.mark.parametrize(
    "extra, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}},
            "uniqueItems",
        ),
        ({"extra_body": {"structured_outputs": {"choice": []}}}, "choice must be a non-empty list"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "grammar": "b"}}}, "exactly one of"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
            "give only one",
        ),
        ({"tools": TOOLS}, 'tool_choice "auto" needs a model-specific tool-call parser'),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"extra_body": {"structured_outputs": {"regex": "([a-z"}}}, "regex does not compile"),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(served, extra, words):
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
        served.sdk.chat.completions.create(model=served.model, messages=ASK, max_tokens=8, **extra)


@pytest.mark.parametrize("served", ["chat_llama_dir"], indirect=True)
def test_completions_take_structured_outputs_and_tool_choice_none_is_unconstrained(served):
    out = served.sdk.completions.create(
        model=served.model,
        prompt="The quick brown fox",
        max_tokens=12,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert out.choices[0].text in ("red", "green", "blue") and out.choices[0].finish_reason == "stop"
    plain = served.sdk.chat.completions.create(
        model=served.model, messages=ASK, max_tokens=4, tools=TOOLS, tool_choice="none", temperature=0.0
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content is not None


@pytest.mark.slow  # SmolLM2
@pytest.mark.parametrize("served", ["demo_model_dir"], indirect=True)
def test_smollm2_response_formats_and_tool_calls_through_the_sdk(served):
    sdk, model = served.sdk, served.model
    schema = {"name": "weather", "schema": WEATHER, "strict": True}
    out = sdk.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=60,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": schema},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), WEATHER)
    short = "Give the city and the unit of: 'Paris, celsius' as a JSON object with keys city and unit."
    obj = sdk.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": short}],
        max_tokens=80,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert set(json.loads(obj.choices[0].message.content)) == {"city", "unit"}

    named = {"type": "function", "function": {"name": "get_weather"}}
    called = sdk.chat.completions.create(model=model, messages=ASK, max_tokens=60, tools=TOOLS, tool_choice=named)
    (call,) = called.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert called.choices[0].message.content is None

    required = sdk.chat.completions.create(
        model=model, messages=ASK, max_tokens=120, tools=TOOLS, tool_choice="required", temperature=0.0
    )
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        parameters = TOOLS[0 if c.function.name == "get_weather" else 1]["function"]["parameters"]
        jsonschema.validate(json.loads(c.function.arguments), parameters)

    for choice in (named, "required"):
        chunks = list(
            sdk.chat.completions.create(
                model=model, messages=ASK, max_tokens=120, tools=TOOLS, tool_choice=choice, temperature=0.0, stream=True
            )
        )
        pieces = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])] if chunks else []
        assert pieces and pieces[0].id and pieces[0].function.name
        arguments = "".join(p.function.arguments or "" for p in pieces if p.index == 0)
        jsonschema.validate(json.loads(arguments), parameters if pieces[0].function.name == "get_time" else WEATHER)
        assert chunks[-1].choices[0].finish_reason == "stop"
