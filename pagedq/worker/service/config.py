"""Worker settings (one dataclass: its flagged fields are the `pagedq worker` flags; tests shorten the intervals)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedq.worker.protocol.keys import QUEUE_PATTERN
from pagedq.worker.protocol.limits import DEFAULT_TENANT_BURST, MAX_TENANT_BURST
from pagedq.worker.protocol.registry import parse_lora_modules


def default_worker_name() -> str:
    # hostname alone is stable across container restarts; the pid keeps two workers on one host apart.
    # Pass an explicit --name to make a restarted worker re-read its own pending jobs at once.
    return f"{socket.gethostname()}-{os.getpid()}"


def _flag(
    default: object,
    help: str,
    name: str | None = None,
    pattern: str | None = None,
    choices: tuple[str, ...] | None = None,
    factory: Callable[[], object] | None = None,
    many: bool = False,
    **bounds: float,
) -> Any:
    """A field that is also a `pagedq worker` flag and PAGEDQ_* variable (pagedq/worker/flags.py reads this); `name`
    when the flag is not the field's name, `factory` for a default computed per instance (the flag's is None);
    `many`: a list, the flag taking one or more values (and repeatable), the variable comma-separated."""
    spec = {"help": help, "name": name, "bounds": bounds, "pattern": pattern, "choices": choices}
    metadata = {"option": spec | ({"append": True, "many": True} if many else {})}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class WorkerSettings:
    """What one Worker runs with. Fields declared with _flag are `pagedq worker` flags (--name-in-kebab-case, or the
    name given) and PAGEDQ_* variables; the CLI fills them, tests pass keywords (no environment is read here)."""

    queue: str = _flag("default", "queue name", pattern=QUEUE_PATTERN)
    # hostname alone is stable across container restarts; the pid keeps two workers on one host apart.
    name: str = _flag(
        None,
        "consumer name; keep it stable to re-read own pending jobs on restart (default: hostname-pid)",
        factory=default_worker_name,
    )
    # a job idle longer than this in a dead worker's pending list is claimed by others
    lease_ms: int = _flag(60_000, "ms a held job's lease lasts unrenewed before another worker may claim it", ge=1)
    renew_every_s: float | None = None  # default lease/3
    claim_every_s: float | None = None  # default lease/2
    # runs a job gets at most (pagedq/worker/service/recovery.py); then it is dead-lettered
    max_attempts: int = _flag(3, "deliveries of a job before it is dead-lettered", ge=1, le=1000)
    # distinct jobs failing alone in a row: the engine is broken, stop (recovery.py)
    engine_failure_limit: int = _flag(
        3,
        "distinct jobs failing alone in a row after which the engine counts as "
        "broken: the worker exits with status 3, leaving its jobs unacknowledged "
        "for redelivery",
        ge=1,
    )
    result_ttl_s: int = _flag(86_400, "seconds results are kept", "result_ttl", ge=1)
    completions_maxlen: int = _flag(100_000, "approximate length cap of the completions stream", ge=1)
    block_ms: int = _flag(1_000, "ms to block on XREADGROUP when the engine is idle", ge=1, le=60_000)
    # per band and the bands above
    max_waiting: int = _flag(64, "jobs read ahead into the engine's waiting queue at most", ge=1)
    band_min_share: float = _flag(
        0.1, "starvation guard: least share of admissions a lower band keeps while higher ones are busy", ge=0, le=1
    )
    # 0: the engine takes a bulk sequence's seat for a higher band's job (pagedq/engine/core/seats.py); the stub
    # engine cannot
    reserve_seqs: int = _flag(0, "engine sequence slots the bulk band leaves free for interactive/default jobs", ge=0)
    # Tenants share each band by deficit round robin over tokens (pagedq/worker/service/tenants.py)
    tenant_weights: str = _flag("", "tenants' weights in their bands' fair shares, like a=2,b=0.5 (default 1 each)")
    tenant_read_ahead: int = _flag(
        0,
        "jobs per band read ahead past --max-waiting, so tenants behind another's backlog share the band; they are "
        "leased to this worker until it runs them (0: none)",
        ge=0,
        le=100_000,
    )
    tenant_quantum: int = _flag(
        512, "tokens a tenant's turn in the round adds to its share (at weight 1)", ge=1, le=2**31 - 1
    )
    tenant_burst: int = _flag(
        DEFAULT_TENANT_BURST,
        "rounds of turns a tenant that was idle may catch up on when it comes back (a new tenant: all), served "
        "first; 0: plain deficit round robin",
        ge=0,
        le=MAX_TENANT_BURST,
    )
    # Prompt-making (chat template, tokenising: service/prompt_pool.py): small prompts on the loop thread, large ones
    # in a pool, so one large prompt never stops the engine stepping for everyone else
    prompt_workers: int = _flag(
        2, "processes (or threads) making large prompts (chat template, tokenising) off the loop", ge=1, le=64
    )
    prompt_inline_chars: int = _flag(
        65_536,
        "characters of prompt-making the loop thread does itself per turn; a larger prompt is made by the prompt "
        "workers while the engine keeps stepping",
        ge=0,
        le=100_000_000,
    )
    prompt_pool: str = _flag(
        "process",
        "where large prompts are made: process (each with a copy of the tokenizer; a chat template's rendering holds "
        "Python's GIL) or thread",
        pattern=r"^(process|thread)$",
    )
    prompt_wait_s: float = 0.05  # with nothing to step, the loop waits this long at most for a prompt being made
    drain_timeout_s: float = _flag(30.0, "seconds to finish in-flight jobs after SIGTERM", "drain_timeout", ge=0)
    redis_outage_s: float = _flag(
        300.0,
        "seconds to keep generating and reconnecting while Redis is unreachable before exiting with status 4",
        "redis_outage",
        ge=0,
    )
    heartbeat_every_s: float = _flag(5.0, "seconds between heartbeats", "heartbeat_interval", gt=0)
    burst: bool = _flag(False, "exit once nothing is queued, pending or running")
    device: str = "auto"
    model: str = ""
    # Celery front door (pagedq/worker/celery/intake.py): on when a broker URL is set (the CLI: --celery)
    celery_broker: str | None = _flag(None, "Celery broker URL (default: $CELERY_BROKER_URL, else the Redis URL)")
    celery_backend: str | None = _flag(
        None, "Celery result backend URL (default: $CELERY_RESULT_BACKEND, else the broker)"
    )
    celery_queue: str | None = _flag(
        None,
        "Celery queue(s) to serve, a comma list like celery's -Q (default: "
        "pagedq; add celery to serve producers without task_routes)",
    )
    celery_visibility_timeout_s: float | None = _flag(
        None,
        "seconds before an unacked Celery message is redelivered (default 3600); above the longest job",
        "celery_visibility_timeout",
        gt=0,
    )
    celery_poll_s: float = 0.05  # after an empty poll of the Celery queue, wait this long before the next
    # Prometheus metrics (pagedq/worker/ops/metrics.py): on when a port is set (0: any free port)
    metrics_port: int | None = _flag(None, "serve Prometheus metrics on this port (0: any free port)", ge=0, le=65535)
    # no authentication: expose it on purpose (--metrics-addr 0.0.0.0)
    metrics_addr: str = _flag("127.0.0.1", "address the metrics endpoint binds (it has no authentication)")
    metrics_every_s: float = 1.0
    # pagedq/worker/ops/vllm_metrics.py: what dashboards and autoscalers written for vLLM read
    metrics_compat: str = _flag(
        "none",
        "also export the metrics under another server's names: vllm (vllm:num_requests_waiting, "
        "vllm:kv_cache_usage_perc, ... labelled model_name)",
        choices=("none", "vllm"),
    )

    # LoRA adapters this worker serves from its start, vLLM's --lora-modules (service/loras.py); the queue's registry
    # adds those loaded at run time through the gateway
    lora_modules: tuple[str, ...] | None = _flag(
        None,
        "LoRA adapters served from the start, as name=path (PEFT folders; the engine needs --enable-lora); jobs "
        "name them in `lora`, OpenAI requests in `model`",
        pattern=r"^[^=]+=.+$",
        many=True,
    )

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 (the runs a job gets), got {self.max_attempts}")
        parse_lora_modules(self.lora_modules)  # a malformed one: ValueError naming it, before any model loads

    @property
    def renew_interval(self) -> float:
        return self.renew_every_s if self.renew_every_s is not None else self.lease_ms / 3000

    @property
    def claim_interval(self) -> float:
        return self.claim_every_s if self.claim_every_s is not None else self.lease_ms / 2000
