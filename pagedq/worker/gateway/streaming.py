"""stream: true as Server-Sent Events in OpenAI's chunk format, read from the jobs' result streams.

A request with several prompts streams them interleaved, each chunk as it comes. A client that goes away
cancels every job of its request (the worker aborts them and frees their KV blocks). The jobs themselves live
in Redis: if the gateway dies mid-stream they finish and their records stay under their ids.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import Any

import structlog
from fastapi.responses import StreamingResponse
from starlette.types import Message, Send

from pagedq.worker.client.async_client import AsyncClient
from pagedq.worker.gateway.completions import CompletionEndpoint
from pagedq.worker.gateway.errors import NO_RETRY, OpenAIError, failure_after_submission, record_error
from pagedq.worker.protocol.errors import ResultTimeout
from pagedq.worker.protocol.job import Delta, FinalRecord

HANDOFF = 8  # items a stream's followers hand over ahead of its consumer
_LOST = object()  # a job whose final record expired between its stream's end and the read


class StreamTracker:
    """Open streams (a metric) and the cancels of abandoned jobs, which must outlive the cancelled stream."""

    def __init__(self) -> None:
        self.open = 0
        self.cancels: set[asyncio.Task] = set()

    def cancel_later(self, client: AsyncClient, job_id: str) -> None:
        task = asyncio.get_running_loop().create_task(_cancel(client, job_id))
        self.cancels.add(task)
        task.add_done_callback(self.cancels.discard)


async def _cancel(client: AsyncClient, job_id: str) -> None:
    try:
        await client.cancel(job_id)
    except Exception as exc:  # Redis gone: the job runs to its end (or deadline), its record stays readable
        structlog.get_logger("pagedq.gateway").warning("cancel_failed", job_id=job_id, error=repr(exc))


class ClientStalled(Exception):
    """The client took no data for the stream's send timeout."""


class SSEResponse(StreamingResponse):
    """A stream of events whose client must keep reading: a send that waits send_timeout_s for the client to take
    data ends the stream, and closing its events cancels its unfinished jobs. While the client does not read,
    each send waits (uvicorn's flow control), so nothing more is read from Redis for it than its buffers hold."""

    def __init__(self, events: AsyncGenerator[bytes, None], send_timeout_s: float) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events, self.send_timeout_s = events, send_timeout_s

    async def stream_response(self, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout_s)
            except asyncio.TimeoutError:
                raise ClientStalled from None

        try:
            await super().stream_response(send_in_time)
        except ClientStalled:  # the connection is left to the server to close: nothing more is sent on it
            structlog.get_logger("pagedq.gateway").warning("stream_stalled", send_timeout_s=self.send_timeout_s)
            await self.events.aclose()


async def _follow(client: AsyncClient, index: int, job_id: str, timeout: float, out: asyncio.Queue) -> None:
    """One job's deltas, then its final record (or the error that ended the wait), into the shared queue."""
    try:
        async for delta in client.stream(job_id, timeout=timeout):
            await out.put((index, delta))
        record = await client.final(job_id)
        await out.put((index, _LOST if record is None else record))
    except Exception as exc:  # ResultTimeout, Redis errors: the consumer raises it
        await out.put((index, exc))


async def interleaved(client: AsyncClient, job_ids: list[str], timeout: float) -> AsyncGenerator[tuple[int, Any], None]:
    """(prompt index, Delta | FinalRecord | _LOST) from every job as it comes; each job ends with its record."""
    queue: asyncio.Queue = asyncio.Queue(HANDOFF)  # bounded: a stream not read stops its followers
    tasks = [asyncio.ensure_future(_follow(client, i, job_id, timeout, queue)) for i, job_id in enumerate(job_ids)]
    try:
        remaining = len(job_ids)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if not isinstance(item, Delta):
                remaining -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


async def sse(
    client: AsyncClient,
    endpoint: CompletionEndpoint,
    job_ids: list[str],
    include_usage: bool,
    timeout: float,
    tracker: StreamTracker,
    retry_after_s: int,
) -> AsyncGenerator[bytes, None]:
    """The request's events. Nothing is yielded before the first job's first delta or final record: a job refused
    before its tokens flow (too long, a bad schema, no grammar backend) raises its OpenAIError from the first
    __anext__, so the caller answers it with the same status as without streaming (hold_start). After that, a
    failure is an error event and a clean end."""
    response_id, settled, records = job_ids[0], set(), []
    started = False
    tracker.open += 1
    try:
        async with contextlib.aclosing(interleaved(client, job_ids, timeout)) as items:
            async for index, item in items:
                if not started:
                    if not isinstance(item, Delta) and (error := _failure(item, job_ids[index], endpoint)) is not None:
                        settled.add(index)
                        raise error
                    started = True
                    for chunk in endpoint.opening(response_id):
                        yield endpoint.frame(chunk, include_usage)
                if isinstance(item, Delta):
                    piece = endpoint.delta_chunk(response_id, index, item)
                    if piece is not None:
                        yield endpoint.frame(piece, include_usage)
                    continue
                settled.add(index)
                error = _failure(item, job_ids[index], endpoint)
                if error is not None:
                    yield endpoint.failure(error)
                    return
                records.append(item)
                for chunk in endpoint.closing(response_id, index, item):
                    yield endpoint.frame(chunk, include_usage)
        yield endpoint.ending(response_id, records, include_usage)
    except ResultTimeout:
        late = OpenAIError(504, f"job {response_id}: no output within {timeout} s", code="timeout", headers=NO_RETRY)
        if not started:
            raise late from None
        yield endpoint.failure(late)
    except OpenAIError:
        raise  # the first item's refusal (hold_start answers it)
    except Exception as exc:  # e.g. Redis lost mid-stream: an error event, then a clean end (its jobs are cancelled)
        if not started:
            raise failure_after_submission(exc, job_ids, retry_after_s) from exc
        yield endpoint.failure(failure_after_submission(exc, job_ids, retry_after_s))
    finally:
        tracker.open -= 1
        for index, job_id in enumerate(job_ids):
            if index not in settled:  # the client went away (or the wait failed): nobody will read the rest
                tracker.cancel_later(client, job_id)


def _failure(item: Any, job_id: str, endpoint: CompletionEndpoint) -> OpenAIError | None:
    """Why a job's stream ends in an error: its record expired, or it did not complete; None if it did."""
    if not isinstance(item, FinalRecord):
        return OpenAIError(500, f"job {job_id}: final record not found", code="lost")
    return None if item.status == "completed" else record_error(item, endpoint.prompt_param)


async def hold_start(events: AsyncGenerator[bytes, None], gone: Awaitable[None]) -> AsyncGenerator[bytes, None]:
    """The stream's events once its first one is known (sse): a refusal before any token raises its OpenAIError
    here, before the response starts; a client that leaves meanwhile gets 499 (its jobs are cancelled)."""
    first = asyncio.ensure_future(events.__anext__())
    left = asyncio.ensure_future(gone)
    try:
        await asyncio.wait((first, left), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if not first.done():
        first.cancel()
        with contextlib.suppress(BaseException):
            await first
        await events.aclose()  # cancels the request's jobs
        raise OpenAIError(499, "the client closed the connection; its jobs were cancelled", code="client_closed")
    try:
        head = first.result()
    except StopAsyncIteration:
        head = b""
    return _after(head, events)


async def _after(head: bytes, events: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    async with contextlib.aclosing(events):
        if head:
            yield head
        async for chunk in events:
            yield chunk
