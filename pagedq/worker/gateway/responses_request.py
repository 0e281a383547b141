"""POST /v1/responses bodies (OpenAI's Responses API, served stateless) as strict pydantic models, and each one as
the chat request it means: `instructions` a system message, `input` the messages (a function_call item an assistant's
tool call, a function_call_output item the tool's answer), `text.format` the response_format, the flat function
tools the chat shape. The chat endpoint's machinery (tools, constraints, limits) then serves it unchanged.

Fields that carry no meaning here are accepted and documented (docs/gateway.md); what needs state
(previous_response_id, conversation, background) is a 400 that says so.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator

from pagedq.engine import limits as sampling
from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.schemas import ChatCompletionRequest, Strict
from pagedq.worker.protocol.job import MAX_PROMPT_CHARS, optional

Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
ItemId = Annotated[str, Field(max_length=256)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def _text_or_list(value: Any) -> str | None:
    """A string or a list, told apart by the value: an error then names the one meant, not both."""
    return "text" if isinstance(value, str) else "list" if isinstance(value, list) else None


TEXT_OR_LIST = Discriminator(
    _text_or_list, custom_error_type="text_or_list", custom_error_message="must be a string or a list"
)


UNSUPPORTED_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}


class InputText(Strict):
    type: Literal["input_text"]
    text: Text


class OutputText(Strict):
    """An earlier response's text, sent back (its annotations and logprobs are always empty here)."""

    type: Literal["output_text"]
    text: Text
    annotations: list[Any] = Field(default_factory=list, max_length=0)
    logprobs: list[Any] | None = Field(default=None, max_length=0)


MessageContent = Annotated[
    Annotated[Text, Tag("text")]
    | Annotated[
        list[Annotated[InputText | OutputText, Field(discriminator="type")]],
        Field(max_length=MAX_PROMPT_CHARS),
        Tag("list"),
    ],
    TEXT_OR_LIST,
]
OutputParts = Annotated[
    Annotated[Text, Tag("text")] | Annotated[list[InputText], Field(max_length=MAX_PROMPT_CHARS), Tag("list")],
    TEXT_OR_LIST,
]


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: MessageContent
    id: ItemId | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else ():
            kind = UNSUPPORTED_PARTS.get(str(part.get("type"))) if isinstance(part, dict) else None
            if kind is not None:
                raise ValueError(f"{kind} input is not supported by this model (text parts only)")
        return content

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(Strict):
    """A call the model made (an earlier response's output item, sent back)."""

    type: Literal["function_call"]
    call_id: ItemId
    name: str = Field(min_length=1, max_length=64)
    arguments: Text
    id: ItemId | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(Strict):
    """The caller's answer to a call, matched by call_id."""

    type: Literal["function_call_output"]
    call_id: ItemId
    output: OutputParts
    id: ItemId | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


def _item_type(item: Any) -> str | None:
    """A message item may leave out its type (OpenAI's "easy" input message)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


Input = Annotated[
    Annotated[Text, Tag("text")] | Annotated[list[InputItem], Field(max_length=10_000), Tag("list")],
    TEXT_OR_LIST,
]


class FunctionTool(Strict):
    """Responses' flat function tool."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = Field(default=None, max_length=4096)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # no meaning for these models: accepted


class ReasoningOptions(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None  # no obfuscation padding is sent: accepted


class ResponsesRequest(Strict):
    model: str = Field(min_length=1, max_length=512)
    input: Input
    instructions: Text | None = None
    max_output_tokens: int | None = optional(sampling.MAX_TOKENS)
    temperature: float | None = optional(sampling.TEMPERATURE)
    top_p: float | None = optional(sampling.TOP_P)
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    # accepted, meaning nothing here (docs/gateway.md): nothing is stored, whatever `store` says
    store: bool | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = Field(default=None, max_length=16)
    reasoning: ReasoningOptions | None = None
    # state: refused in chat_request (a 400 naming them)
    previous_response_id: str | None = Field(default=None, max_length=256)
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools.{i}: only function tools are served here, not {kind!r}")
        return tools


def _refuse_state(body: ResponsesRequest) -> None:
    """What a stateless gateway cannot serve, each a 400 that says why."""
    stateless = "this gateway is stateless: responses are not stored; send the whole conversation as input"
    if body.previous_response_id is not None:
        raise OpenAIError(400, f"previous_response_id is not supported: {stateless}", param="previous_response_id")
    if body.conversation is not None:
        raise OpenAIError(400, f"conversation is not supported: {stateless}", param="conversation")
    if body.background:
        raise OpenAIError(
            400, "background responses are not supported (they need stored responses)", param="background"
        )
    if body.truncation == "auto":
        raise OpenAIError(
            400, 'truncation "auto" is not supported: a prompt past the context is refused', param="truncation"
        )
    if body.include:
        raise OpenAIError(400, f"include {body.include} is not supported (no such output is produced)", param="include")
    if body.reasoning is not None and body.reasoning.effort not in (None, "none"):
        raise OpenAIError(400, f"reasoning: model {body.model!r} does not reason", param="reasoning")


def messages_of(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of instructions and input; consecutive function_call items are one assistant turn."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            called = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(called)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [called]})
    return messages


def _response_format(text: TextOptions | None) -> dict[str, Any] | None:
    spec = text.format if text is not None else None
    if spec is None or spec.type != "json_schema":
        return {"type": spec.type} if spec is not None else None
    if spec.name is None or spec.schema_ is None:
        raise OpenAIError(400, "text.format json_schema needs a name and a schema", param="text.format")
    schema = {"name": spec.name, "schema": spec.schema_, "description": spec.description, "strict": spec.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses body means (a 400 for what a stateless gateway cannot serve)."""
    _refuse_state(body)
    choice = body.tool_choice
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages_of(body),
        "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "tools": [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools or ()
        ]
        or None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, FunctionChoice)
        else choice,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # e.g. a tool message without its call: name the input
        error = exc.errors(include_url=False, include_input=False)[0]
        raise OpenAIError(400, f"input: {error['msg']}", param="input", code="invalid_request") from None
