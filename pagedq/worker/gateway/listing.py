"""OpenAI's cursor pagination (GET /v1/files, GET /v1/batches) over an owner's index: a Redis sorted set of the
owner's object ids scored by their expiry (protocol/keys.py's owner_file_index and owner_batches), kept by
protocol/bulk_scripts.py's INDEX_ADD. Every object lives file_ttl_s, so expiry order is creation order.

A page is `{"object": "list", "data", "first_id", "last_id", "has_more"}`; the next one starts `after` the last id
(what the openai SDK's auto-pagination sends). Ids whose object is gone (expired, deleted, or a writer that died
between the index and the object) are dropped from the index as a page meets them."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.connection import AsyncRedis
from pagedq.worker.protocol.replies import text as reply_text

# the objects of some ids, None for each one that is gone (in the ids' order)
Loader = Callable[[list[str]], Awaitable[list[dict[str, Any] | None]]]
# the most ids read from the index per round trip while a page fills (its objects may be filtered out or gone)
SCAN_CHUNK = 100


async def index_add(r: AsyncRedis, index: str, object_id: str, ttl_s: int) -> None:
    """List `object_id` in `index` until it expires (ttl_s from now), forgetting the ids that have expired."""
    await scripts.acall(r, "index_add", [index], [int(time.time() * 1000), ttl_s * 1000, object_id])


async def page(
    r: AsyncRedis,
    index: str,
    load: Loader,
    *,
    limit: int,
    after: str | None = None,
    descending: bool = True,
    keep: Callable[[dict[str, Any]], bool] = lambda _: True,
) -> dict[str, Any]:
    """Up to `limit` objects of the index that `keep` accepts, after the id `after` in the order asked (newest
    first when descending); a 400 naming `after` when it is not in the index (an id not the caller's, or gone)."""
    await r.zremrangebyscore(index, "-inf", int(time.time() * 1000))
    start = 0
    if after is not None:
        rank = await (r.zrevrank(index, after) if descending else r.zrank(index, after))
        if not isinstance(rank, int):  # None: not in the index
            raise OpenAIError(
                400, f"after: {after!r} is not one of your objects (unknown, deleted or expired)", param="after"
            )
        start = rank + 1
    found: list[dict[str, Any]] = []
    while len(found) <= limit:  # one more than the page: whether more follow
        read = r.zrevrange if descending else r.zrange
        # members only (no scores were asked for)
        stop = start + min(SCAN_CHUNK, limit + 1 - len(found)) - 1
        ids = [reply_text(i) for i in await read(index, start, stop) if isinstance(i, bytes | str)]
        if not ids:
            break
        start += len(ids)
        objects = await load(ids)
        gone = [object_id for object_id, obj in zip(ids, objects) if obj is None]
        if gone:
            await r.zrem(index, *gone)
            start -= len(gone)  # the ranks after them moved down
        found += [obj for obj in objects if obj is not None and keep(obj)]
    data = found[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(found) > limit,
    }
