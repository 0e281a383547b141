"""`pagedq serve`: an OpenAI-compatible HTTP gateway over the Redis job queue (FastAPI on uvicorn).

Stateless: every request becomes one job (pagedq/worker/protocol/job.py) submitted with AsyncClient; its answer is read
from the job's final record or result stream, so a gateway can die or be scaled out without losing jobs.
The HTTP stack is imported on first use of ``create_app`` (the CLI registers `serve` without it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from pagedq.worker.gateway.app import create_app

        return create_app
    raise AttributeError(name)
