"""The Batch API: POST /v1/batches, GET /v1/batches (the caller's own), GET /v1/batches/{id},
POST /v1/batches/{id}/cancel, on the machinery of
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
from typing import Any

import structlog

from pagedq.worker.bulk.lines import JSON_WHITESPACE
from pagedq.worker.client.async_client import AsyncClient
from pagedq.worker.gateway.batch_run import LEASE_S, BatchRun
from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.files import FileStore
from pagedq.worker.gateway.listing import index_add, page
from pagedq.worker.gateway.object_ids import is_batch_id, new_batch_id, new_file_id
from pagedq.worker.gateway.owners import owns
from pagedq.worker.gateway.schemas import BatchCreate
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.gateway.workers import LiveWorkers
from pagedq.worker.protocol.replies import text as reply_text

ACTIVE = ("validating", "in_progress", "cancelling")


class Batches:
    def __init__(self, client: AsyncClient, files: FileStore, live: LiveWorkers, settings: GatewaySettings) -> None:
        self.client, self.files, self.live, self.s = client, files, live, settings
        self.r, self.keys = client.r, client.keys
        self.tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ the batch object
    async def create(self, req: BatchCreate, owner: str, tenant: str | None = None) -> dict[str, Any]:
        """owner: the caller's (owners.py), who alone sees the batch and its files; tenant: the caller's (its API
        key's), which every line's job runs as and is counted against."""
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
            "total": sum(1 for line in content.split(b"\n") if line.strip(JSON_WHITESPACE.encode())),
        }
        for kind, file_id in (("output", output_file_id), ("errors", error_file_id)):
            await self.files.declare_lines(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", owner)
        fields = {**obj, "tenant": tenant}  # not part of the batch object: get() leaves it out
        await index_add(self.r, self.keys.owner_batches(owner), batch_id, self.s.file_ttl_s)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), mapping={**{k: json.dumps(v) for k, v in fields.items()}, "owner": owner})
        pipe.expire(self.keys.batch(batch_id), self.s.file_ttl_s)
        await pipe.execute()
        self._start(batch_id)
        return await self.get(batch_id)

    async def get(self, batch_id: str) -> dict[str, Any]:
        (obj,) = await self._objects([batch_id])
        if obj is None:
            raise OpenAIError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        return obj

    async def listed(self, owner: str, *, limit: int, after: str | None = None) -> dict[str, Any]:
        """GET /v1/batches: a page of the owner's batches, newest first (as OpenAI lists them)."""

        async def load(batch_ids: list[str]) -> list[dict[str, Any] | None]:
            return await self._objects(batch_ids, owner)

        return await page(self.r, self.keys.owner_batches(owner), load, limit=limit, after=after)

    async def _objects(self, batch_ids: list[str], owner: str | None = None) -> list[dict[str, Any] | None]:
        """The batch objects (None for a batch that is gone, or not `owner`'s when one is given), in two round trips
        however many; an active batch whose runner went away is run here, as a GET of it does."""
        pipe = self.r.pipeline(transaction=False)
        for batch_id in batch_ids:
            pipe.hgetall(self.keys.batch(batch_id))
        objects: list[dict[str, Any] | None] = []
        for raw in await pipe.execute():
            stored_owner = raw.pop(b"owner", None)  # not part of the object (and kept as text)
            if not raw or (owner is not None and not owns(stored_owner, owner)):
                objects.append(None)
                continue
            obj = {reply_text(k): json.loads(v) for k, v in raw.items()}
            obj.pop("tenant", None)
            objects.append(obj)
        found = [(batch_id, obj) for batch_id, obj in zip(batch_ids, objects) if obj is not None]
        pipe = self.r.pipeline(transaction=False)
        for batch_id, obj in found:
            pipe.llen(self.keys.file_lines(obj["output_file_id"]))
            pipe.llen(self.keys.file_lines(obj["error_file_id"]))
            pipe.exists(self.keys.batch_runner(batch_id))
        counts = await pipe.execute() if found else []
        for i, (batch_id, obj) in enumerate(found):
            completed, failed, running = counts[3 * i : 3 * i + 3]
            obj["request_counts"] = {"total": obj.pop("total"), "completed": completed, "failed": failed}
            if obj["status"] in ACTIVE and not running:
                self._start(batch_id)  # its gateway went away: run it here (nothing is enqueued or written twice)
        return objects

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
