"""The Files API the Batch API needs: POST /v1/files (purpose "batch"), GET /v1/files/{id},
GET /v1/files/{id}/content. Files live in Redis (any gateway serves any file); a batch's output and error
files are Redis lists the batch appends lines to as its jobs finish."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Form, UploadFile
from fastapi.responses import Response

from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.protocol.keys import QueueKeys

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's batch input limit


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


class FileStore:
    def __init__(self, redis_client: Any, keys: QueueKeys, ttl_s: int) -> None:
        self.r, self.keys, self.ttl_s = redis_client, keys, ttl_s

    async def create(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file_id = f"file-{uuid.uuid4().hex}"
        meta = file_object(file_id, filename, len(content), purpose, int(time.time()))
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.file(file_id), mapping={"meta": json.dumps(meta), "content": content})
        pipe.expire(self.keys.file(file_id), self.ttl_s)
        await pipe.execute()
        return meta

    async def declare_lines(self, file_id: str, filename: str, purpose: str) -> None:
        """A file whose content is the list of lines a batch appends (its output or error file)."""
        meta = file_object(file_id, filename, 0, purpose, int(time.time()))
        await self.r.hset(self.keys.file(file_id), mapping={"meta": json.dumps(meta), "lines": 1})
        await self.r.expire(self.keys.file(file_id), self.ttl_s)

    async def meta(self, file_id: str) -> dict[str, Any]:
        raw = await self.r.hget(self.keys.file(file_id), "meta")
        if raw is None:
            raise OpenAIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
        meta = json.loads(raw)
        if await self.r.hexists(self.keys.file(file_id), "lines"):
            meta["bytes"] = len(await self.content(file_id))
        return meta

    async def content(self, file_id: str) -> bytes:
        key = self.keys.file(file_id)
        if await self.r.hexists(key, "lines"):
            lines = await self.r.lrange(self.keys.file_lines(file_id), 0, -1)
            return b"".join(line + b"\n" for line in lines)
        raw = await self.r.hget(key, "content")
        if raw is None:
            raise OpenAIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
        return raw


def router(store: FileStore, auth: Any) -> APIRouter:
    api = APIRouter(dependencies=[auth])

    @api.post("/v1/files")
    async def upload(file: UploadFile, purpose: str = Form(...)) -> dict[str, Any]:
        if purpose != "batch":
            raise OpenAIError(
                400, f"purpose must be 'batch' (the only one served here), got {purpose!r}", param="purpose"
            )
        content = await file.read(MAX_FILE_BYTES + 1)
        if len(content) > MAX_FILE_BYTES:
            raise OpenAIError(413, f"files are limited to {MAX_FILE_BYTES} bytes", param="file")
        return await store.create(content, file.filename or "upload.jsonl", purpose)

    @api.get("/v1/files/{file_id}")
    async def retrieve(file_id: str) -> dict[str, Any]:
        return await store.meta(file_id)

    @api.get("/v1/files/{file_id}/content")
    async def content(file_id: str) -> Response:
        return Response(await store.content(file_id), media_type="application/jsonl")

    return api
