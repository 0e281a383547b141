"""What every part of the service loop shares, built once by the loop (ServiceContext.build): the Redis client, the
queue's keys, the settings, the log, the counters, the held jobs and the stop flag. Each part (publisher, intake,
leases, exchange, recovery, finisher, holding, timers) takes the context plus what is its own."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedq.worker import telemetry
from pagedq.worker.logs import worker_logger
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.counters import Counters
from pagedq.worker.service.held import HeldJobs

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from pagedq.worker.service.job_spans import JobSpans


@dataclass
class Stop:
    """Whether and when the loop stops, and with what status: set by the loop (signals, drain) and by recovery
    (at once)."""

    requested: bool = False
    by: float = math.inf  # time.monotonic() past which in-flight jobs are left unacknowledged
    exit_code: int = 0

    def now(self, exit_code: int) -> None:
        self.exit_code = self.exit_code or exit_code
        self.requested, self.by = True, 0.0


@dataclass(frozen=True)
class ServiceContext:
    redis: Any  # redis.Redis or redis.cluster.RedisCluster (protocol/connection.py connects either)
    keys: QueueKeys
    settings: WorkerSettings
    log: FilteringBoundLogger  # bound to the worker's name
    counters: Counters
    held: HeldJobs  # every job this worker holds, by JobKey, each with its JobState
    stop: Stop
    spans: JobSpans | None = None  # the jobs' spans, when tracing is on (pagedq/worker/telemetry/)

    @classmethod
    def build(cls, redis_client: Any, settings: WorkerSettings) -> ServiceContext:
        return cls(
            redis=redis_client,
            keys=QueueKeys(settings.queue),
            settings=settings,
            log=worker_logger(settings.name),
            counters=Counters(),
            held=HeldJobs(),
            stop=Stop(),
            spans=job_spans(settings),
        )


def job_spans(settings: WorkerSettings) -> JobSpans | None:
    """The jobs' spans when this process traces; OpenTelemetry is imported only then."""
    provider = telemetry.provider()
    if provider is None:
        return None
    from pagedq.worker.service.job_spans import JobSpans

    return JobSpans(provider, settings)
