"""A chat job's conversation: OpenAI-shaped messages (assistant tool calls, tool results) and the function tools,
and how the worker renders them with the checkpoint's chat template.

A template that declares tools (its source uses the `tools` variable: Qwen2.5's, Hermes', Llama 3.1's...) gets the
structured messages and `tools=` natively, as vLLM passes them to `apply_chat_template`. Any other template
(SmolLM2's) knows nothing of tools, and a `tool` turn or an assistant turn without content would break it: it gets
the Hermes convention written as plain turns (the functions as JSON inside <tools></tools> in the system turn, each
call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, each result inside <tool_response> in a user
turn), the one source of that text. Answers are parsed as Hermes <tool_call> blocks (protocol/tool_calls.py): a job
asking for that (`tool_call_parser: "hermes"`) is rejected by a worker whose template declares tools but writes
calls in another format (no "<tool_call>" in its source).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from pagedq.worker.protocol.limits import check_json_value

MAX_CONTENT_CHARS = 1_000_000  # as MAX_PROMPT_CHARS (protocol/job.py, which imports this module)
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # per assistant message
MAX_ID_CHARS = 256
MAX_DESCRIPTION_CHARS = 4096
MAX_TOOL_JSON_BYTES = 256 * 1024  # a function's parameters schema, or a call's arguments, as compact JSON
FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
TOOL_CALL_OPEN = "<tool_call>"
HERMES = "hermes"
# JSON nesting levels of these values inside a job (the job object is level 1; MAX_JSON_DEPTH bounds them)
_ARGUMENTS_LEVEL = 7  # job > messages > message > tool_calls > call > function > arguments
_PARAMETERS_LEVEL = 5  # job > tools > tool > function > parameters
_INSTRUCTIONS = (
    "You may call one or more functions to help with the request. The function signatures are within "
    "<tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with one JSON object per "
    'call, each within <tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


class _Frozen(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def _json_object(value: dict[str, Any], level: int) -> dict[str, Any]:
    check_json_value(value, level)
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_TOOL_JSON_BYTES:
        raise ValueError(f"is {size} bytes as JSON, more than the limit of {MAX_TOOL_JSON_BYTES}")
    return value


class CalledFunction(_Frozen):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: dict[str, Any]  # a JSON object, as the templates take it (vLLM parses the API's JSON text into one)

    _arguments = field_validator("arguments")(lambda value: _json_object(value, _ARGUMENTS_LEVEL))


class ToolCall(_Frozen):
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Frozen):
    """One chat turn. Content is None only on an assistant turn that calls tools; tool_calls only on assistant
    turns; tool_call_id (the call a result answers) only, and always, on tool turns."""

    role: str = Field(min_length=1, max_length=64)
    content: str | None = Field(max_length=MAX_CONTENT_CHARS)
    tool_calls: list[ToolCall] | None = Field(default=None, min_length=1, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r} ones")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs a tool_call_id, and only tool messages have one")
        if self.content is None and self.tool_calls is None:
            raise ValueError(f"a {self.role} message needs content (only an assistant's tool calls may go without)")
        return self

    @model_serializer(mode="wrap")
    def _given_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The tool fields only where given: a plain turn stays {role, content}, as older workers read it."""
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None or k == "content"}

    def as_dict(self) -> dict[str, Any]:
        """What apply_chat_template takes."""
        return self.model_dump()


class FunctionDefinition(_Frozen):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    _parameters = field_validator("parameters")(lambda v: None if v is None else _json_object(v, _PARAMETERS_LEVEL))


class Tool(_Frozen):
    type: Literal["function"]
    function: FunctionDefinition


def uses_tools(messages: list[ChatMessage], tools: list[Tool] | None) -> bool:
    return bool(tools) or any(m.tool_calls is not None or m.role == "tool" for m in messages)


def hermes_turns(messages: list[ChatMessage], tools: list[Tool] | None) -> list[dict[str, str]]:
    """Plain {role, content} turns any template takes, tools and calls written in the Hermes convention."""
    turns: list[dict[str, str]] = []
    for message in messages:
        role, content = message.role, message.content or ""
        if message.tool_calls:
            calls = [hermes_call(call.function.name, call.function.arguments) for call in message.tool_calls]
            content = "\n".join([content, *calls]).strip()
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
            if turns and turns[-1]["role"] == "user" and turns[-1]["content"].endswith("</tool_response>"):
                turns[-1]["content"] += "\n" + content  # the results of one turn's calls, together
                continue
        turns.append({"role": role, "content": content})
    if tools:
        listed = "\n".join(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False) for tool in tools)
        block = _INSTRUCTIONS.format(tools=listed)
        if turns[0]["role"] in ("system", "developer"):
            turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{block}".strip()}
        else:
            turns.insert(0, {"role": "system", "content": block})
    return turns


def hermes_call(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def template_declares_tools(source: str) -> bool:
    """Whether a chat template reads the `tools` variable (jinja's own analysis of the source, not a substring:
    a template that only mentions the word, or sets its own `tools`, does not declare it)."""
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateSyntaxError:
        return False  # apply_chat_template will refuse it, with its own error


def render_conversation(
    tokenizer: Any,
    messages: list[ChatMessage],
    tools: list[Tool] | None,
    tool_call_parser: str | None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of a conversation (a job's: add_generation_prompt=True; /tokenize may ask otherwise).
    Raises ValueError when the template cannot take it, or writes tool calls in a format other than the one the
    job's answer will be parsed as."""
    options = {"add_generation_prompt": add_generation_prompt, "tokenize": False}
    if continue_final_message:  # only when asked: a tokenizer that predates the option takes every job
        options["continue_final_message"] = True
    if not uses_tools(messages, tools):
        plain = [m.as_dict() for m in messages]
        return tokenizer.apply_chat_template(plain, **options)
    tool_dicts = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
    source = tokenizer.get_chat_template(tools=tool_dicts)
    if not template_declares_tools(source):
        turns = hermes_turns(messages, tools)
        return tokenizer.apply_chat_template(turns, **options)
    if tool_call_parser == HERMES and TOOL_CALL_OPEN not in source:
        raise ValueError(
            "tool_choice auto: this model's chat template writes tool calls in its own format, not as Hermes "
            "<tool_call> blocks, which is what the answer would be parsed as; use tool_choice required or a named "
            "function"
        )
    structured = [m.as_dict() for m in messages]
    return tokenizer.apply_chat_template(structured, tools=tool_dicts, **options)
