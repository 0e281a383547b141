"""Live workers of the queue, from their heartbeats (pagedq/worker/service/leases.py): what /v1/models lists and what
decides 503. A heartbeat key expires unless its worker refreshes it, so an existing key is a live worker."""

from __future__ import annotations

import json
import time
from typing import Any

from pagedq.worker.protocol.keys import WORKER_SET_WINDOW_S, QueueKeys, model_id
from pagedq.worker.protocol.registry import aregistered


class LiveWorkers:
    def __init__(self, redis_client: Any, keys: QueueKeys, cache_s: float) -> None:
        self.r, self.keys, self.cache_s = redis_client, keys, cache_s
        self._cached: tuple[float, list[dict]] | None = None
        self._models: tuple[list[dict], dict[str, dict]] | None = None  # derived from the cached heartbeats
        self._registry: tuple[float, dict[str, dict[str, Any]]] | None = None  # the queue's LoRA registry

    async def heartbeats(self) -> list[dict]:
        """Heartbeats of the workers that are alive and admitting (draining ones are not)."""
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < self.cache_s:
            return self._cached[1]
        names = await self.r.zrangebyscore(self.keys.workers, time.time() - WORKER_SET_WINDOW_S, "+inf")
        raws = await self.r.mget([self.keys.heartbeat(n.decode()) for n in names]) if names else []
        live = [beat for beat in (json.loads(raw) for raw in raws if raw) if beat.get("state") != "draining"]
        self._cached = (now, live)
        return live

    async def models(self) -> dict[str, dict]:
        """Model id -> {"created", "workers", "path"} over the live workers (recomputed when they change)."""
        beats = await self.heartbeats()
        if self._models is not None and self._models[0] is beats:
            return self._models[1]
        served: dict[str, dict] = {}
        for beat in beats:
            name = model_id(str(beat.get("model") or "unknown"))
            entry = served.setdefault(
                name, {"created": int(beat.get("started_at") or time.time()), "workers": 0, "path": beat.get("model")}
            )
            entry["created"] = min(entry["created"], int(beat.get("started_at") or time.time()))
            entry["workers"] += 1
        self._models = (beats, served)
        return served

    async def adapters(self) -> dict[str, dict]:
        """LoRA adapter name -> {"parent": its base model's id, "root": its path, "created"}: the live workers'
        --lora-modules (their heartbeats) and the queue's registry (protocol/registry.py), whose adapters every
        worker of the queue serves (listed under the first model served: a queue serves one model)."""
        served = await self.models()
        if not served:
            return {}
        out: dict[str, dict] = {}
        for beat in await self.heartbeats():
            parent = model_id(str(beat.get("model") or "unknown"))
            modules = beat.get("lora_modules")
            for name, path in (modules if isinstance(modules, dict) else {}).items():
                out.setdefault(name, {"parent": parent, "root": path, "created": int(beat.get("started_at") or 0)})
        parent = min(served)
        for name, entry in (await self.registry()).items():
            added = entry.get("added_at")
            created = int(added) if isinstance(added, int | float) else 0
            out.setdefault(name, {"parent": parent, "root": entry.get("path"), "created": created})
        return out

    async def registry(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        if self._registry is None or now - self._registry[0] >= self.cache_s:
            self._registry = (now, await aregistered(self.r, self.keys))
        return self._registry[1]

    def forget_registry(self) -> None:
        """This gateway changed the registry: its next look reads it again."""
        self._registry = None
