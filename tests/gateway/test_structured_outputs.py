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

from pagedq.worker.service.engine_input import engine_prompt

from .conftest import served_model

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
    with served_model(request.getfixturevalue(request.param)) as stack:
        yield stack


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
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "tool_call_id belongs to tool"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "every tool message needs one"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}],
                    }
                ]
            },
            "arguments must be a JSON object",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"extra_body": {"structured_outputs": {"regex": "([a-z"}}}, "regex does not compile"),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(served, extra, words):
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
        served.sdk.chat.completions.create(**{"model": served.model, "messages": ASK, "max_tokens": 8, **extra})


# One small tool (the tiny model's context is 512 tokens), and a Hermes call of it forced by a regex, so the tiny
# random model "decides" to call it under tool_choice auto.
NOW = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {"z": {}}}}}]
FORCED_CALL = '<tool_call>\n\\{"name": "now", "arguments": \\{"z": "[a-z]{1,4}"\\}\\}\n</tool_call>'
HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("served", ["chat_llama_dir"], indirect=True)
def test_tool_choice_auto_parses_calls_and_the_history_goes_back_through_the_sdk(served):
    sdk, model = served.sdk, served.model
    force = {"structured_outputs": {"regex": FORCED_CALL}}
    out = sdk.chat.completions.create(model=model, messages=HI, max_tokens=90, tools=NOW, extra_body=force)
    (choice,) = out.choices
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "now" and call.id.startswith("call_")
    assert re.fullmatch("[a-z]{1,4}", json.loads(call.function.arguments)["z"]) and choice.message.content is None
    chunks = list(
        sdk.chat.completions.create(
            model=model, messages=HI, max_tokens=90, tools=NOW, extra_body=force, stream=True, temperature=0.0
        )
    )
    pieces = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [p.function.name for p in pieces] == ["now"] and json.loads(pieces[0].function.arguments)["z"]
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)  # no call text leaks as content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the SDK's own message object and a tool result, sent back: accepted, and the answer is plain content
    history = [*HI, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    plain = sdk.chat.completions.create(model=model, messages=history, max_tokens=6, tools=NOW, temperature=0.0)
    assert plain.choices[0].message.tool_calls is None and isinstance(plain.choices[0].message.content, str)
    assert plain.choices[0].finish_reason in ("stop", "length") and plain.usage.prompt_tokens > 0


@pytest.mark.slow  # SmolLM2's tokenizer (its chat template knows no tools)
def test_tools_and_their_history_render_for_a_template_without_tools(demo_model_dir):
    from transformers import AutoTokenizer

    from pagedq.worker.gateway.schemas import ChatCompletionRequest
    from pagedq.worker.gateway.tools import conversation_fields, parse_calls
    from pagedq.worker.protocol.chat import hermes_turns
    from pagedq.worker.protocol.job import build_job

    called = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    body = ChatCompletionRequest(
        model="m",
        tools=TOOLS,
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [called]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        ],
    )
    job = build_job(**conversation_fields(body, "auto"))
    assert job.tool_call_parser == "hermes" and job.messages[1].tool_calls[0].function.arguments == {"zone": "utc"}
    turns = hermes_turns(job.messages, job.tools)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    listed = re.search(r"<tools>\n(.*)\n</tools>", turns[0]["content"], re.DOTALL)
    assert listed and [json.loads(line) for line in listed.group(1).splitlines()] == TOOLS
    assert parse_calls(turns[2]["content"], {"get_time"}) == (None, [("get_time", '{"zone": "utc"}')])
    assert turns[3]["content"] == "<tool_response>\n12:00\n</tool_response>"
    # SmolLM2's template knows no tools (a "tool" turn or content None would break it): the worker renders these
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>" in text and '"name": "get_weather"' in text
    assert engine_prompt(SimpleNamespace(tokenizer=tokenizer), job) == tokenizer.encode(text, add_special_tokens=False)


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
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.content is None
    for c in calls:
        parameters = TOOLS[0 if c.function.name == "get_weather" else 1]["function"]["parameters"]
        jsonschema.validate(json.loads(c.function.arguments), parameters)

    for choice, finish in ((named, "stop"), ("required", "tool_calls")):  # OpenAI's and vLLM's finish_reason
        chunks = list(
            sdk.chat.completions.create(
                model=model, messages=ASK, max_tokens=120, tools=TOOLS, tool_choice=choice, temperature=0.0, stream=True
            )
        )
        pieces = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])] if chunks else []
        assert pieces and pieces[0].id and pieces[0].function.name
        arguments = "".join(p.function.arguments or "" for p in pieces if p.index == 0)
        jsonschema.validate(json.loads(arguments), parameters if pieces[0].function.name == "get_time" else WEATHER)
        assert chunks[-1].choices[0].finish_reason == finish


def _with_template(tiny_llama_dir, tmp_path_factory, template: str):
    import shutil

    folder = tmp_path_factory.mktemp("tools-llama")
    for item in tiny_llama_dir.iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


@pytest.fixture(scope="module")
def hermes_tools_llama_dir(tiny_llama_dir, tmp_path_factory):
    from ..worker.test_chat_tools import HERMES_TOOLS_TEMPLATE

    return _with_template(tiny_llama_dir, tmp_path_factory, HERMES_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def own_format_llama_dir(tiny_llama_dir, tmp_path_factory):
    from ..worker.test_chat_tools import OWN_FORMAT_TEMPLATE

    return _with_template(tiny_llama_dir, tmp_path_factory, OWN_FORMAT_TEMPLATE)


@pytest.mark.parametrize("served", ["hermes_tools_llama_dir"], indirect=True)
def test_a_tools_template_gets_the_conversation_natively_through_the_sdk(served, hermes_tools_llama_dir):
    from transformers import AutoTokenizer

    sdk, model = served.sdk, served.model
    tokenizer = AutoTokenizer.from_pretrained(str(hermes_tools_llama_dir))
    force = {"structured_outputs": {"regex": FORCED_CALL}}
    first = sdk.chat.completions.create(model=model, messages=HI, max_tokens=90, tools=NOW, extra_body=force)
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "now"
    # the oracle: transformers renders the conversation with tools= on the same template; the worker's prompt is it
    expected = tokenizer.apply_chat_template(HI, tools=NOW, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in expected
    assert first.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
    history = [*HI, first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    arguments = json.loads(call.function.arguments)
    rendered = [
        *HI,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": {"name": "now", "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    expected = tokenizer.apply_chat_template(rendered, tools=NOW, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n12:00\n</tool_response>" in expected
    named = {"type": "function", "function": {"name": "now"}}
    for choice in ("auto", named, "required"):
        out = sdk.chat.completions.create(
            model=model, messages=history, max_tokens=20, tools=NOW, tool_choice=choice, temperature=0.0
        )
        assert out.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False)), choice
        if choice == named:
            (forced,) = out.choices[0].message.tool_calls
            assert forced.function.name == "now" and out.choices[0].message.content is None


@pytest.mark.parametrize("served", ["own_format_llama_dir"], indirect=True)
def test_auto_is_refused_where_the_template_writes_calls_its_own_way(served):
    with pytest.raises(openai.BadRequestError, match="not as Hermes <tool_call> blocks"):
        served.sdk.chat.completions.create(model=served.model, messages=HI, max_tokens=4, tools=NOW)
    named = {"type": "function", "function": {"name": "now"}}
    out = served.sdk.chat.completions.create(
        model=served.model, messages=HI, max_tokens=20, tools=NOW, tool_choice=named
    )
    assert out.choices[0].message.tool_calls[0].function.name == "now"
