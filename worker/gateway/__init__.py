"""`pagedq serve`: an OpenAI-compatible HTTP gateway over the Redis job queue (FastAPI on uvicorn).

Stateless: every request becomes one job (worker/job.py) submitted with AsyncClient; its answer is read
from the job's final record or result stream, so a gateway can die or be scaled out without losing jobs.
"""

from .app import create_app

__all__ = ["create_app"]
