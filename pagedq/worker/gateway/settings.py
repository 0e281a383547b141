"""Settings of `pagedq serve` (flags, then PAGEDQ_* variables, then these defaults; pagedq/worker/gateway/serve.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from pagedq.worker.protocol.limits import MAX_TENANT_QUEUED, TENANT_PATTERN
from pagedq.worker.protocol.settings import QueueSettings
from pagedq.worker.protocol.tool_calls import DEFAULT_MAX_TOOL_CALLS


class GatewaySettings(QueueSettings):
    """`pagedq serve`: the OpenAI-compatible HTTP gateway (pagedq/worker/gateway/)."""

    # a rejected value is never echoed: API keys are values here
    model_config = SettingsConfigDict(hide_input_in_errors=True)

    # an open gateway (no API keys) is only reachable from this machine by default
    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8000, ge=0, le=65535, description="port")
    # Bearer tokens accepted; empty: no authentication. PAGEDQ_API_KEYS takes a comma-separated list; keys are
    # never flags (a command line is visible to every user of the machine): see also api_key_file.
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_queue_depth: int = Field(
        default=10_000, ge=1, le=10_000_000, description="429 beyond this many unfinished jobs"
    )
    # Tenants (pagedq/worker/service/tenants.py): API key -> tenant, each key also accepted as an API key.
    # PAGEDQ_API_KEY_TENANTS takes KEY=TENANT pairs, comma-separated.
    api_key_tenants: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    # LoRA adapters at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter: gateway/lora_routes.py), off
    # as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING is: a registered path is read by every worker of the queue, for every
    # tenant. With API keys, only PAGEDQ_ADMIN_API_KEYS (environment only, never a flag) may call them.
    allow_runtime_lora_updating: bool = Field(
        default=False,
        description="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with API keys: admin keys only)",
    )
    admin_api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    api_key_file: Path | None = Field(
        default=None, description="file of API keys, one KEY or KEY=TENANT a line (# comments), added to the others"
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Host names accepted besides localhost, IP literals and --host; checked with no API keys, or "
        "when set; also the origins a keyless gateway accepts; * accepts any",
    )
    # Parsing holds the event loop (docs/gateway.md, "Before a route runs"): the default fits 256 prompts of 32 KiB
    # of text, or 128 tools with 16 KiB schemas and a long conversation, and bounds the time one body can take.
    max_json_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        le=1024**3,
        description="largest JSON request body (413 beyond; /v1/files takes a 200 MB file)",
    )
    header_timeout_s: float = Field(
        default=10.0, ge=0.1, le=3600, description="seconds a connection has to send a request's headers"
    )
    max_header_bytes: int = Field(
        default=64 * 1024, ge=1024, le=16 * 1024 * 1024, description="largest request line and headers (431 beyond)"
    )
    body_timeout_s: float = Field(
        default=30.0, ge=0.1, le=3600, description="seconds a request has to send its body, plus body_min_rate's share"
    )
    body_min_rate: int = Field(
        default=64 * 1024,
        ge=1,
        le=1024**3,
        description="bytes a second a body must arrive at beyond body_timeout_s (each such many bytes earn a second)",
    )
    max_connections: int = Field(
        default=1000, ge=1, le=1_000_000, description="open connections (and requests) at most; 503 beyond"
    )
    max_tenant_queued: int | None = Field(
        default=None, ge=1, le=MAX_TENANT_QUEUED, description="429 beyond this many unfinished jobs of one tenant"
    )
    retry_after_s: int = Field(default=1, ge=1, le=3600, description="the Retry-After of a 429 (seconds)")
    default_max_tokens: int = Field(
        default=16,
        ge=1,
        le=1_000_000,
        description="max_tokens of a (legacy) completion that gives none (OpenAI's default); not chat's",
    )
    default_chat_max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="max_tokens of a chat completion that gives none; unset: the rest of the model's context after "
        "the prompt (OpenAI's and vLLM's)",
    )
    max_prompts: int = Field(
        default=256, ge=1, le=100_000, description="prompts of one completions request at most (400 beyond)"
    )
    max_timeout_s: float = Field(default=3600.0, gt=0, le=86_400, description="bound on a request's `timeout` (s)")
    max_tool_calls: int = Field(
        default=DEFAULT_MAX_TOOL_CALLS,
        ge=1,
        le=1024,
        description='calls of one tool_choice "required" answer at most, when parallel_tool_calls allows more than one',
    )
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
    max_files_per_owner: int = Field(
        default=1000,
        ge=1,
        le=1_000_000,
        description="uploaded files one owner (a tenant, or a plain API key) keeps at once (429 beyond)",
    )
    max_file_bytes_per_owner: int = Field(
        default=2**30,
        ge=1,
        le=2**40,
        description="bytes of uploaded files one owner (a tenant, or a plain API key) keeps at once (429 beyond)",
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

    @field_validator("api_keys", "admin_api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _keys_not_empty(cls, value: list[str]) -> list[str]:
        if any(not k for k in value):
            raise ValueError("API keys must be non-empty")
        return value

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: object) -> object:
        if isinstance(value, str):
            return [h.strip().lower() for h in value.split(",") if h.strip()]
        return value

    @field_validator("api_key_tenants", mode="before")
    @classmethod
    def _split_key_tenants(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        pairs = {}
        for number, part in enumerate(filter(None, (p.strip() for p in value.split(","))), 1):
            key, sep, tenant = part.rpartition("=")
            if not sep or not key.strip():
                # the pair's position only: the text is a key
                raise ValueError(f"api_key_tenants takes KEY=TENANT pairs, comma-separated (pair {number} is not)")
            pairs[key.strip()] = tenant.strip()
        return pairs

    @field_validator("api_key_tenants")
    @classmethod
    def _tenants_valid(cls, value: dict[str, str]) -> dict[str, str]:
        for number, (key, tenant) in enumerate(value.items(), 1):
            if not key:
                raise ValueError("API keys must be non-empty")
            _check_tenant(tenant, f"api_key_tenants pair {number}")
        return value

    @model_validator(mode="after")
    def _read_key_file(self) -> GatewaySettings:
        if self.api_key_file is None:
            return self
        try:
            text = self.api_key_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"api_key_file {str(self.api_key_file)!r}: {exc.__class__.__name__}") from None
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, tenant = line.rpartition("=")
            if not sep:
                self.api_keys.append(line)
                continue
            if not key.strip():
                raise ValueError(f"api_key_file {str(self.api_key_file)!r} line {number}: takes KEY or KEY=TENANT")
            _check_tenant(tenant.strip(), f"api_key_file {str(self.api_key_file)!r} line {number}")
            self.api_key_tenants[key.strip()] = tenant.strip()
        return self

    @model_validator(mode="after")
    def _lora_updates_need_an_admin(self) -> GatewaySettings:
        if self.allow_runtime_lora_updating and self.accepted_keys and not self.admin_api_keys:
            raise ValueError(
                "allow_runtime_lora_updating with API keys needs PAGEDQ_ADMIN_API_KEYS: the adapters one registers "
                "serve every tenant, so a tenant's key may not"
            )
        return self

    @property
    def accepted_keys(self) -> list[str]:
        """Every API key: those of api_keys, those mapped to a tenant, and the admin keys."""
        return list(dict.fromkeys([*self.api_keys, *self.api_key_tenants, *self.admin_api_keys]))


def _check_tenant(tenant: str, where: str) -> None:
    """The tenant is not echoed: in a malformed pair it may be part of a key."""
    if not re.fullmatch(TENANT_PATTERN, tenant):
        raise ValueError(f"{where}: the tenant after the last = must match {TENANT_PATTERN}")
