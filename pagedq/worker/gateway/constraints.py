"""An OpenAI request's output constraint as a job's structured_outputs: response_format (json_object, json_schema),
vLLM's structured_outputs (extra_body), or tools with tool_choice "required" or a named function, which vLLM
enforces with a JSON schema built from the functions' parameters. At most one of them; a bad one is a 400.
tool_choice "auto" (OpenAI's default when tools are given) constrains nothing: the answer is parsed for calls
(pagedq/worker/protocol/tool_calls.py, the one implementation the Batch API and `pagedq bulk` share)."""

from __future__ import annotations

from typing import Any

from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.schemas import ChatCompletionRequest, SamplingBody
from pagedq.worker.gateway.tools import tool_dicts
from pagedq.worker.protocol import tool_calls
from pagedq.worker.protocol.job import structured_outputs_wire
from pagedq.worker.protocol.tool_calls import RequestFieldError, one_constraint


def structured_outputs_of(body: SamplingBody, max_tool_calls: int) -> dict[str, Any] | None:
    """The job's structured_outputs for this body (None: unconstrained); max_tool_calls bounds a required list."""
    given: list[tuple[str, dict[str, Any]]] = []
    if body.structured_outputs is not None:
        given.append(("structured_outputs", body.structured_outputs))
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        given.append(("response_format", _from_response_format(body)))
    if isinstance(body, ChatCompletionRequest):
        tools = tool_constraint(body, max_tool_calls)
        if tools is not None:
            given.append(("tool_choice", tools))
    try:
        chosen = one_constraint(given)
    except RequestFieldError as error:
        raise OpenAIError(400, str(error), param=error.param) from None
    if chosen is None:
        return None
    param, constraint = chosen
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


def tool_constraint(body: ChatCompletionRequest, max_calls: int) -> dict[str, Any] | None:
    """The constraint that forces the call(s) of tool_choice "required" or a named function (protocol/tool_calls.py)."""
    tools, choice = tool_dicts(body)
    try:
        return tool_calls.tool_constraint(tools, choice, body.parallel_tool_calls, max_calls)
    except RequestFieldError as error:
        raise OpenAIError(400, str(error), param=error.param) from None
