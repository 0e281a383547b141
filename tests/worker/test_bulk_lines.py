"""The batch line format (pagedq/worker/bulk/lines.py): every job field a line may set reaches the job."""

from __future__ import annotations

import json
import re

import pytest

from pagedq.worker.bulk.lines import LineError, parse_request
from pagedq.worker.client.core import make_job
from pagedq.worker.protocol.errors import JobRejected


def _openai_line(**body: object) -> str:
    request = {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", **body}}
    return json.dumps(request)


def test_penalties_and_min_tokens_of_an_openai_body_reach_the_job() -> None:
    line = _openai_line(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1, min_tokens=2)
    custom_id, fields, kind, model = parse_request(line)
    job = make_job(job_id="j1", **fields)
    assert (custom_id, kind, model) == ("c1", "completion", None)
    assert (job.presence_penalty, job.frequency_penalty, job.repetition_penalty, job.min_tokens) == (0.5, 0.25, 1.1, 2)


def test_a_bodys_priority_is_vllms_and_a_plain_lines_the_jobs() -> None:
    """An OpenAI body's priority means what it means at the gateway (lower is sooner); a plain line's is the job
    field (higher is sooner): both lines below ask for the same service order."""
    _, body_fields, _, _ = parse_request(_openai_line(priority=-5))
    _, plain_fields, _, _ = parse_request(json.dumps({"custom_id": "p", "prompt": "hi", "priority": 5}))
    body_job, plain_job = make_job(job_id="j1", **body_fields), make_job(job_id="j2", **plain_fields)
    assert body_job.priority == plain_job.priority == 5 and body_job.vllm_priority == -5
    with pytest.raises(JobRejected, match="priority"):
        make_job(job_id="j3", **parse_request(_openai_line(priority="high"))[1])


def test_a_plain_line_takes_the_same_fields() -> None:
    _, fields, _, _ = parse_request(json.dumps({"custom_id": "p", "prompt": "hi", "frequency_penalty": 1.0}))
    assert make_job(job_id="j2", **fields).frequency_penalty == 1.0


@pytest.mark.parametrize("line", [_openai_line(n=2), json.dumps({"custom_id": "p", "prompt": "hi", "n": 2})])
def test_n_above_one_is_refused_on_either_form(line: str) -> None:
    with pytest.raises(LineError) as caught:
        parse_request(line)
    assert caught.value.code == "invalid_request"


@pytest.mark.parametrize(
    "line",
    [
        _openai_line(logit_bias={"28": 100, "5": -100}, best_of=3, include_stop_str_in_output=True),
        json.dumps(
            {
                "custom_id": "p",
                "prompt": "hi",
                "logit_bias": {"28": 100, "5": -100},
                "best_of": 3,
                "include_stop_str_in_output": True,
            }
        ),
    ],
)
def test_logit_bias_and_best_of_reach_the_job_on_either_form(line: str) -> None:
    _, fields, _, _ = parse_request(line)
    params = make_job(job_id="j3", **fields).to_sampling_params()
    assert (params.logit_bias, params.best_of, params.n) == ({28: 100.0, 5: -100.0}, 3, 1)
    assert params.include_stop_str_in_output


def test_a_logit_bias_out_of_bounds_is_refused() -> None:
    from pagedq.worker.protocol.errors import JobRejected

    _, fields, _, _ = parse_request(_openai_line(logit_bias={"28": 101}))
    with pytest.raises(JobRejected, match="logit_bias"):
        make_job(job_id="j4", **fields)


SCHEMA = {"type": "object", "properties": {"total": {"type": "number"}}, "required": ["total"]}


@pytest.mark.parametrize(
    "line, expected",
    [
        (_openai_line(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}), SCHEMA),
        (_openai_line(response_format={"type": "json_object"}), True),
        (_openai_line(structured_outputs={"json": SCHEMA}), SCHEMA),
        (json.dumps({"custom_id": "p", "prompt": "hi", "structured_outputs": {"json": SCHEMA}}), SCHEMA),
    ],
)
def test_structured_outputs_and_response_format_reach_the_job(line: str, expected: object) -> None:
    _, fields, _, _ = parse_request(line)
    job = make_job(job_id="j4", **fields)
    assert job.structured_outputs == ({"json_object": True} if expected is True else {"json": expected})
    assert job.to_sampling_params().structured_outputs is not None


def test_a_bad_constraint_on_a_line_is_refused_naming_it() -> None:
    with pytest.raises(LineError, match="each constrain the output"):
        parse_request(_openai_line(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}))
    with pytest.raises(LineError, match="json_schema with a schema"):
        parse_request(_openai_line(response_format={"type": "json_schema", "json_schema": {"name": "t"}}))
    _, fields, _, _ = parse_request(_openai_line(structured_outputs={"choice": []}))
    with pytest.raises(JobRejected, match="choice must be a non-empty list"):
        make_job(job_id="j5", **fields)


# ---------------------------------------------------------------------------------------------- tools
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
CALLED = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
HISTORY = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": CALLED, "refusal": None},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def _chat_line(**body: object) -> str:
    request = {"custom_id": "t", "url": "/v1/chat/completions", "body": {"model": "m", "messages": HISTORY, **body}}
    return json.dumps(request)


def test_a_chat_line_with_tools_becomes_the_job_the_chat_endpoint_makes() -> None:
    from pagedq.worker.bulk.lines import read_request

    named = read_request(_chat_line(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.tools is not None and (named.tools.mode, named.tools.named) == ("named", "get_weather")
    assert named.fields["structured_outputs"] == {"json": WEATHER} and named.fields["tools"] == TOOLS
    job = make_job(job_id="t1", **named.fields)
    assert job.messages[0].content == "Weather in Paris?" and job.tool_call_parser is None
    assert job.messages[1].tool_calls[0].function.arguments == {"city": "Paris"}  # JSON text -> the object
    required = read_request(_chat_line(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)).fields
    schema = required["structured_outputs"]["json"]
    assert schema["maxItems"] == 1 and [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]
    auto = read_request(_chat_line(tools=TOOLS))  # OpenAI's default with tools: auto
    assert auto.tools is not None and auto.tools.mode == "auto" and auto.tools.names == ("get_weather", "get_time")
    assert auto.fields["tool_call_parser"] == "hermes" and "structured_outputs" not in auto.fields
    none = read_request(_chat_line(tools=TOOLS, tool_choice="none"))
    assert none.tools is None and "tools" not in none.fields and make_job(job_id="t2", **none.fields).tools is None


@pytest.mark.parametrize(
    "body, words",
    [
        (
            {
                "messages": [
                    HISTORY[0],
                    {**HISTORY[1], "tool_calls": [{**CALLED[0], "function": {"name": "f", "arguments": "[1]"}}]},
                ]
            },
            "messages.1.tool_calls.function.arguments: a call's arguments must be a JSON object",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format and tool_choice each constrain",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not in tools",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content: only text parts"),
    ],
)
def test_bad_tools_on_a_line_are_refused_naming_the_field(body: dict, words: str) -> None:
    with pytest.raises(LineError, match=re.escape(words)) as caught:
        parse_request(_chat_line(**body))
    assert caught.value.code == "invalid_request"


def test_the_output_line_carries_tool_calls_as_the_chat_endpoint_gives_them() -> None:
    from pagedq.worker.bulk.lines import output_line
    from pagedq.worker.protocol.tool_calls import ToolSpec

    def choice(spec: ToolSpec | None, text: str, reason: str = "stop") -> dict:
        record = {"status": "completed", "text": text, "finish_reason": reason, "usage": {}}
        return output_line("c", "j", record, "chat", tools=spec)["response"]["body"]["choices"][0]

    named = choice(ToolSpec("named", ("get_weather",), "get_weather"), '{"city": "Paris"}')
    (call,) = named["message"]["tool_calls"]
    assert named["message"]["content"] is None and named["finish_reason"] == "stop" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["type"] == "function"
    required = choice(
        ToolSpec("required", ("get_weather",)), '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    )
    assert json.loads(required["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert required["finish_reason"] == "tool_calls"  # OpenAI's and vLLM's for a required call
    # cut by max_tokens: never the internal list as content; its complete calls, each once, and "length"
    cut = choice(ToolSpec("required", ("get_weather",)), '[{"name": "get_wea', "length")
    assert cut["message"] == {"role": "assistant", "content": ""} and cut["finish_reason"] == "length"
    oslo = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    repeated = choice(ToolSpec("required", ("get_weather",)), f'[{oslo}, {oslo}, {{"name": "get_w', "length")
    (once,) = repeated["message"]["tool_calls"]
    assert json.loads(once["function"]["arguments"]) == {"city": "Oslo"} and repeated["message"]["content"] is None
    assert repeated["finish_reason"] == "length"
    auto = choice(
        ToolSpec("auto", ("get_time",)), 'Let me see.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert auto["finish_reason"] == "tool_calls" and auto["message"]["content"] == "Let me see."
    assert auto["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    plain = choice(ToolSpec("auto", ("get_time",)), "No call.")
    assert plain["message"] == {"role": "assistant", "content": "No call."} and plain["finish_reason"] == "stop"


def test_a_required_list_is_bounded_as_the_run_is_told() -> None:
    from pagedq.worker.bulk.lines import read_request

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "required"}

    def most(max_tool_calls: int, **extra: object) -> int:
        line = json.dumps({"custom_id": "c", "url": "/v1/chat/completions", "body": {**body, **extra}})
        return read_request(line, max_tool_calls).fields["structured_outputs"]["json"]["maxItems"]

    assert most(3) == 3 and most(3, parallel_tool_calls=True) == 3 and most(3, parallel_tool_calls=False) == 1
