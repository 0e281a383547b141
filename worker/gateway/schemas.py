"""OpenAI request bodies (POST /v1/completions, /v1/chat/completions) as strict pydantic models.

Unknown fields are refused (400 naming them), never dropped. vLLM's extra sampling parameters that the
engine has are accepted (the SDK sends them through `extra_body`). Every number is bounded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from worker.protocol.job import MAX_N, MAX_PROMPT_CHARS

MAX_TOKENS_LIMIT = 1_000_000
SEED_BOUND = 2**63 - 1
MAX_STOP = 16


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingBody(Strict):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str = Field(min_length=1, max_length=512)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP)
    seed: int | None = Field(default=None, ge=-SEED_BOUND, le=SEED_BOUND)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, max_length=256)  # informational, logged
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra parameters (extra_body)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP)
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)  # vLLM's sense: lower is served first
    # seconds: becomes the job's deadline (the job is expired if it has not finished by then)
    timeout: float | None = Field(default=None, gt=0.0)


class CompletionRequest(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(max_length=MAX_PROMPT_CHARS)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(default=None, ge=0, le=20)


class TextPart(Strict):
    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(max_length=MAX_PROMPT_CHARS)
    name: str | None = Field(default=None, max_length=256)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)  # deprecated by OpenAI, still sent
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
