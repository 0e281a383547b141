"""stream: true as Server-Sent Events in OpenAI's chunk format, read from the job's result stream.

A client that goes away cancels its job (the worker aborts it and frees its KV blocks). The job itself
lives in Redis: if the gateway dies mid-stream the job finishes and its record stays under its id.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from worker.client.async_client import AsyncClient
from worker.gateway.completions import CompletionEndpoint
from worker.gateway.errors import OpenAIError, record_error
from worker.gateway.render import usage
from worker.protocol.errors import ResultTimeout

DONE = b"data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class StreamTracker:
    """Open streams (a metric) and the cancels of abandoned jobs, which must outlive the cancelled stream."""

    def __init__(self) -> None:
        self.open = 0
        self.cancels: set[asyncio.Task] = set()

    def cancel_later(self, client: AsyncClient, job_id: str) -> None:
        task = asyncio.get_running_loop().create_task(client.cancel(job_id))
        self.cancels.add(task)
        task.add_done_callback(self.cancels.discard)


async def sse(
    client: AsyncClient,
    endpoint: CompletionEndpoint,
    job_id: str,
    include_usage: bool,
    timeout: float,
    tracker: StreamTracker,
) -> AsyncIterator[bytes]:
    finished = False
    tracker.open += 1
    try:
        for chunk in endpoint.opening(job_id):
            yield event(_with_usage(chunk, include_usage))
        async for delta in client.stream(job_id, timeout=timeout):
            yield event(_with_usage(endpoint.delta_chunk(job_id, delta), include_usage))
        record = await client.final(job_id)
        finished = True
        if record is None:  # the result expired between the stream's end and this read
            yield event(OpenAIError(500, f"job {job_id}: final record not found", code="lost").body())
        elif record.status != "completed":
            yield event(record_error(record).body())
        else:
            for chunk in endpoint.closing(record):
                yield event(_with_usage(chunk, include_usage))
            if include_usage:
                yield event(
                    {**endpoint.envelope(job_id, []), "object": _chunk_object(endpoint), "usage": usage(record)}
                )
        yield DONE
    except ResultTimeout:
        yield event(OpenAIError(504, f"job {job_id}: no output within {timeout} s", code="timeout").body())
        yield DONE
    finally:
        tracker.open -= 1
        if not finished:  # the client went away (or the wait timed out): nobody will read the rest
            tracker.cancel_later(client, job_id)


def _chunk_object(endpoint: CompletionEndpoint) -> str:
    return "chat.completion.chunk" if endpoint.object_name == "chat.completion" else endpoint.object_name


def _with_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    return {**chunk, "usage": None} if include_usage else chunk
