"""Tools in a chat request: the conversation and the function tools as the job carries them (protocol/chat.py, where
the worker renders them: natively where the checkpoint's chat template declares tools, else in the Hermes form),
and tool calls parsed out of an unconstrained ("auto") answer as Hermes <tool_call> blocks (what Qwen2.5's and
Hermes' templates, and the Hermes form, ask for; vLLM's `hermes` parser reads the same)."""

from __future__ import annotations

import json
import re
from typing import Any

from worker.gateway.errors import OpenAIError
from worker.gateway.schemas import ChatCompletionRequest
from worker.protocol.chat import HERMES, TOOL_CALL_OPEN

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
__all__ = ["TOOL_CALL_OPEN", "conversation_fields", "parse_calls"]


def conversation_fields(body: ChatCompletionRequest, mode: str | None) -> dict[str, Any]:
    """The job's messages (OpenAI's shape, each call's arguments parsed into the object the templates take), its
    tools (not for tool_choice "none", whose answer never calls them) and, for "auto", the parser of the answer."""
    messages = [_message(body, i) for i in range(len(body.messages))]
    fields: dict[str, Any] = {"messages": messages}
    if mode is not None and body.tools:
        fields["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if mode == "auto":
        fields["tool_call_parser"] = HERMES
    return fields


def _message(body: ChatCompletionRequest, index: int) -> dict[str, Any]:
    message = body.messages[index]
    turn: dict[str, Any] = {"role": message.role, "content": message.text() if message.content is not None else None}
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c, index)}}
            for c in message.tool_calls
        ]
    return turn


def _arguments(call: Any, index: int) -> dict[str, Any]:
    """A call's arguments JSON text as an object (empty: no arguments, as vLLM takes it)."""
    if not call.function.arguments.strip():
        return {}
    try:
        parsed = json.loads(call.function.arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        param = f"messages.{index}.tool_calls.function.arguments"
        raise OpenAIError(400, f"{param}: a call's arguments must be a JSON object", param=param)
    return parsed


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """(the content before the first call, or None if there is none; (name, arguments JSON) of each call), from
    an "auto" answer. Only well-formed calls of declared functions count; with none the whole text is content."""
    calls: list[tuple[str, str]] = []
    for block in _CALL.findall(text):
        try:
            parsed = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(parsed, dict) or parsed.get("name") not in names:
            return text, []
        arguments = parsed.get("arguments", parsed.get("parameters", {}))
        calls.append((parsed["name"], json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return text, []
    content = text[: text.index(TOOL_CALL_OPEN)].strip()
    return content or None, calls
