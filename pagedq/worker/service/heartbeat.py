"""A worker's heartbeat: its state and engine figures under a key that expires, and its name in the queue's
worker set (what `pagedq status`, the gateway's live-worker check and other workers read)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Sequence

from pagedq.worker.service.context import ServiceContext
from pagedq.worker.service.front_door import FrontDoor
from pagedq.worker.service.snapshot import WorkerSnapshot


class Heartbeat:
    def __init__(self, ctx: ServiceContext, doors: Sequence[FrontDoor]) -> None:
        s = ctx.settings
        self.r, self.keys, self.name, self.interval = ctx.redis, ctx.keys, s.name, s.heartbeat_every_s
        self.info = {
            "worker": s.name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "queue": ctx.keys.queue,
            "started_at": time.time(),
            "device": s.device,
            "model": s.model,
            # the key `pagedq status` shows the front doors' queues under (Celery's is the only door)
            "celery_queue": ",".join(door.name for door in doors) or None,
        }

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
            "loras": snapshot.loras.rows,  # per adapter, the busiest by name (service/loras.py)
            # name -> path: the gateway's /v1/models lists them as this model's adapters (with the queue's registry)
            "lora_modules": snapshot.loras.modules,
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
