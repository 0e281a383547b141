"""One gateway's run of one batch of the Batch API (gateway/batches.py holds the batch objects and the lease): its
lines read from the input file, their jobs enqueued as the caller's tenant within a window and within the queue's
limits (bulk/admission.py: a batch waits for room, it never fails for being big, and never crowds out requests),
its output and error lines written as the jobs finish."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from pagedq.worker.bulk import lines as bulk_lines
from pagedq.worker.bulk.admission import Admission
from pagedq.worker.bulk.lines import JSON_WHITESPACE, LineError
from pagedq.worker.client.async_client import AsyncClient
from pagedq.worker.client.core import make_job
from pagedq.worker.gateway.chat import ChatEndpoint
from pagedq.worker.gateway.completions import CompletionEndpoint
from pagedq.worker.gateway.errors import OpenAIError, record_error
from pagedq.worker.gateway.files import FileStore
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.gateway.workers import LiveWorkers
from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.connection import AsyncRedis
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.job import FinalRecord, Job, from_vllm_priority
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.protocol.replies import text as reply_text
from pagedq.worker.protocol.tool_calls import ToolSpec


class Batches(Protocol):
    """What a run uses of the batches (gateway/batches.py's Batches)."""

    client: AsyncClient
    files: FileStore
    live: LiveWorkers
    s: GatewaySettings
    r: AsyncRedis
    keys: QueueKeys

    async def get(self, batch_id: str) -> dict[str, Any]: ...

    async def _set(self, batch_id: str, **fields: Any) -> None: ...


LEASE_S = 15
POLL_S = 0.05
ENDPOINT_KIND = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}

Item = tuple[str, Job, str, int | None, ToolSpec | None]  # custom_id, job, kind, logprobs k, ToolSpec


class BatchRun:
    """One gateway's run of one batch: a window of jobs in flight, lines written as their jobs finish."""

    def __init__(self, batches: Batches, batch_id: str, lease: str) -> None:
        self.b, self.batch_id, self.lease = batches, batch_id, lease
        # job id -> (custom_id, kind, logprobs k, ToolSpec, job); a run taking a batch over re-reads its lines
        self.pending: dict[str, tuple[str, str, int | None, ToolSpec | None, Job]] = {}
        self.waiting: deque[Item] = deque()  # read, not admitted yet (the queue is at a limit), or again: expired

    async def run(self) -> None:
        b, batch_id = self.b, self.batch_id
        obj = await b.get(batch_id)
        self.obj = obj
        self.model = ""  # what the live workers serve, looked up once the first job has finished
        tenant = json.loads(await b.r.hget(b.keys.batch(batch_id), "tenant") or "null")
        self.tenant: str | None = tenant
        s = b.s
        self.admission = Admission(
            b.keys, "bulk", batch_id, s.file_ttl_s, s.max_queue_depth, tenant, s.max_tenant_queued
        )
        if obj["status"] == "validating":
            await b._set(batch_id, status="in_progress", in_progress_at=int(time.time()))
        answered = {reply_text(a) for a in await b.r.smembers(b.keys.batch_answered(batch_id))}
        try:
            content = (await b.files.content(obj["input_file_id"])).decode("utf-8")
        except (UnicodeDecodeError, OpenAIError) as exc:  # not UTF-8, or the input file expired
            reason = "the input file is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc.message
            await b._set(
                batch_id,
                status="failed",
                failed_at=int(time.time()),
                errors={
                    "object": "list",
                    "data": [{"code": "invalid_file", "message": reason, "param": "input_file_id", "line": None}],
                },
            )
            return
        self.adapters = set(await b.live.adapters())  # a line whose body's model names one runs under it
        source = self._requests(content, answered)
        await self._loop(source)
        status = await self._status()
        now = int(time.time())
        if status == "cancelling":
            await b._set(batch_id, status="cancelled", cancelled_at=now)
        else:
            await b._set(batch_id, status="completed", finalizing_at=now, completed_at=now)

    async def _status(self) -> str:
        raw = await self.b.r.hget(self.b.keys.batch(self.batch_id), "status")
        if raw is None:  # its hash expired (file_ttl_s) under the runner
            raise RuntimeError(f"batch {self.batch_id} is gone: its record expired while it ran")
        return json.loads(raw)

    async def _loop(self, source: Iterator) -> None:
        exhausted = False
        while not exhausted or self.pending or self.waiting:
            await self.b.r.expire(self.lease, LEASE_S)
            if await self._status() == "cancelling":
                exhausted = True  # take nothing more; cancel what is in flight and collect its records
                self.waiting.clear()  # never enqueued: like the lines not read, they get no line
                for job_id in self.pending:
                    await self.b.client.cancel(job_id)
            while not exhausted and len(self.pending) + len(self.waiting) < self.b.s.batch_window:
                item = next(source, None)
                if item is None:
                    exhausted = True
                elif item[0] == "error":
                    await self._write("errors", item[1], item[2])
                else:
                    self.waiting.append(item[1:])
            if self.waiting:
                await self._enqueue()
            if not await self._collect() and (self.pending or self.waiting):
                await self._requeue_expired()
                await asyncio.sleep(POLL_S)

    def _requests(self, content: str, answered: set[str]) -> Iterator[tuple]:
        """("job", custom_id, job, kind, k, tools) per line to run, ("error", answer key, line) per bad line.
        Lines are split on "\\n" only (bulk_lines.split_lines: a JSON string may hold U+2028 unescaped)."""
        seen: set[str] = set()
        for line_no, text in enumerate(bulk_lines.split_lines(content), 1):
            if not text.strip(JSON_WHITESPACE):
                continue
            try:
                request = bulk_lines.read_request(text, self.b.s.max_tool_calls, self.adapters)
                custom_id, fields, kind = request.custom_id, request.fields, request.kind
                if custom_id in seen:
                    raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} appeared on an earlier line")
                seen.add(custom_id)
                if ENDPOINT_KIND[endpoint := self.obj["endpoint"]] != kind:
                    raise LineError("invalid_request", f"line {line_no} does not match the batch's endpoint {endpoint}")
                if "tenant" in fields:  # OpenAI's lines have none; a line choosing one would act as another tenant
                    raise LineError("invalid_request", "tenant: a batch's jobs run as the tenant of its API key")
                if custom_id in answered:
                    continue
                fields["priority"] = from_vllm_priority(self.b.s.batch_priority)
                if self.tenant is not None:
                    fields["tenant"] = self.tenant
                job = make_job(job_id=bulk_lines.job_id_for(self.batch_id, custom_id), **fields)
            except (LineError, JobRejected) as exc:
                code = exc.code if isinstance(exc, LineError) else "invalid_request"
                cid = bulk_lines.custom_id_of(text, exc) if isinstance(exc, LineError) else custom_id
                key = f"line:{line_no}" if code == "duplicate_custom_id" or cid is None else cid
                if key not in answered:
                    yield "error", key, _error_line(cid, line_no, code, str(exc))
                continue
            yield "job", custom_id, job, kind, fields.get("logprobs"), request.tools

    async def _enqueue(self) -> None:
        """The jobs waiting, in order, as far as the queue's limits (the caller's) let them in now."""
        batch = list(self.waiting)
        keys, args = self.admission.enqueue([job for _, job, _, _, _ in batch])
        taken, _ = self.admission.taken(await scripts.acall(self.b.r, "bulk_enqueue", keys, args))
        for custom_id, job, kind, k, tools in batch[:taken]:
            self.waiting.popleft()
            self.pending[job.id] = (custom_id, kind, k, tools, job)

    async def _requeue_expired(self) -> None:
        """Jobs whose result expired before this run collected it (a run resumed late) are enqueued again."""
        if not self.pending or not self.admission.expiry_due():
            return
        ids = list(self.pending)
        for i in range(0, len(ids), 1000):
            keys, args = self.admission.forget_expired(ids[i : i + 1000])
            for job_id in map(reply_text, await scripts.acall(self.b.r, "forget_expired", keys, args)):
                custom_id, kind, k, tools, job = self.pending.pop(job_id)
                self.waiting.appendleft((custom_id, job, kind, k, tools))

    async def _collect(self) -> int:
        ids = list(self.pending)
        finished = 0
        for i in range(0, len(ids), 1000):
            chunk = ids[i : i + 1000]
            for job_id, raw in zip(chunk, await self.b.r.mget([self.b.keys.final(j) for j in chunk])):
                if raw is not None:
                    await self._answer(job_id, FinalRecord.model_validate_json(raw))
                    finished += 1
        return finished

    async def _answer(self, job_id: str, record: FinalRecord) -> None:
        custom_id, kind, k, tools, job = self.pending.pop(job_id)
        if not self.model:
            self.model = next(iter(sorted(await self.b.live.models())), "")
        if record.status == "completed":
            # chat: tool_calls, finish_reason as the endpoint's; a line run under an adapter names it, as the API's
            args = (None, job.lora or self.model, int(time.time()), k)
            endpoint = ChatEndpoint(*args, tools) if kind == "chat" else CompletionEndpoint(*args)
            line = bulk_lines.output_line(custom_id, job_id, {}, kind, body=endpoint.response([record]))
            await self._write("output", custom_id, line)
        else:
            error = record_error(record, "messages" if kind == "chat" else "prompt")
            line = _error_line(custom_id, None, record.status, error.message, job_id)
            line["response"] = {"status_code": error.status, "request_id": job_id, "body": error.body()}
            await self._write("errors", custom_id, line)

    async def _write(self, which: str, key: str, line: dict[str, Any]) -> None:
        file_id = self.obj["output_file_id" if which == "output" else "error_file_id"]
        keys = self.b.keys
        await scripts.acall(
            self.b.r,
            "append_once",
            [
                keys.batch_answered(self.batch_id),
                keys.batch(self.batch_id),
                keys.file_lines(file_id),
                keys.file(file_id),
            ],
            [key, json.dumps(line)],
        )


def _error_line(
    custom_id: str | None, line_no: int | None, code: str, message: str, job_id: str | None = None
) -> dict[str, Any]:
    """bulk's error line in OpenAI's shape (which has no line number: the message names it)."""
    entry = bulk_lines.error_line(
        custom_id, line_no or 0, code, message if line_no is None else f"line {line_no}: {message}", job_id
    )
    entry.pop("line")
    return entry
