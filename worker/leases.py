"""Leases on jobs (a job's idle time in the group's pending list), recovery, claiming, heartbeats.

A job a worker holds stays "leased" while the worker renews it (XCLAIM JUSTID by the owner resets its
idle time), so long generations are never stolen. Jobs of a dead worker go idle; after lease_ms any
worker claims them with XAUTOCLAIM. Jobs recovered so (or re-read by a restarted worker) are suspects: they
run alone, each run alone recorded in Redis first, so a job that kills its worker is the only one charged.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from . import scripts
from .engine_api import WorkerEngine
from .keys import BANDS, GROUP, QueueKeys


class Leases:
    def __init__(self, redis_client: Any, keys: QueueKeys, name: str, lease_ms: int) -> None:
        self.r, self.keys, self.name, self.lease_ms = redis_client, keys, name, int(lease_ms)
        self.cursors = {band: "0-0" for band in BANDS}  # XAUTOCLAIM walks each band's pending list

    def ensure_group(self) -> None:
        for band in BANDS:
            try:
                self.r.xgroup_create(self.keys.jobs_of(band), GROUP, id="0", mkstream=True)
            except Exception as exc:  # BUSYGROUP: it exists already
                if "BUSYGROUP" not in str(exc):
                    raise

    def read_own_pending(self, band: str, count: int = 500) -> list:
        """Entries of a band this consumer had not acknowledged before it stopped (restart recipe: read from 0)."""
        entries: list = []  # (entry id, fields) pairs as redis-py returns them
        last = "0"
        while True:
            reply = self.r.xreadgroup(GROUP, self.name, {self.keys.jobs_of(band): last}, count=count)
            batch = reply[0][1] if reply else []
            if not batch:
                return entries
            entries.extend(batch)
            last = _s(batch[-1][0])

    def renew(self, band: str, entry_ids: list[str]) -> list[str]:
        """Renew our leases on entries of a band; return those another worker has claimed meanwhile."""
        lost = []
        for i in range(0, len(entry_ids), 1000):
            chunk = entry_ids[i : i + 1000]
            lost += scripts.call(self.r, "renew", [self.keys.jobs_of(band)], [GROUP, self.name, *chunk])
        return [_s(x) for x in lost]

    def claim(self, band: str, count: int) -> list:
        """XAUTOCLAIM up to count entries of a band idle past the lease (walking its pending list with a cursor)."""
        if count <= 0:
            return []
        reply = self.r.xautoclaim(
            self.keys.jobs_of(band), GROUP, self.name, self.lease_ms, self.cursors[band], count=count
        )
        self.cursors[band] = _s(reply[0])
        return list(reply[1])


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


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
