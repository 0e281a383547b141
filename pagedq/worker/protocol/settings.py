"""Settings of the pagedq commands that talk to Redis, from flags and PAGEDQ_* environment variables.

`QueueSettings` is the part every producer-side command shares (the Redis URL and the queue); a command
adds its own fields in a subclass. Precedence: explicit flags (passed as keywords), then the environment
(`PAGEDQ_REDIS_URL`, `PAGEDQ_QUEUE`, `PAGEDQ_API_KEYS`, ...), then the defaults here.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagedq.worker.protocol.keys import QUEUE_PATTERN


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
