"""OpenAI function tools on plain dicts (the request's JSON), for every front door: the chat endpoint (from its
pydantic body), the Batch API and `pagedq bulk` (from a line's body). Pure: no pydantic, nothing above protocol.

- the tool mode of a request ("named", "required", "auto", or None: no call) and what its answer is parsed for
  (ToolSpec, small enough to carry from a request line to the writer of its output line);
- the JSON schema that forces a call under "required" (a bounded list of calls: protocol/call_list.py) or a named
  function, as vLLM builds it from the functions' parameters; "auto" constrains nothing;
- the OpenAI conversation as the job's messages (each call's arguments JSON text parsed into the object the chat
  templates take; protocol/chat.py renders them);
- the answer as (content, tool_calls): a forced call's arguments, the complete calls of a required list, or the Hermes
  <tool_call> blocks of an "auto" answer (what Qwen2.5's and Hermes' templates, and the Hermes form, ask for;
  vLLM's `hermes` parser reads the same).

Errors are RequestFieldError, naming the field (`param`); each front door words it as its own error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedq.worker.protocol.call_list import ANY_ARGUMENTS, call_list_schema, read_calls
from pagedq.worker.protocol.chat import HERMES, TOOL_CALL_OPEN

# The most calls a required list holds when parallel calls are allowed (serve's and bulk's --max-tool-calls)
DEFAULT_MAX_TOOL_CALLS = 16
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# What the SDK sends back with an earlier response's message object, and OpenAI's participant name: informational,
# not rendered (the gateway's schema checks them; a job's message has no such fields)
IGNORED_MESSAGE_KEYS = ("name", "refusal", "function_call", "audio", "annotations")


class RequestFieldError(ValueError):
    """A request that cannot be served as given; param names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """What an answer is parsed for: the mode, the declared function names and the named function (if any)."""

    mode: str  # "named" | "required" | "auto"
    names: tuple[str, ...] = ()
    named: str | None = None

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(content, tool_calls) of a generated text. Named: the function's arguments as generated (vLLM does the
        same when they are cut short); required: the complete calls of the list, each once (a cut tail is dropped,
        never handed out as content; no complete call: empty content); auto: the <tool_call> blocks of declared
        functions, if any, else the text as content."""
        if self.mode == "named":
            assert self.named is not None
            return None, [call(self.named, text)]
        if self.mode == "auto":
            content, found = parse_calls(text, set(self.names))
            return content, [call(name, arguments) for name, arguments in found] or None
        calls = [call(name, arguments) for name, arguments in read_calls(text, self.names)]
        return (None, calls) if calls else ("", None)

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of an answer: its content, and its tool_calls where it called any."""
        content, calls = self.answer(text)
        if calls is None:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content, "tool_calls": calls}

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        """OpenAI's (and vLLM's): "tool_calls" when a required or auto answer that stopped called tools; a named
        call's answer keeps the engine's reason ("stop"), and a cut one stays "length" whatever it holds."""
        if self.mode != "named" and reason == "stop" and self.answer(text)[1]:
            return "tool_calls"
        return reason


def tool_spec(tools: list[Any] | None, tool_choice: Any) -> ToolSpec | None:
    """The request's ToolSpec; None when the output is no tool call ("none", or no tools)."""
    mode = tool_mode(tools, tool_choice)
    if mode is None:
        return None
    named = tool_choice["function"]["name"] if mode == "named" else None
    return ToolSpec(mode, tuple(_functions(tools)), named)


def tool_mode(tools: list[Any] | None, tool_choice: Any) -> str | None:
    """'named', 'required', 'auto' (also when tools come without a tool_choice, as in OpenAI's API), or None when
    the output is no tool call ('none', or no tools)."""
    if not tools or tool_choice == "none":
        return None
    if tool_choice in (None, "auto", "required"):
        return "required" if tool_choice == "required" else "auto"
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    ):
        raise RequestFieldError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return "named"


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """Each declared function by name (the job validates the rest of a tool: protocol/chat.py)."""
    if not isinstance(tools, list):
        raise RequestFieldError("tools must be a list of function tools", "tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestFieldError(f"tools.{i}.function: a function tool needs a function with a name", f"tools.{i}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestFieldError(f"tools.{i}.function.parameters must be a JSON schema object", f"tools.{i}")
        functions[function["name"]] = function
    return functions


def tool_constraint(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    max_calls: int = DEFAULT_MAX_TOOL_CALLS,
) -> dict | None:
    """The structured_outputs that force the call(s) of "required" (one under parallel_tool_calls false, else at most
    max_calls) or a named function; None otherwise."""
    mode = tool_mode(tools, tool_choice)
    if mode in (None, "auto"):
        return None
    functions = _functions(tools)
    if mode == "named":
        name = tool_choice["function"]["name"]
        if name not in functions:
            raise RequestFieldError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return {"json": functions[name].get("parameters") or ANY_ARGUMENTS}
    return {"json": call_list_schema(functions, 1 if parallel_tool_calls is False else max_calls)}


def one_constraint(given: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]] | None:
    """The one (field, constraint) given, None for none; more than one is refused, naming them."""
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise RequestFieldError(f"{names} each constrain the output: give only one", given[1][0])
    return given[0] if given else None


# ---------------------------------------------------------------------------------------------- the conversation
def conversation_fields(messages: list[Any], tools: list[Any] | None, mode: str | None) -> dict[str, Any]:
    """The job's messages (OpenAI's shape, each call's arguments parsed into the object the templates take), its
    tools (not for tool_choice "none", whose answer never calls them) and, for "auto", the parser of the answer."""
    if not isinstance(messages, list):
        raise RequestFieldError("messages must be a list of messages", "messages")
    fields: dict[str, Any] = {"messages": [job_message(m, i) for i, m in enumerate(messages)]}
    if mode is not None and tools:
        fields["tools"] = tools
    if mode == "auto":
        fields["tool_call_parser"] = HERMES
    return fields


def job_message(message: Any, index: int) -> dict[str, Any]:
    """One OpenAI message as the job carries it: content as text (parts joined), calls' arguments as objects.
    Fields the job does not know stay, so that the job refuses them by name."""
    if not isinstance(message, dict):
        raise RequestFieldError(f"messages.{index} must be an object", f"messages.{index}")
    turn = {k: v for k, v in message.items() if k not in IGNORED_MESSAGE_KEYS and k != "tool_calls"}
    turn["content"] = _text(message.get("content"), index)
    calls = message.get("tool_calls")
    if calls:  # an empty list: no calls (what the gateway's schema takes too)
        if not isinstance(calls, list):
            raise RequestFieldError(f"messages.{index}.tool_calls must be a list", f"messages.{index}.tool_calls")
        turn["tool_calls"] = [_call_of_history(c, index) for c in calls]
    return turn


def _text(content: Any, index: int) -> Any:
    if not isinstance(content, list):
        return content  # a string, None, or something the job refuses by name
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        param = f"messages.{index}.content"
        raise RequestFieldError(f"{param}: only text parts are supported", param)
    return "".join(p["text"] for p in content)


def _call_of_history(called: Any, index: int) -> Any:
    function = called.get("function") if isinstance(called, dict) else None
    if not isinstance(function, dict):
        return called  # the job refuses it, naming the field
    return {**called, "function": {**function, "arguments": arguments_object(function.get("arguments"), index)}}


def arguments_object(arguments: Any, index: int) -> Any:
    """A call's arguments JSON text as an object (empty: no arguments, as vLLM takes it)."""
    if isinstance(arguments, dict):
        return arguments  # already an object (a job's own form)
    param = f"messages.{index}.tool_calls.function.arguments"
    if not isinstance(arguments, str):
        raise RequestFieldError(f"{param}: a call's arguments must be a JSON object", param)
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise RequestFieldError(f"{param}: a call's arguments must be a JSON object", param)
    return parsed


# ---------------------------------------------------------------------------------------------- the answer
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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
