"""Tools in the conversation, for any chat template: the functions rendered into the system turn, earlier calls and
their results rendered as text, and tool calls parsed out of an unconstrained ("auto") answer.

The worker renders messages with the checkpoint's chat template as plain {role, content} turns, and many templates
(SmolLM2's among them) know nothing of tools: a `tool` role or an assistant turn without content would break them.
So the gateway writes tools in one template-neutral form, the Hermes convention that Qwen2.5's and Hermes' own
templates use (and vLLM's `hermes` parser reads): the functions as JSON inside <tools></tools> in the system turn,
each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, each result inside <tool_response> in a
user turn. Not a template's own tool syntax: a model trained on another format reads these as plain text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from worker.gateway.schemas import ChatCompletionRequest

TOOL_CALL_OPEN = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_INSTRUCTIONS = (
    "You may call one or more functions to help with the request. The function signatures are within "
    "<tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with one JSON object per "
    'call, each within <tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


def render_messages(body: ChatCompletionRequest, describe_tools: bool) -> list[dict[str, str]]:
    """The job's messages: plain turns any template takes; the tools described in the system turn (not for
    tool_choice "none", whose answer never calls them)."""
    turns: list[dict[str, str]] = []
    for message in body.messages:
        role, content = message.role, message.text()
        if role == "assistant" and message.tool_calls:
            calls = [_call_text(call.function.name, call.function.arguments) for call in message.tool_calls]
            content = "\n".join([content, *calls]).strip()
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
            if turns and turns[-1]["role"] == "user" and turns[-1]["content"].endswith("</tool_response>"):
                turns[-1]["content"] += "\n" + content  # the results of one turn's calls, together
                continue
        turns.append({"role": role, "content": content})
    if describe_tools and body.tools:
        tools = "\n".join(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False) for tool in body.tools)
        block = _INSTRUCTIONS.format(tools=tools)
        if turns[0]["role"] in ("system", "developer"):
            turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{block}".strip()}
        else:
            turns.insert(0, {"role": "system", "content": block})
    return turns


def _call_text(name: str, arguments: str) -> str:
    try:
        parsed: Any = json.loads(arguments)
    except ValueError:
        parsed = arguments  # as the client sent it
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": parsed}, ensure_ascii=False) + "\n</tool_call>"


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
