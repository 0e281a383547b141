"""POST /v1/responses (OpenAI's Responses API, stateless) through the openai SDK, a real gateway, Redis and a worker
on the tiny checkpoint: plain input and instructions, a json_schema text.format (validated against its schema), a
function call round trip (function_call out, function_call_output in, then text), the typed events of
`responses.stream` and `create(stream=True)`, and what a stateless gateway refuses (400s naming the field).
Oracles: the SDK's own types and stream accumulator, jsonschema, and the chat endpoint's answer to the same request."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai import omit
from openai._streaming import SSEDecoder
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import (
    Response,
    ResponseErrorEvent,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseStreamEvent,
)
from pydantic import BaseModel, TypeAdapter

from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.responses import ResponsesEndpoint
from pagedq.worker.gateway.responses_request import ResponsesRequest
from pagedq.worker.protocol.job import Delta, FinalRecord

from .conftest import served_model

# no free-form strings: a random model's strings may hold raw control characters, which JSON refuses
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "label": {"enum": ["near", "far"]}},
    "required": ["x", "label"],
    "additionalProperties": False,
}
NOW = {  # one small tool: the tiny model's context is 512 tokens, and the Hermes form lists the tools in the prompt
    "type": "function",
    "name": "now",
    "parameters": {"type": "object", "properties": {"z": {"enum": ["utc", "cet"]}}, "required": ["z"]},
}


@pytest.fixture(scope="module")
def served(chat_llama_dir):
    with served_model(chat_llama_dir) as stack:
        yield stack


def test_plain_input_and_instructions_match_the_chat_endpoint(served):
    sdk, model = served.sdk, served.model
    out = sdk.responses.create(model=model, input="Hello there", max_output_tokens=6, temperature=0.0, store=False)
    assert isinstance(out, Response) and out.object == "response" and out.id.startswith("resp_")
    (message,) = out.output
    assert isinstance(message, ResponseOutputMessage) and message.role == "assistant"
    chat = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=6, temperature=0.0
    )
    # the same job as chat's: the same greedy text, the same token counts
    assert out.output_text == chat.choices[0].message.content
    assert out.usage is not None and chat.usage is not None
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    # 6 tokens of a random model: cut by max_output_tokens (or it stopped): status and details agree
    cut = chat.choices[0].finish_reason == "length"
    assert out.status == ("incomplete" if cut else "completed")
    assert (out.incomplete_details.reason if out.incomplete_details else None) == ("max_output_tokens" if cut else None)

    instructed = sdk.responses.create(
        model=model,
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
        max_output_tokens=6,
        temperature=0.0,
    )  # store left out: OpenAI's default (true) is accepted; nothing is stored
    chat = sdk.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0.0,
    )
    assert instructed.output_text == chat.choices[0].message.content and instructed.instructions == "Be brief."
    assert instructed.usage is not None and chat.usage is not None
    assert instructed.usage.input_tokens == chat.usage.prompt_tokens


def test_a_json_schema_text_format_is_enforced(served):
    out = served.sdk.responses.create(
        model=served.model,
        input="A point, as JSON",
        max_output_tokens=60,
        temperature=0.0,
        text={"format": {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}},
    )
    assert out.status == "completed", out
    jsonschema.validate(json.loads(out.output_text), POINT)
    assert out.text is not None and out.text.format is not None and out.text.format.type == "json_schema"
    # the SDK's parse with a pydantic model (its strict schema), as structured-output libraries call it
    parsed = served.sdk.responses.parse(
        model=served.model, input="A point, as JSON", max_output_tokens=60, temperature=0.0, text_format=Point
    )
    assert isinstance(parsed.output_parsed, Point), parsed


class Point(BaseModel):
    x: int
    label: Literal["near", "far"]


def test_a_function_call_round_trip(served):
    sdk, model = served.sdk, served.model
    ask = [{"role": "user", "content": "Time?"}]
    called = sdk.responses.create(
        model=model,
        input=ask,
        tools=[NOW],
        tool_choice={"type": "function", "name": "now"},
        max_output_tokens=70,
        temperature=0.0,
    )
    (call,) = called.output
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "now" and call.call_id.startswith("call_"), (
        called
    )
    jsonschema.validate(json.loads(call.arguments), NOW["parameters"])
    assert called.status == "completed" and called.tool_choice.type == "function"  # type: ignore[union-attr]
    # the SDK's own output item back as input, with the tool's answer: the final answer is text
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
    final = sdk.responses.create(
        model=model, input=[*ask, *called.output, answer], tools=[NOW], tool_choice="none", max_output_tokens=5
    )
    (message,) = final.output
    assert isinstance(message, ResponseOutputMessage) and isinstance(final.output_text, str)
    # the conversation the worker rendered is chat's: the call and its answer as an assistant turn and a tool turn
    history = [
        *ask,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "now", "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"},
    ]
    chat = sdk.chat.completions.create(model=model, messages=history, max_tokens=5, temperature=0.0)
    again = sdk.responses.create(
        model=model, input=[*ask, *called.output, answer], max_output_tokens=5, temperature=0.0
    )
    assert again.output_text == chat.choices[0].message.content
    assert again.usage is not None and chat.usage is not None
    assert again.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_events_add_up_to_the_final_response(served):
    sdk, model = served.sdk, served.model
    with sdk.responses.stream(model=model, input="Hello there", max_output_tokens=30, temperature=0.0) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else None
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.output_text == text and last.response.usage is not None
    plain = sdk.responses.create(model=model, input="Hello there", max_output_tokens=30, temperature=0.0)
    assert text == plain.output_text and last.response.status == plain.status
    if final is not None:  # the SDK's accumulator agrees
        assert final.output_text == text

    # create(stream=True), a named call: the status before the first byte; its arguments stream as generated
    with sdk.responses.with_streaming_response.create(
        model=model,
        input="Time?",
        tools=[NOW],
        tool_choice={"type": "function", "name": "now"},
        max_output_tokens=70,
        temperature=0.0,
        stream=True,
    ) as raw:
        assert raw.http_response.status_code == 200
        assert raw.http_response.headers["content-type"].startswith("text/event-stream")
        streamed = list(raw.parse())
    kinds = [e.type for e in streamed]
    assert (
        kinds.count("response.function_call_arguments.delta") > 1 and "response.function_call_arguments.done" in kinds
    )
    (done,) = [e for e in streamed if e.type == "response.output_item.done"]
    assert isinstance(done.item, ResponseFunctionToolCall) and done.item.name == "now"
    jsonschema.validate(json.loads(done.item.arguments), NOW["parameters"])
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert arguments == done.item.arguments and streamed[-1].type == "response.completed"
    assert streamed[-1].response.output == [done.item]


def _events(endpoint: ResponsesEndpoint, deltas: list[str], final: FinalRecord) -> list:
    """The bytes the endpoint streams for these deltas and this record (in streaming.sse's order), as the SDK's
    SSE decoder reads them, each validated as the SDK's ResponseStreamEvent."""
    frames = b"".join(endpoint.frame(chunk, False) for chunk in endpoint.opening(final.id))
    for pos, text in enumerate(deltas):
        chunk = endpoint.delta_chunk(final.id, 0, Delta(text=text, token_ids=[1], pos=pos))
        frames += endpoint.frame(chunk, False) if chunk is not None else b""
    frames += b"".join(endpoint.frame(chunk, False) for chunk in endpoint.closing(final.id, 0, final))
    frames += endpoint.ending(final.id, [final], False)
    decoded = list(SSEDecoder().iter_bytes(iter([frames])))
    assert all(sse.event == sse.json()["type"] for sse in decoded)
    return [TypeAdapter(ResponseStreamEvent).validate_python(sse.json()) for sse in decoded]


@pytest.mark.parametrize(
    "choice, deltas",
    [
        # required: the calls are parsed, and sent, once the list is complete
        (
            "required",
            ['[{"name": "now", "parameters": {"z": "utc"}}, ', '{"name": "now", "parameters": {"z": "cet"}}]'],
        ),
        # auto: the text before a call, then the call (Hermes' <tool_call> block)
        ("auto", ["Let me see. ", '<tool_call>{"name": "now", ', '"arguments": {"z": "utc"}}</tool_call>']),
    ],
)
def test_calls_decided_at_the_close_stream_as_items_the_sdk_accumulates(choice, deltas):
    body = ResponsesRequest.model_validate({"model": "m", "input": "Time?", "tools": [NOW], "tool_choice": choice})
    record = FinalRecord(id="j1", status="completed", text="".join(deltas), finish_reason="stop")
    state = ResponseStreamState(input_tools=[NOW], text_format=omit)  # the SDK's own accumulator (responses.stream)
    for event in _events(ResponsesEndpoint(body, 0), deltas, record):
        state.handle_event(event)
    final = state._completed_response
    assert final is not None and final.status == "completed" and final.id == "resp_j1"
    calls = [item for item in final.output if item.type == "function_call"]
    expected = [{"z": "utc"}, {"z": "cet"}] if choice == "required" else [{"z": "utc"}]
    assert [json.loads(c.arguments) for c in calls] == expected and all(c.name == "now" for c in calls)
    assert len({c.call_id for c in calls}) == len(calls)
    messages = [item for item in final.output if item.type == "message"]
    assert [m.content[0].text for m in messages] == ([] if choice == "required" else ["Let me see. "])
    # the same record answered whole: the same items (ids aside)
    whole = Response.model_validate(ResponsesEndpoint(body, 0).response([record]))
    assert [(i.type, getattr(i, "arguments", None)) for i in whole.output] == [
        (i.type, getattr(i, "arguments", None)) for i in final.output
    ]


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "stateless"),
        ({"conversation": "conv_1"}, "conversation", "stateless"),
        ({"background": True}, "background", "stored responses"),
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input.list.0.message.content",
            "image input is not supported by this model",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format", "needs a name and a schema"),
        ({"max_output_tokens": 10**9}, "max_output_tokens", "less than or equal"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "does not reason"),
    ],
)
def test_what_a_stateless_gateway_refuses_is_a_400_naming_the_field(served, extra, param, words):
    body = {"model": served.model, "input": "Hi", **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        served.sdk.responses.create(**body)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"].startswith(param) and words in error["message"], error


def test_stored_responses_are_a_400_and_the_stream_is_refused_before_its_first_byte(served):
    with pytest.raises(openai.BadRequestError, match="stateless"):
        served.sdk.responses.retrieve("resp_123")
    with pytest.raises(openai.BadRequestError, match="stateless"):
        served.sdk.responses.delete("resp_123")
    # a refused streamed request is the same 400, before any event
    with httpx.stream(
        "POST",
        served.base + "/responses",
        json={"model": served.model, "input": "Hi", "stream": True, "previous_response_id": "resp_1"},
        headers={"Authorization": "Bearer x"},
    ) as refused:
        assert refused.status_code == 400
        assert json.loads(refused.read())["error"]["param"] == "previous_response_id"


def test_a_stream_that_fails_after_its_first_byte_ends_in_openais_error_event():
    endpoint = ResponsesEndpoint(ResponsesRequest.model_validate({"model": "m", "input": "Hi"}), 0)
    frames = b"".join(endpoint.frame(chunk, False) for chunk in endpoint.opening("j1"))
    frames += endpoint.failure(OpenAIError(504, "job j1: no output within 5.0 s", code="timeout"))
    decoded = list(SSEDecoder().iter_bytes(iter([frames])))
    events = [TypeAdapter(ResponseStreamEvent).validate_python(sse.json()) for sse in decoded]
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    assert [e.sequence_number for e in events] == [0, 1, 2] and decoded[-1].event == "error"
    error = events[-1]
    assert isinstance(error, ResponseErrorEvent) and error.code == "timeout" and "no output" in error.message
