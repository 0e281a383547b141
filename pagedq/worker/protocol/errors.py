"""Exceptions of the queue layer: producers and the worker signal problems with these, never with codes."""

from __future__ import annotations

import errno


class PagedQError(Exception):
    """Base class of every pagedq queue error."""


class JobRejected(PagedQError, ValueError):
    """A job is invalid (bad JSON, unknown or mistyped field, empty or over-long prompt, bad sampling value).

    The client raises it before enqueuing; the worker turns it into a ``rejected`` final record.
    """


class QueueFullError(PagedQError):
    """The queue holds at least ``max_queue_depth`` jobs (or ``tenant`` its ``max_tenant_queued`` unfinished
    ones); nothing was enqueued."""

    def __init__(self, depth: int, limit: int, adding: int = 1, stream: str = "", tenant: str | None = None) -> None:
        where = f" ({stream})" if stream else ""
        whose = f"tenant {tenant!r} is at its limit: " if tenant is not None else ""
        super().__init__(f"queue is full: {whose}{depth} jobs queued, limit {limit}, refusing {adding} more{where}")
        self.depth, self.limit, self.adding, self.stream, self.tenant = depth, limit, adding, stream, tenant


class ResultTimeout(PagedQError, TimeoutError):
    """No final record arrived within the timeout."""


class JobFailed(PagedQError):
    """Raised by ``FinalRecord.raise_for_status()`` when a job did not complete."""

    def __init__(self, record: object) -> None:
        status = getattr(record, "status", "?")
        super().__init__(f"job {getattr(record, 'id', '?')} {status}: {getattr(record, 'error', None)}")
        self.record = record


class GenerationFailed(PagedQError):
    """A job ended ``failed`` (engine error past max_attempts; the job is dead-lettered). Celery producers
    see it from ``AsyncResult.get()``; the message says why."""


class MetricsPortError(PagedQError, OSError):
    """The metrics endpoint cannot bind its port; the message names the flag to change (`--metrics-port`)."""

    flag = "--metrics-port"

    def __init__(self, port: int, addr: str, cause: OSError) -> None:
        reasons = {
            errno.EADDRINUSE: "is in use (another worker or program holds it): pick a free port",
            errno.EACCES: "needs privileges (a port below 1024): pick one above 1024",
            errno.EADDRNOTAVAIL: f"cannot be bound: --metrics-addr {addr} is not an address of this machine",
        }
        reason = reasons.get(cause.errno or 0, f"cannot be bound on {addr}: {cause.strerror or cause}")
        super().__init__(cause.errno, f"{self.flag} {port} {reason}")
        self.port, self.addr = port, addr

    def __str__(self) -> str:  # OSError's would prefix "[Errno N]"; the message already says what to do
        return str(self.strerror)
