"""Worker settings (one dataclass; the CLI maps flags onto it, tests shorten the intervals)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field


def default_worker_name() -> str:
    # hostname alone is stable across container restarts; the pid keeps two workers on one host apart.
    # Pass an explicit --name to make a restarted worker re-read its own pending jobs at once.
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class WorkerSettings:
    queue: str = "default"
    name: str = field(default_factory=default_worker_name)
    lease_ms: int = 60_000  # a job idle longer than this in a dead worker's pending list is claimed by others
    renew_every_s: float | None = None  # default lease/3
    claim_every_s: float | None = None  # default lease/2
    max_attempts: int = 3  # runs a job gets at most (worker/recovery.py); then it is dead-lettered
    engine_failure_limit: int = 3  # distinct jobs failing alone in a row: the engine is broken, stop (recovery.py)
    result_ttl_s: int = 86_400  # result streams and final records expire after this
    completions_maxlen: int = 100_000  # approximate cap of the shared completions stream
    block_ms: int = 1_000  # XREADGROUP BLOCK when the engine is idle
    max_waiting: int = 64  # jobs read ahead into the engine's waiting queue at most (per band and the bands above)
    band_min_share: float = 0.1  # starvation guard: a lower band's least share of admissions while higher ones are busy
    reserve_seqs: int = 2  # engine sequence slots the bulk band leaves free for the bands above it
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight jobs may take to finish
    redis_outage_s: float = 300.0  # keep generating and retrying this long while Redis is unreachable, then exit
    heartbeat_every_s: float = 5.0
    burst: bool = False  # exit once nothing is queued, pending or running
    device: str = "auto"
    model: str = ""
    # Celery front door (worker/celery_intake.py): on when a broker URL is set
    celery_broker: str | None = None
    celery_backend: str | None = None  # default: the broker
    celery_queue: str | None = None  # default: PAGEDQ_CELERY_QUEUE or "pagedq"
    celery_visibility_timeout_s: float | None = None  # default: PAGEDQ_CELERY_VISIBILITY_TIMEOUT or 3600
    celery_poll_s: float = 0.05  # after an empty poll of the Celery queue, wait this long before the next
    # Prometheus metrics (worker/metrics.py): on when a port is set (0: any free port)
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"  # no authentication: expose it on purpose (--metrics-addr 0.0.0.0)
    metrics_every_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 (the runs a job gets), got {self.max_attempts}")

    @property
    def renew_interval(self) -> float:
        return self.renew_every_s if self.renew_every_s is not None else self.lease_ms / 3000

    @property
    def claim_interval(self) -> float:
        return self.claim_every_s if self.claim_every_s is not None else self.lease_ms / 2000
