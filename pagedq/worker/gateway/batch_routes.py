"""The Batch API's routes: POST /v1/batches, GET /v1/batches (the caller's own, OpenAI's cursor pages),
GET /v1/batches/{id}, POST /v1/batches/{id}/cancel (batches.py does the work). Each batch, and each file it is made
from or writes, belongs to the caller that made it (owners.py): to any other caller it is missing (404)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from pagedq.worker.gateway.batches import Batches
from pagedq.worker.gateway.owners import request_owner
from pagedq.worker.gateway.schemas import BatchCreate

MAX_LIST_LIMIT = 100  # OpenAI's bound of GET /v1/batches' limit
DEFAULT_LIST_LIMIT = 20  # OpenAI's


def router(batches: Batches, auth: Any) -> APIRouter:
    api = APIRouter(dependencies=[auth])

    @api.post("/v1/batches")
    async def create(body: BatchCreate, request: Request) -> dict[str, Any]:
        return await batches.create(body, request_owner(request), getattr(request.state, "tenant", None))

    @api.get("/v1/batches")
    async def listing(
        request: Request,
        limit: int = Query(DEFAULT_LIST_LIMIT, ge=1, le=MAX_LIST_LIMIT),
        after: str | None = Query(None, max_length=200),
    ) -> Response:
        return JSONResponse(await batches.listed(request_owner(request), limit=limit, after=after))  # plain JSON

    @api.get("/v1/batches/{batch_id}")
    async def retrieve(batch_id: str, request: Request) -> dict[str, Any]:
        return await batches.get(await batches.owned(batch_id, request_owner(request)))

    @api.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request) -> dict[str, Any]:
        return await batches.cancel(await batches.owned(batch_id, request_owner(request)))

    return api
