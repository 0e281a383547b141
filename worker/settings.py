"""Settings of the pagedq commands that talk to Redis, from flags and PAGEDQ_* environment variables.

`QueueSettings` is the part every producer-side command shares (the Redis URL and the queue); a command
adds its own fields in a subclass. Precedence: explicit flags (passed as keywords), then the environment
(`PAGEDQ_REDIS_URL`, `PAGEDQ_QUEUE`, `PAGEDQ_API_KEYS`, ...), then the defaults here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .config import QUEUE_PATTERN


class RedisSettings(BaseSettings):
    """PAGEDQ_REDIS_URL alone, so resolving the URL never trips over another variable (e.g. status' PAGEDQ_QUEUE)."""

    model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="ignore")

    redis_url: str = "redis://localhost:6379/0"


class QueueSettings(RedisSettings):
    queue: str = Field(default="default", pattern=QUEUE_PATTERN)  # 1-100 characters, no braces, colons, spaces


def configured_redis_url(explicit: str | None = None) -> str | None:
    """The Redis URL a command was given: its flag, else PAGEDQ_REDIS_URL; None when neither is set (the worker
    then starts a private redis-server)."""
    if explicit:
        return explicit
    settings = RedisSettings()
    return settings.redis_url if "redis_url" in settings.model_fields_set else None


def redis_url(explicit: str | None = None) -> str:
    """configured_redis_url, falling back to QueueSettings' default (a local Redis): what producers connect to."""
    return configured_redis_url(explicit) or RedisSettings.model_fields["redis_url"].default


class GatewaySettings(QueueSettings):
    """`pagedq serve`: the OpenAI-compatible HTTP gateway (worker/gateway/)."""

    # an open gateway (no API keys) is only reachable from this machine by default
    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8000, ge=0, le=65535, description="port")
    # Bearer tokens accepted; empty: no authentication. PAGEDQ_API_KEYS takes a comma-separated list.
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_queue_depth: int = Field(
        default=10_000, ge=1, le=10_000_000, description="429 beyond this many unfinished jobs"
    )
    retry_after_s: int = Field(default=1, ge=1, le=3600, description="the Retry-After of a 429 (seconds)")
    default_max_tokens: int = Field(
        default=16, ge=1, le=1_000_000, description="max_tokens of a completion that gives none (OpenAI's default)"
    )
    max_timeout_s: float = Field(default=3600.0, gt=0, le=86_400, description="bound on a request's `timeout` (s)")
    worker_cache_s: float = Field(default=1.0, ge=0, le=60, description="seconds the live-worker lookup is reused")
    batch_priority: int = Field(
        default=-100, ge=-1_000_000, le=1_000_000, description="priority of Batch API jobs: below web traffic"
    )
    batch_window: int = Field(default=256, ge=1, le=100_000, description="jobs of one batch in flight at most")
    file_ttl_s: int = Field(
        default=7 * 86_400, ge=60, le=365 * 86_400, description="seconds Files and batches are kept"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log level")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @field_validator("api_keys")
    @classmethod
    def _keys_not_empty(cls, value: list[str]) -> list[str]:
        if any(not k for k in value):
            raise ValueError("API keys must be non-empty")
        return value
