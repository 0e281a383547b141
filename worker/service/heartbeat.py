"""A worker's heartbeat: its state and engine figures under a key that expires, and its name in the queue's
worker set (what `pagedq status`, the gateway's live-worker check and other workers read)."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from worker.protocol.keys import QueueKeys
from worker.service.engine_api import WorkerEngine


class Heartbeat:
    def __init__(self, redis_client: Any, keys: QueueKeys, name: str, interval_s: float, info: dict) -> None:
        self.r, self.keys, self.name, self.interval = redis_client, keys, name, interval_s
        self.info = {
            "worker": name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "queue": keys.queue,
            "started_at": time.time(),
            **info,
        }

    def beat(self, engine: WorkerEngine, held: int, stats: dict, state: str = "running") -> None:
        now = time.time()
        payload = {
            **self.info,
            **stats,
            "state": state,
            "updated_at": now,
            "held_jobs": held,
            "running": engine.num_running_requests,
            "waiting": engine.num_waiting_requests,
            "free_blocks": engine.num_free_blocks,
            "total_blocks": engine.num_total_blocks,
            "kv_utilization": 1.0 - engine.num_free_blocks / max(engine.num_total_blocks, 1),
            "kv_slot_utilization": float(getattr(engine, "kv_slot_utilization", 0.0)),
        }
        ttl = max(int(self.interval * 3), 2)
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(self.name), json.dumps(payload), ex=ttl)
        pipe.zadd(self.keys.workers, {self.name: now})
        pipe.execute()

    def remove(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.keys.heartbeat(self.name))
        pipe.zrem(self.keys.workers, self.name)
        pipe.execute()
