"""pagedq worker: a Redis Streams job queue feeding the continuous-batching engine.

Producers only need ``Client`` / ``AsyncClient`` (no torch import); the worker loop lives in worker.worker.
"""

from .aclient import AsyncClient
from .client import Client
from .errors import JobFailed, JobRejected, PagedQError, QueueFullError, ResultTimeout
from .job import Delta, FinalRecord, Job
from .keys import QueueKeys

__all__ = [
    "AsyncClient",
    "Client",
    "Delta",
    "FinalRecord",
    "Job",
    "JobFailed",
    "JobRejected",
    "PagedQError",
    "QueueFullError",
    "QueueKeys",
    "ResultTimeout",
]
