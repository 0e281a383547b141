"""The Batch API: POST /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel, on the machinery of
`pagedq bulk` (pagedq/worker/bulk/lines.py: its line parser, job ids, idempotent enqueue script and output lines).

A batch's state is a Redis hash, its output and error files are Redis lists, and the gateway that runs it
holds a lease: if that gateway dies, the next GET of the batch (on any gateway) takes the run over. The
rerun enqueues nothing twice (bulk's enqueue script) and writes no line twice (protocol/scripts.py's append_once).
Batch jobs run at a low priority (settings.batch_priority, vLLM's sense as the requests' own), below interactive
traffic, as the tenant of the API key that created the batch, and within that caller's queue limits (the run:
gateway/batch_run.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

import structlog
from fastapi import APIRouter, Request
from pydantic import Field

from pagedq.worker.bulk.lines import JSON_WHITESPACE
from pagedq.worker.client.async_client import AsyncClient
from pagedq.worker.gateway.batch_run import LEASE_S, BatchRun
from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.files import FileStore
from pagedq.worker.gateway.schemas import Strict
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.gateway.workers import LiveWorkers
from pagedq.worker.protocol.replies import text as reply_text

ACTIVE = ("validating", "in_progress", "cancelling")


class BatchCreate(Strict):
    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class Batches:
    def __init__(self, client: AsyncClient, files: FileStore, live: LiveWorkers, settings: GatewaySettings) -> None:
        self.client, self.files, self.live, self.s = client, files, live, settings
        self.r, self.keys = client.r, client.keys
        self.tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ the batch object
    async def create(self, req: BatchCreate, tenant: str | None = None) -> dict[str, Any]:
        """tenant: the caller's (its API key's), which every line's job runs as and is counted against."""
        content = await self.files.content(req.input_file_id)
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        output_file_id, error_file_id = f"file-{batch_id}-output", f"file-{batch_id}-errors"
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
            "total": sum(1 for line in content.split(b"\n") if line.strip(JSON_WHITESPACE.encode())),
        }
        for kind, file_id in (("output", output_file_id), ("errors", error_file_id)):
            await self.files.declare_lines(file_id, f"{batch_id}_{kind}.jsonl", "batch_output")
        fields = {**obj, "tenant": tenant}  # not part of the batch object: get() leaves it out
        await self.r.hset(self.keys.batch(batch_id), mapping={k: json.dumps(v) for k, v in fields.items()})
        await self.r.expire(self.keys.batch(batch_id), self.s.file_ttl_s)
        self._start(batch_id)
        return await self.get(batch_id)

    async def get(self, batch_id: str) -> dict[str, Any]:
        raw = await self.r.hgetall(self.keys.batch(batch_id))
        if not raw:
            raise OpenAIError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        obj = {reply_text(k): json.loads(v) for k, v in raw.items()}
        obj.pop("tenant", None)
        completed = await self.r.llen(self.keys.file_lines(obj["output_file_id"]))
        failed = await self.r.llen(self.keys.file_lines(obj["error_file_id"]))
        obj["request_counts"] = {"total": obj.pop("total"), "completed": completed, "failed": failed}
        if obj["status"] in ACTIVE and not await self.r.exists(self.keys.batch_runner(batch_id)):
            self._start(batch_id)  # its gateway went away: run it here (nothing is enqueued or written twice)
        return obj

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


def router(batches: Batches, auth: Any) -> APIRouter:
    api = APIRouter(dependencies=[auth])

    @api.post("/v1/batches")
    async def create(body: BatchCreate, request: Request) -> dict[str, Any]:
        return await batches.create(body, getattr(request.state, "tenant", None))  # set with the key (app.py)

    @api.get("/v1/batches/{batch_id}")
    async def retrieve(batch_id: str) -> dict[str, Any]:
        return await batches.get(batch_id)

    @api.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str) -> dict[str, Any]:
        return await batches.cancel(batch_id)

    return api
