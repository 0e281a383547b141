"""A worker's heartbeat: its state and engine figures under a key that expires, and its name in the queue's
worker set (what `pagedq status`, the gateway's live-worker check and other workers read)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.front_door import FrontDoor
from pagedq.worker.service.snapshot import WorkerSnapshot


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

    @classmethod
    def of(cls, redis_client: Any, keys: QueueKeys, settings: WorkerSettings, doors: Sequence[FrontDoor]) -> Heartbeat:
        # `celery_queue` is the key `pagedq status` shows the front doors' queues under (Celery's is the only door)
        doors_served = ",".join(door.name for door in doors) or None
        info = {"device": settings.device, "model": settings.model, "celery_queue": doors_served}
        return cls(redis_client, keys, settings.name, settings.heartbeat_every_s, info)

    def beat(self, snapshot: WorkerSnapshot) -> None:
        now = time.time()
        engine = snapshot.engine
        payload = {
            **self.info,
            **snapshot.stats,
            "state": snapshot.state,
            "updated_at": now,
            "held_jobs": snapshot.held_jobs,
            "running": engine.running,
            "waiting": engine.waiting,
            "free_blocks": engine.free_blocks,
            "total_blocks": engine.total_blocks,
            "kv_utilization": 1.0 - engine.free_blocks / max(engine.total_blocks, 1),
            "kv_slot_utilization": engine.kv_slot_utilization,
            "tenants": snapshot.tenants,  # the busiest by name (service/tenants.py)
            "admit_delay": snapshot.admit_delays,  # read-to-admit per band (service/admit_delay.py)
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
