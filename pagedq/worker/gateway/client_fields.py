"""Fields of OpenAI's chat requests that current SDKs and client libraries send and that carry no meaning here:
accepted (bounded as OpenAI bounds them) and ignored, so a library's default request is served instead of refused.
`reasoning_effort` is refused: no model served here reasons, and an ignored effort would pass for one that was
honoured. docs/gateway.md's field table says why each is ignored."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

# OpenAI's bounds of `metadata` (its pairs, keys and values)
MetadataKey = Annotated[str, Field(min_length=1, max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ClientFields(BaseModel):
    """A mixin of the request bodies (schemas.py's ChatCompletionRequest)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # OpenAI's stored completions and dashboards: nothing is stored here beyond the job's record
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    store: bool | None = None
    # OpenAI's processing tiers: one tier here (vLLM's `priority` orders jobs)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # OpenAI's prompt-cache routing hint: the engine's prefix cache matches prompts by their tokens
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    # OpenAI's abuse-detection id of the end user (OpenAI's bound)
    safety_identifier: str | None = Field(default=None, max_length=64)
    # a reasoning model's answer length hint: no model here reads it
    verbosity: Literal["low", "medium", "high"] | None = None
    reasoning_effort: str | None = Field(default=None, max_length=32)

    @field_validator("reasoning_effort")
    @classmethod
    def _no_model_reasons(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        model = info.data.get("model")
        raise PydanticCustomError(
            "no_reasoning",
            "{model} does not reason (no model served here does), so there is no reasoning effort to set; "
            "leave reasoning_effort out",
            {"model": f"model {model!r}" if model else "the model"},
        )
