"""An OpenAI request's output constraint as a job's structured_outputs: response_format (json_object, json_schema),
vLLM's structured_outputs (extra_body), or tools with tool_choice "required" or a named function, which vLLM
enforces with a JSON schema built from the functions' parameters. At most one of them; a bad one is a 400.
tool_choice "auto" (OpenAI's default when tools are given) constrains nothing: the answer is parsed for calls
(worker/gateway/tools.py)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from worker.gateway.errors import OpenAIError
from worker.gateway.schemas import ChatCompletionRequest, NamedToolChoice, SamplingBody
from worker.gateway.tools import parse_calls
from worker.protocol.job import structured_outputs_wire

ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}  # a function declared without parameters


def structured_outputs_of(body: SamplingBody) -> dict[str, Any] | None:
    """The job's structured_outputs for this body (None: unconstrained)."""
    given: list[tuple[str, dict[str, Any]]] = []
    if body.structured_outputs is not None:
        given.append(("structured_outputs", body.structured_outputs))
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        given.append(("response_format", _from_response_format(body)))
    if isinstance(body, ChatCompletionRequest):
        tools = tool_constraint(body)
        if tools is not None:
            given.append(("tool_choice", tools))
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise OpenAIError(400, f"{names} each constrain the output: give only one", param=given[1][0])
    if not given:
        return None
    param, constraint = given[0]
    try:
        return structured_outputs_wire(constraint)
    except ValueError as error:
        raise OpenAIError(400, f"{param}: {error}", param=param, code="invalid_request") from None


def _from_response_format(body: SamplingBody) -> dict[str, Any]:
    response_format = body.response_format
    assert response_format is not None
    if response_format.type == "json_object":
        return {"json_object": True}
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise OpenAIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
    return {"json": spec.schema_}


def tool_mode(body: ChatCompletionRequest) -> str | None:
    """'named', 'required', 'auto' (also when tools come without a tool_choice, as in OpenAI's API), or None when
    the output is no tool call ('none', or no tools)."""
    choice = body.tool_choice
    if not body.tools or choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        return "named"
    return "required" if choice == "required" else "auto"


def tool_constraint(body: ChatCompletionRequest) -> dict[str, Any] | None:
    mode = tool_mode(body)
    if mode in (None, "auto"):
        return None
    tools = {t.function.name: t.function for t in body.tools or ()}
    if mode == "named":
        assert isinstance(body.tool_choice, NamedToolChoice)
        name = body.tool_choice.function.name
        if name not in tools:
            raise OpenAIError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        return {"json": tools[name].parameters or ANY_ARGUMENTS}
    calls = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": function.parameters or ANY_ARGUMENTS,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, function in tools.items()
            ]
        },
    }
    if body.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return {"json": calls}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_of(body: ChatCompletionRequest, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) of a generated text. Named: the function's arguments as generated (vLLM does the same
    when they are cut short); required: the calls of the list, or no calls when it does not parse (cut by
    max_tokens: the text is then the content); auto: the <tool_call> blocks of declared functions, if any."""
    mode = tool_mode(body)
    if mode == "named":
        assert isinstance(body.tool_choice, NamedToolChoice)
        return None, [call(body.tool_choice.function.name, text)]
    if mode == "auto":
        content, found = parse_calls(text, {t.function.name for t in body.tools or ()})
        return content, [call(name, arguments) for name, arguments in found] or None
    try:
        calls = json.loads(text)
        return None, [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    except (ValueError, TypeError, KeyError):
        return text, None


def call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
