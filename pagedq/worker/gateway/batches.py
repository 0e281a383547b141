"""The Batch API: POST /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel, on the machinery of
`pagedq bulk` (pagedq/worker/bulk/lines.py: its line parser, job ids, idempotent enqueue script and output lines).

A batch's state is a Redis hash, its output and error files are Redis lists, and the gateway that runs it
holds a lease: if that gateway dies, the next GET of the batch (on any gateway) takes the run over. The
rerun enqueues nothing twice (bulk's enqueue script) and writes no line twice (protocol/scripts.py's append_once).
Batch jobs run at a low priority (settings.batch_priority, vLLM's sense as the requests' own), below interactive
traffic.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import structlog

from pagedq.worker.bulk import lines as bulk_lines
from pagedq.worker.bulk.lines import LineError
from pagedq.worker.client.async_client import AsyncClient
from pagedq.worker.client.core import make_job
from pagedq.worker.gateway.chat import ChatEndpoint
from pagedq.worker.gateway.completions import CompletionEndpoint
from pagedq.worker.gateway.errors import OpenAIError, record_error
from pagedq.worker.gateway.files import FileStore
from pagedq.worker.gateway.object_ids import is_batch_id, new_batch_id, new_file_id
from pagedq.worker.gateway.owners import owns
from pagedq.worker.gateway.schemas import BatchCreate
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.gateway.workers import LiveWorkers
from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.job import FinalRecord, from_vllm_priority
from pagedq.worker.protocol.keys import JOB_FIELD
from pagedq.worker.protocol.replies import text as reply_text
from pagedq.worker.protocol.tool_calls import ToolSpec

LEASE_S = 15
POLL_S = 0.05
ACTIVE = ("validating", "in_progress", "cancelling")
ENDPOINT_KIND = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


class Batches:
    def __init__(self, client: AsyncClient, files: FileStore, live: LiveWorkers, settings: GatewaySettings) -> None:
        self.client, self.files, self.live, self.s = client, files, live, settings
        self.r, self.keys = client.r, client.keys
        self.tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ the batch object
    async def create(self, req: BatchCreate, owner: str) -> dict[str, Any]:
        content = await self.files.owned_content(req.input_file_id, owner)
        batch_id, output_file_id, error_file_id = new_batch_id(), new_file_id(), new_file_id()
        now = int(time.time())
        obj = {
            "id": batch_id,
            "object": "batch",
            "endpoint": req.endpoint,
            "errors": None,
            "input_file_id": req.input_file_id,
            "completion_window": req.completion_window,
            "status": "validating",
            "output_file_id": output_file_id,
            "error_file_id": error_file_id,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + 86_400,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "metadata": req.metadata,
            "total": sum(1 for line in content.splitlines() if line.strip()),
        }
        for kind, file_id in (("output", output_file_id), ("errors", error_file_id)):
            await self.files.declare_lines(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", owner)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), mapping={**{k: json.dumps(v) for k, v in obj.items()}, "owner": owner})
        pipe.expire(self.keys.batch(batch_id), self.s.file_ttl_s)
        await pipe.execute()
        self._start(batch_id)
        return await self.get(batch_id)

    async def get(self, batch_id: str) -> dict[str, Any]:
        raw = await self.r.hgetall(self.keys.batch(batch_id))
        if not raw:
            raise OpenAIError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        raw.pop(b"owner", None)  # not part of the object (and kept as text)
        obj = {reply_text(k): json.loads(v) for k, v in raw.items()}
        completed = await self.r.llen(self.keys.file_lines(obj["output_file_id"]))
        failed = await self.r.llen(self.keys.file_lines(obj["error_file_id"]))
        obj["request_counts"] = {"total": obj.pop("total"), "completed": completed, "failed": failed}
        if obj["status"] in ACTIVE and not await self.r.exists(self.keys.batch_runner(batch_id)):
            self._start(batch_id)  # its gateway went away: run it here (nothing is enqueued or written twice)
        return obj

    async def owned(self, batch_id: str, owner: str) -> str:
        """The batch's id if it exists and `owner` owns it; else the 404 of a missing batch."""
        if is_batch_id(batch_id):
            status, stored = await self.r.hmget(self.keys.batch(batch_id), ["status", "owner"])
            if status is not None and owns(stored, owner):
                return batch_id
        raise OpenAIError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        obj = await self.get(batch_id)
        if obj["status"] in ACTIVE[:2]:
            await self._set(batch_id, status="cancelling", cancelling_at=int(time.time()))
        return await self.get(batch_id)

    async def _set(self, batch_id: str, **fields: Any) -> None:
        await self.r.hset(self.keys.batch(batch_id), mapping={k: json.dumps(v) for k, v in fields.items()})

    def _start(self, batch_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._run(batch_id))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ------------------------------------------------------------------ the run
    async def _run(self, batch_id: str) -> None:
        lease, token = self.keys.batch_runner(batch_id), uuid.uuid4().hex
        if not await self.r.set(lease, token, nx=True, ex=LEASE_S):
            return  # another gateway runs it
        try:
            await BatchRun(self, batch_id, lease).run()
        except Exception as exc:  # e.g. Redis lost: the lease goes, and the next GET of the batch resumes it
            structlog.get_logger("pagedq.gateway").error("batch_run_failed", batch_id=batch_id, error=repr(exc))
        finally:
            if (await self.r.get(lease)) == token.encode():
                await self.r.delete(lease)


class BatchRun:
    """One gateway's run of one batch: a window of jobs in flight, lines written as their jobs finish."""

    def __init__(self, batches: Batches, batch_id: str, lease: str) -> None:
        self.b, self.batch_id, self.lease = batches, batch_id, lease
        # job id -> (custom_id, kind, logprobs k, ToolSpec); a run taking a batch over re-reads its lines to answer
        self.pending: dict[str, tuple[str, str, int | None, ToolSpec | None]] = {}

    async def run(self) -> None:
        b, batch_id = self.b, self.batch_id
        obj = await b.get(batch_id)
        self.obj = obj
        self.model = ""  # what the live workers serve, looked up once the first job has finished
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
        while not exhausted or self.pending:
            await self.b.r.expire(self.lease, LEASE_S)
            if await self._status() == "cancelling":
                exhausted = True  # take nothing more; cancel what is in flight and collect its records
                for job_id in self.pending:
                    await self.b.client.cancel(job_id)
            batch: list[tuple] = []
            while not exhausted and len(self.pending) + len(batch) < self.b.s.batch_window:
                item = next(source, None)
                if item is None:
                    exhausted = True
                elif item[0] == "error":
                    await self._write("errors", item[1], item[2])
                else:
                    batch.append(item[1:])
            if batch:
                await self._enqueue(batch)
            if not await self._collect() and self.pending:
                await asyncio.sleep(POLL_S)

    def _requests(self, content: str, answered: set[str]) -> Iterator[tuple]:
        """("job", custom_id, job, kind, k, tools) per line to run, ("error", answer key, line) per bad line."""
        seen: set[str] = set()
        for line_no, text in enumerate(content.splitlines(), 1):
            if not text.strip():
                continue
            try:
                request = bulk_lines.read_request(text)
                custom_id, fields, kind = request.custom_id, request.fields, request.kind
                if custom_id in seen:
                    raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} appeared on an earlier line")
                seen.add(custom_id)
                if ENDPOINT_KIND[endpoint := self.obj["endpoint"]] != kind:
                    raise LineError("invalid_request", f"line {line_no} does not match the batch's endpoint {endpoint}")
                if custom_id in answered:
                    continue
                fields["priority"] = from_vllm_priority(self.b.s.batch_priority)
                job = make_job(job_id=bulk_lines.job_id_for(self.batch_id, custom_id), **fields)
            except (LineError, JobRejected) as exc:
                code = exc.code if isinstance(exc, LineError) else "invalid_request"
                cid = bulk_lines.custom_id_of(text, exc) if isinstance(exc, LineError) else custom_id
                key = f"line:{line_no}" if code == "duplicate_custom_id" or cid is None else cid
                if key not in answered:
                    yield "error", key, _error_line(cid, line_no, code, str(exc))
                continue
            yield "job", custom_id, job, kind, fields.get("logprobs"), request.tools

    async def _enqueue(self, batch: list[tuple]) -> None:
        args: list[Any] = [self.b.s.file_ttl_s, JOB_FIELD]
        for custom_id, job, kind, k, tools in batch:
            self.pending[job.id] = (custom_id, kind, k, tools)
            args += [job.id, job.to_json()]
        keys = [self.b.keys.jobs_of("bulk"), self.b.keys.bulk_enqueued(self.batch_id), self.b.keys.ids]
        await scripts.acall(self.b.r, "bulk_enqueue", keys, args)

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
        custom_id, kind, k, tools = self.pending.pop(job_id)
        if not self.model:
            self.model = next(iter(sorted(await self.b.live.models())), "")
        if record.status == "completed":
            args = (None, self.model, int(time.time()), k)  # chat: tool_calls, finish_reason as the endpoint's
            endpoint = ChatEndpoint(*args, tools) if kind == "chat" else CompletionEndpoint(*args)
            line = bulk_lines.output_line(custom_id, job_id, {}, kind, body=endpoint.response([record]))
            await self._write("output", custom_id, line)
        else:
            error = record_error(record)
            line = _error_line(custom_id, None, record.status, error.message, job_id)
            line["response"] = {"status_code": error.status, "request_id": job_id, "body": error.body()}
            await self._write("errors", custom_id, line)

    async def _write(self, which: str, key: str, line: dict[str, Any]) -> None:
        file_id = self.obj["output_file_id" if which == "output" else "error_file_id"]
        keys = self.b.keys
        answered, lines = keys.batch_answered(self.batch_id), keys.file_lines(file_id)
        await scripts.acall(
            self.b.r,
            "append_once",
            [answered, keys.batch(self.batch_id), lines, keys.file(file_id)],
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
