"""OpenAI request bodies (POST /v1/completions, /v1/chat/completions, /v1/batches) as strict pydantic models.

Unknown fields are refused (400 naming them), never dropped. vLLM's extra sampling parameters that the
engine has are accepted (the SDK sends them through `extra_body`). Every number is bounded; the sampling
parameters' bounds are the engine's table (pagedq/engine/limits.py), which the job and SamplingParams also read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedq.engine import limits as sampling
from pagedq.worker.gateway.client_fields import ClientFields
from pagedq.worker.protocol.job import (
    MAX_PROMPT_CHARS,
    LogitBias,
    TokenId,
    bounded,
    optional,
    structured_outputs_wire,
    token_id_keys,
)

MAX_STOP = 16
# content parts of other modalities than text (OpenAI's types), refused by name: the served models read text
OTHER_MODALITIES = {"image_url": "image", "input_image": "image", "input_audio": "audio", "file": "file"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: accepted; usage comes in the last chunk (include_usage)


class JsonSchemaFormat(Strict):
    """response_format's json_schema (OpenAI's shape); `strict` is accepted: the schema is always enforced."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = Field(default=None, max_length=4096)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingBody(Strict):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str = Field(min_length=1, max_length=512)
    temperature: float | None = optional(sampling.TEMPERATURE.on_openai())  # OpenAI's 0..2
    top_p: float | None = optional(sampling.TOP_P)
    n: int = bounded(sampling.N)
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP)
    seed: int | None = optional(sampling.SEED)
    presence_penalty: float = bounded(sampling.PRESENCE_PENALTY)
    frequency_penalty: float = bounded(sampling.FREQUENCY_PENALTY)
    user: str | None = Field(default=None, max_length=256)  # informational, logged
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra parameters (extra_body)
    top_k: int | None = optional(sampling.TOP_K)
    min_p: float | None = optional(sampling.MIN_P)
    repetition_penalty: float | None = optional(sampling.REPETITION_PENALTY)
    min_tokens: int = bounded(sampling.MIN_TOKENS)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP)
    include_stop_str_in_output: bool = False
    # token strings in logprobs as "token_id:<id>" (vLLM's), not as the tokens' text
    return_tokens_as_token_ids: bool = False
    # OpenAI's: token id (a string key in JSON) -> bias in [-100, 100], at most 300 (vLLM's bounds)
    logit_bias: dict[TokenId, LogitBias] | None = Field(default=None, max_length=sampling.LOGIT_BIAS_MAX_ENTRIES)
    _logit_bias_keys = field_validator("logit_bias", mode="before")(lambda value: token_id_keys(value))
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)  # vLLM's sense: lower is served first
    # seconds: becomes the job's deadline (the job is expired if it has not finished by then)
    timeout: float | None = Field(default=None, gt=0.0)
    # OpenAI's output constraint (json_object / json_schema), or vLLM's own (json | regex | choice | grammar)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    _structured_outputs = field_validator("structured_outputs", mode="before")(structured_outputs_wire)


Prompt = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
TokenPrompt = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_CHARS)]


class CompletionRequest(SamplingBody):
    # OpenAI's four forms: a string, a list of strings, a token list, a list of token lists (one job each)
    prompt: Prompt | list[TokenId] | list[Prompt] | list[TokenPrompt] = Field(max_length=MAX_PROMPT_CHARS)
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's too)
    best_of: int | None = optional(sampling.BEST_OF)
    suffix: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)  # refused when given (as vLLM)
    max_tokens: int | None = Field(None, ge=0, le=sampling.MAX_TOKENS.high)  # 0: only with echo (score the prompt)
    logprobs: int | None = optional(sampling.LOGPROBS)

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens 0 needs echo: true (it scores the prompt without generating)")
        return value


class TextPart(Strict):
    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class CalledFunction(Strict):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS)  # JSON text, as the model wrote it


class ToolCall(Strict):
    """A call an assistant message of the history made (the tool_calls of an earlier response, sent back)."""

    id: str = Field(max_length=256)
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)  # assistant
    tool_call_id: str | None = Field(default=None, max_length=256)  # tool: the call it answers
    # what the SDK sends back with an earlier response's message object (always null here)
    refusal: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        """A part of another modality (OpenAI's image_url, input_audio, file) is named as such, not answered with
        the union's errors for every shape content may take."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in OTHER_MODALITIES:
                raise PydanticCustomError(
                    "unsupported_modality", f"{OTHER_MODALITIES[kind]} input is not supported by this model"
                )
        return content

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r} ones")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id belongs to tool messages, and every tool message needs one")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's tool calls may go without)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Strict):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


# ClientFields' fields validate after SamplingBody's (pydantic orders fields by the bases' reversed MRO): its
# refusal of reasoning_effort names the model
class ChatCompletionRequest(ClientFields, SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = optional(sampling.MAX_TOKENS)  # deprecated by OpenAI, still sent
    max_completion_tokens: int | None = optional(sampling.MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = optional(sampling.LOGPROBS)


class BatchCreate(Strict):
    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
