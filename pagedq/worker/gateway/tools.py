"""Tools in a chat request, from its pydantic body to the one implementation on plain dicts
(pagedq/worker/protocol/tool_calls.py, which the Batch API and `pagedq bulk` use too): the tool mode and what an answer
is parsed for, and the conversation and the function tools as the job carries them (protocol/chat.py, where the
worker renders them: natively where the checkpoint's chat template declares tools, else in the Hermes form)."""

from __future__ import annotations

from typing import Any

from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.schemas import ChatCompletionRequest
from pagedq.worker.protocol import tool_calls
from pagedq.worker.protocol.chat import TOOL_CALL_OPEN
from pagedq.worker.protocol.tool_calls import RequestFieldError, ToolSpec, parse_calls

__all__ = ["TOOL_CALL_OPEN", "conversation_fields", "parse_calls", "tool_dicts", "tool_spec"]


def tool_dicts(body: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """The body's tools and tool_choice as the request's JSON."""
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    choice = body.tool_choice
    return tools, choice if isinstance(choice, str | None) else choice.model_dump()


def tool_spec(body: ChatCompletionRequest) -> ToolSpec | None:
    return tool_calls.tool_spec(*tool_dicts(body))


def conversation_fields(body: ChatCompletionRequest, mode: str | None) -> dict[str, Any]:
    """The job's messages, tools and answer parser (tool_calls.conversation_fields), 400 naming a bad field."""
    messages = [message.model_dump(exclude_none=True) for message in body.messages]
    try:
        return tool_calls.conversation_fields(messages, tool_dicts(body)[0], mode)
    except RequestFieldError as error:
        raise OpenAIError(400, str(error), param=error.param) from None
