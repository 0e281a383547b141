"""Settings of `pagedq serve` (flags, then PAGEDQ_* variables, then these defaults; pagedq/worker/gateway/serve.py)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from pagedq.worker.protocol.limits import MAX_TENANT_QUEUED, TENANT_PATTERN
from pagedq.worker.protocol.settings import QueueSettings


class GatewaySettings(QueueSettings):
    """`pagedq serve`: the OpenAI-compatible HTTP gateway (pagedq/worker/gateway/)."""

    # an open gateway (no API keys) is only reachable from this machine by default
    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8000, ge=0, le=65535, description="port")
    # Bearer tokens accepted; empty: no authentication. PAGEDQ_API_KEYS takes a comma-separated list.
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_queue_depth: int = Field(
        default=10_000, ge=1, le=10_000_000, description="429 beyond this many unfinished jobs"
    )
    # Tenants (pagedq/worker/service/tenants.py): API key -> tenant, each key also accepted as an API key.
    # PAGEDQ_API_KEY_TENANTS takes KEY=TENANT pairs, comma-separated.
    api_key_tenants: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    max_tenant_queued: int | None = Field(
        default=None, ge=1, le=MAX_TENANT_QUEUED, description="429 beyond this many unfinished jobs of one tenant"
    )
    retry_after_s: int = Field(default=1, ge=1, le=3600, description="the Retry-After of a 429 (seconds)")
    default_max_tokens: int = Field(
        default=16, ge=1, le=1_000_000, description="max_tokens of a completion that gives none (OpenAI's default)"
    )
    max_prompts: int = Field(
        default=256, ge=1, le=100_000, description="prompts of one completions request at most (400 beyond)"
    )
    max_timeout_s: float = Field(default=3600.0, gt=0, le=86_400, description="bound on a request's `timeout` (s)")
    worker_cache_s: float = Field(default=1.0, ge=0, le=60, description="seconds the live-worker lookup is reused")
    batch_priority: int = Field(
        default=100,
        ge=-1_000_000,
        le=1_000_000,
        description="priority of Batch API jobs, vLLM's sense as a request's (lower is sooner): after web traffic",
    )
    batch_window: int = Field(default=256, ge=1, le=100_000, description="jobs of one batch in flight at most")
    file_ttl_s: int = Field(
        default=7 * 86_400, ge=60, le=365 * 86_400, description="seconds Files and batches are kept"
    )
    redis_max_connections: int = Field(
        default=64,
        ge=4,
        le=10_000,
        description="connections to Redis at most (a request waits for a free one, up to redis_socket_timeout_s); "
        "waits share one blocking read, so open requests need no connection each",
    )
    redis_connect_timeout_s: float = Field(
        default=2.0, gt=0, le=60, description="a Redis connection not made within this is an error (503)"
    )
    redis_socket_timeout_s: float = Field(
        default=5.0,
        ge=2,
        le=300,
        description="a Redis reply (or a free connection) not come within this is an error (503); more than the "
        "shared read's 1 s block",
    )
    stream_buffer: int = Field(
        default=64,
        ge=1,
        le=10_000,
        description="result entries read ahead per prompt of a stream at most; past it the gateway stops reading "
        "that job's results (they stay in Redis) until its client reads",
    )
    stream_send_timeout_s: float = Field(
        default=60.0,
        ge=1,
        le=3600,
        description="a stream whose client takes no data for this long is ended and its unfinished jobs cancelled",
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

    @field_validator("api_key_tenants", mode="before")
    @classmethod
    def _split_key_tenants(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        pairs = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            key, sep, tenant = part.rpartition("=")
            if not sep or not key:
                raise ValueError("api_key_tenants takes KEY=TENANT pairs, comma-separated")
            pairs[key.strip()] = tenant.strip()
        return pairs

    @field_validator("api_key_tenants")
    @classmethod
    def _tenants_valid(cls, value: dict[str, str]) -> dict[str, str]:
        for key, tenant in value.items():
            if not key:
                raise ValueError("API keys must be non-empty")
            if not re.fullmatch(TENANT_PATTERN, tenant):
                raise ValueError(f"tenant {tenant!r} (of an API key) must match {TENANT_PATTERN}")
        return value

    @property
    def accepted_keys(self) -> list[str]:
        """Every API key: those of api_keys and those mapped to a tenant."""
        return list(dict.fromkeys([*self.api_keys, *self.api_key_tenants]))
