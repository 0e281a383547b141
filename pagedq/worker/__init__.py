"""pagedq worker: a Redis Streams job queue feeding the continuous-batching engine.

Producers only need ``Client`` / ``AsyncClient`` (no torch import); the worker is pagedq.worker.assembly.Worker
(its loop: pagedq.worker.service.loop).
"""

from pagedq.worker.client.async_client import AsyncClient
from pagedq.worker.client.sync_client import Client
from pagedq.worker.protocol.errors import JobFailed, JobRejected, PagedQError, QueueFullError, ResultTimeout
from pagedq.worker.protocol.job import Delta, FinalRecord, Job
from pagedq.worker.protocol.keys import QueueKeys

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
