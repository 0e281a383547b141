"""The Files API the Batch API needs: POST /v1/files (purpose "batch"), GET /v1/files (the caller's own files, OpenAI's
cursor pages: listing.py), GET /v1/files/{id}, GET /v1/files/{id}/content, DELETE /v1/files/{id}. Files live in Redis
(any gateway serves any file); a batch's output and error files are Redis lists the batch appends lines to as its
jobs finish.

Each file has an owner (owners.py): to anyone else it is missing (404). Uploads count against their owner's quota of
files and bytes (settings.max_files_per_owner, max_file_bytes_per_owner), freed as they expire or are deleted."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from fastapi import APIRouter, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from pagedq.worker.gateway.errors import NO_RETRY, OpenAIError
from pagedq.worker.gateway.listing import index_add, page
from pagedq.worker.gateway.object_ids import is_file_id, new_file_id
from pagedq.worker.gateway.owners import owns, request_owner
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.protocol.replies import text as reply_text

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's batch input limit
MAX_LIST_LIMIT = 10_000  # OpenAI's bound (and default) of GET /v1/files' limit


def file_object(file_id: str, filename: str, size: int, purpose: str, created: int) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def not_found(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")


class FileStore:
    def __init__(self, redis_client: Any, keys: QueueKeys, settings: GatewaySettings) -> None:
        self.r, self.keys, self.s = redis_client, keys, settings

    async def create(self, content: bytes, filename: str, purpose: str, owner: str) -> dict[str, Any]:
        file_id = new_file_id()
        meta = file_object(file_id, filename, len(content), purpose, int(time.time()))
        await self._reserve(file_id, len(content), owner)
        await index_add(self.r, self.keys.owner_file_index(owner), file_id, self.s.file_ttl_s)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.file(file_id), mapping={"meta": json.dumps(meta), "owner": owner, "content": content})
        pipe.expire(self.keys.file(file_id), self.s.file_ttl_s)
        try:
            await pipe.execute()
        except BaseException:
            await self._release(file_id, owner)
            raise
        return meta

    async def _reserve(self, file_id: str, size: int, owner: str) -> None:
        """Room for the upload in its owner's quota, or a 429 naming the quota that is full."""
        quota = [self.keys.owner_files(owner), self.keys.owner_file_bytes(owner)]
        limits = (self.s.max_files_per_owner, self.s.max_file_bytes_per_owner)
        args = [int(time.time() * 1000), self.s.file_ttl_s * 1000, file_id, size, *limits]
        verdict, *used = [reply_text(v) for v in await scripts.acall(self.r, "reserve_file", quota, args)]
        if verdict == "files":
            name, state = "max_files_per_owner", f"{used[0]} files kept, at most {limits[0]}"
        elif verdict == "bytes":
            name, state = "max_file_bytes_per_owner", f"{used[0]} bytes kept, {size} more asked, at most {limits[1]}"
        else:
            return
        raise OpenAIError(
            429,
            f"file quota {name} reached: {state}; delete files (DELETE /v1/files/{{id}}) or wait for them to expire",
            param="file",
            code="file_quota_exceeded",
            headers=NO_RETRY,  # a full quota frees only as files expire or are deleted
        )

    async def _release(self, file_id: str, owner: str) -> None:
        quota = [self.keys.owner_files(owner), self.keys.owner_file_bytes(owner)]
        await scripts.acall(self.r, "release_file", quota, [file_id])

    async def declare_lines(self, file_id: str, filename: str, purpose: str, owner: str) -> None:
        """A file whose content is the list of lines a batch appends (its output or error file). Its line list,
        running size (bytes) and expiry are kept by protocol/scripts.py's APPEND_ONCE."""
        meta = file_object(file_id, filename, 0, purpose, int(time.time()))
        await index_add(self.r, self.keys.owner_file_index(owner), file_id, self.s.file_ttl_s)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.file(file_id), mapping={"meta": json.dumps(meta), "owner": owner, "lines": 1, "bytes": 0})
        pipe.expire(self.keys.file(file_id), self.s.file_ttl_s)
        await pipe.execute()

    async def _owned(self, file_id: str, owner: str, *fields: str) -> tuple[bytes, list[bytes | None]]:
        """The file's meta and `fields`, if it exists and `owner` owns it; else the 404 of a missing file."""
        if is_file_id(file_id):
            stored_owner, meta, *values = await self.r.hmget(self.keys.file(file_id), ["owner", "meta", *fields])
            if meta is not None and owns(stored_owner, owner):
                return meta, values
        raise not_found(file_id)

    async def meta(self, file_id: str, owner: str) -> dict[str, Any]:
        raw, (lines, size) = await self._owned(file_id, owner, "lines", "bytes")
        meta = json.loads(raw)
        if lines is not None:  # a line file declared before the running size was kept is measured
            meta["bytes"] = int(size) if size is not None else len(await self.content(file_id))
        return meta

    async def listed(
        self, owner: str, *, limit: int, order: str = "desc", after: str | None = None, purpose: str | None = None
    ) -> dict[str, Any]:
        """GET /v1/files: a page of the owner's files (uploads and its batches' output and error files)."""

        async def load(file_ids: list[str]) -> list[dict[str, Any] | None]:
            pipe = self.r.pipeline(transaction=False)
            for file_id in file_ids:
                pipe.hmget(self.keys.file(file_id), ["owner", "meta", "bytes"])
            objects: list[dict[str, Any] | None] = []
            for stored_owner, raw, size in await pipe.execute():
                meta = json.loads(raw) if raw is not None and owns(stored_owner, owner) else None
                if meta is not None and size is not None:  # a batch's line file: its running size
                    meta["bytes"] = int(size)
                objects.append(meta)
            return objects

        return await page(
            self.r,
            self.keys.owner_file_index(owner),
            load,
            limit=limit,
            after=after,
            descending=order == "desc",
            keep=lambda meta: purpose is None or meta["purpose"] == purpose,
        )

    async def owned_content(self, file_id: str, owner: str) -> bytes:
        await self._owned(file_id, owner)
        return await self.content(file_id)

    async def content(self, file_id: str) -> bytes:
        """A file's content, whoever owns it (a batch's run reads its input file with it)."""
        key = self.keys.file(file_id)
        if await self.r.hexists(key, "lines"):
            lines = await self.r.lrange(self.keys.file_lines(file_id), 0, -1)
            return b"".join(line + b"\n" for line in lines)
        raw = await self.r.hget(key, "content")
        if raw is None:
            raise not_found(file_id)
        return raw

    async def delete(self, file_id: str, owner: str) -> dict[str, Any]:
        await self._owned(file_id, owner)
        await self.r.delete(self.keys.file(file_id), self.keys.file_lines(file_id))
        await self.r.zrem(self.keys.owner_file_index(owner), file_id)
        await self._release(file_id, owner)  # after: a gateway dying in between leaves the quota counting it
        return {"id": file_id, "object": "file", "deleted": True}


def router(store: FileStore, auth: Any) -> APIRouter:
    api = APIRouter(dependencies=[auth])

    @api.post("/v1/files")
    async def upload(request: Request, file: UploadFile, purpose: str = Form(...)) -> dict[str, Any]:
        if purpose != "batch":
            raise OpenAIError(
                400, f"purpose must be 'batch' (the only one served here), got {purpose!r}", param="purpose"
            )
        content = await file.read(MAX_FILE_BYTES + 1)
        if len(content) > MAX_FILE_BYTES:
            raise OpenAIError(413, f"files are limited to {MAX_FILE_BYTES} bytes", param="file")
        return await store.create(content, file.filename or "upload.jsonl", purpose, request_owner(request))

    @api.get("/v1/files")
    async def listing(
        request: Request,
        purpose: str | None = Query(None, max_length=64),
        limit: int = Query(MAX_LIST_LIMIT, ge=1, le=MAX_LIST_LIMIT),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = Query(None, max_length=200),
    ) -> Response:
        owner = request_owner(request)
        # plain JSON already: FastAPI's encoding of a returned dict would walk every object of a long page again
        return JSONResponse(await store.listed(owner, limit=limit, order=order, after=after, purpose=purpose))

    @api.get("/v1/files/{file_id}")
    async def retrieve(file_id: str, request: Request) -> dict[str, Any]:
        return await store.meta(file_id, request_owner(request))

    @api.get("/v1/files/{file_id}/content")
    async def content(file_id: str, request: Request) -> Response:
        return Response(await store.owned_content(file_id, request_owner(request)), media_type="application/jsonl")

    @api.delete("/v1/files/{file_id}")
    async def delete(file_id: str, request: Request) -> dict[str, Any]:
        return await store.delete(file_id, request_owner(request))

    return api
