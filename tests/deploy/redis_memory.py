"""How much Redis memory a job takes, queued and finished (docs/security.md, "Redis memory"): jobs of a few prompt and
output sizes through a worker thread (the stub engine: one character per token) on a Redis started as compose starts
it, the memory read from INFO before and after. Run: python -m tests.deploy.redis_memory"""

from __future__ import annotations

import tempfile
from pathlib import Path

from redis import Redis

from pagedq.worker import Client
from pagedq.worker.testing.stub_engine import StubEngine
from tests.deploy.redis_acl import acl_redis, producer_prefix
from tests.worker.helpers import worker_thread

JOBS = 1000


def measure(prompt_chars: int, output_tokens: int, stream: bool) -> tuple[float, float]:
    """Bytes per job while queued, and once finished (kept until the result TTL)."""
    with tempfile.TemporaryDirectory() as folder, acl_redis(Path(folder)) as server:
        operator = Redis.from_url(server.url("default"))
        producer = Client(server.url("producer"), job_id_prefix=producer_prefix())
        before = operator.info("memory")["used_memory"]
        jobs = [dict(prompt="x" * prompt_chars, max_tokens=output_tokens, ignore_eos=True, stream=stream)] * JOBS
        ids = producer.submit_many(jobs)
        queued = operator.info("memory")["used_memory"]
        with worker_thread(StubEngine(), server.url("worker")):
            for job_id in ids:
                producer.result(job_id, timeout=60)
        finished = operator.info("memory")["used_memory"]
        return (queued - before) / JOBS, (finished - before) / JOBS


if __name__ == "__main__":
    print("prompt chars | output tokens | streamed | queued bytes/job | finished bytes/job")
    for prompt_chars, output_tokens, stream in [
        (1000, 16, False),
        (4000, 16, False),
        (1000, 256, False),
        (1000, 256, True),
    ]:
        queued, finished = measure(prompt_chars, output_tokens, stream)
        print(f"{prompt_chars} | {output_tokens} | {stream} | {queued:,.0f} | {finished:,.0f}")
