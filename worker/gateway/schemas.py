"""OpenAI request bodies (POST /v1/completions, /v1/chat/completions) as strict pydantic models.

Unknown fields are refused (400 naming them), never dropped. vLLM's extra sampling parameters that the
engine has are accepted (the SDK sends them through `extra_body`). Every number is bounded; the sampling
parameters' bounds are the engine's table (engine/limits.py), which the job and SamplingParams also read.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import limits as sampling
from worker.protocol.job import MAX_PROMPT_CHARS, bounded, optional

MAX_STOP = 16


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingBody(Strict):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str = Field(min_length=1, max_length=512)
    temperature: float | None = optional(sampling.TEMPERATURE)
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
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)  # vLLM's sense: lower is served first
    # seconds: becomes the job's deadline (the job is expired if it has not finished by then)
    timeout: float | None = Field(default=None, gt=0.0)


class CompletionRequest(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(max_length=MAX_PROMPT_CHARS)
    max_tokens: int | None = optional(sampling.MAX_TOKENS)
    logprobs: int | None = optional(sampling.LOGPROBS)


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
    max_tokens: int | None = optional(sampling.MAX_TOKENS)  # deprecated by OpenAI, still sent
    max_completion_tokens: int | None = optional(sampling.MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = optional(sampling.LOGPROBS)
