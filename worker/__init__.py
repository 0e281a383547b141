"""pagedq worker: a Redis Streams job queue feeding the continuous-batching engine.

Producers only need ``Client`` / ``AsyncClient`` (no torch import); the worker is worker.assembly.Worker
(its loop: worker.service.loop).
"""

from worker.client.async_client import AsyncClient
from worker.client.sync_client import Client
from worker.protocol.errors import JobFailed, JobRejected, PagedQError, QueueFullError, ResultTimeout
from worker.protocol.job import Delta, FinalRecord, Job
from worker.protocol.keys import QueueKeys

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
