"""Prometheus metrics of one worker, and its health checks, on one small HTTP server (`--metrics-port`).

GET /metrics: the metrics text (prometheus_client's WSGI app). GET /health: liveness, 200 while the worker
loop turned within `stale_after_s`, else 503. GET /ready: readiness, 200 once the loop has run with the
engine loaded and Redis answers a PING now, else 503. Both answer a JSON body saying why. Other paths: 404.

Nothing here runs per token: the worker counts generated tokens in a plain int per step, observes the
latency histograms (per band) once per finished job, and update() (on a timer, default 1 s, in the worker's thread)
takes the loop's figures as a snapshot (pagedq/worker/service/snapshot.py: this class is its MetricsSink) and asks
Redis for the queue's state in one pipelined round trip (the bands' streams, and the workers' heartbeats:
every worker exports the queue's heartbeat table, so a dashboard sees a worker that stopped beating).
A private registry per worker, so several workers in one process (tests) do not collide.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from pagedq.worker.ops.lora_metrics import LoraMetrics
from pagedq.worker.ops.tenant_metrics import BandsAndTenantsMetrics
from pagedq.worker.ops.vllm_metrics import VllmMetrics
from pagedq.worker.protocol.connection import SyncRedis, probe_client
from pagedq.worker.protocol.errors import MetricsPortError
from pagedq.worker.protocol.job import FinalRecord
from pagedq.worker.protocol.keys import BANDS, GROUP, WORKER_SET_WINDOW_S, QueueKeys
from pagedq.worker.protocol.replies import text
from pagedq.worker.service.snapshot import WorkerSnapshot

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# The loop turns at least every block_ms (1 s) plus one engine step; a long CPU prefill can take seconds.
LIVENESS_STALE_S = 30.0
READY_PING_TIMEOUT_S = 1.0


class Metrics:
    def __init__(
        self,
        port: int,
        queue: str,
        redis_client: Any,
        addr: str = "127.0.0.1",
        every_s: float = 1.0,
        compat: str = "none",
        model_name: str = "",
    ) -> None:
        """redis_client: the worker's (the queue's state; the readiness probe is a short-timeout copy of it);
        every_s: how often the worker calls update() (liveness allows ten of those); compat "vllm": vLLM's names
        too (vllm_metrics.py), labelled with model_name."""
        self.keys = QueueKeys(queue)
        self.r, self.every_s = redis_client, every_s
        self.registry = reg = CollectorRegistry()
        q = ["queue"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, q, registry=reg).labels(queue)

        def per_band(name: str, doc: str) -> Any:  # one series per priority band (label band)
            return Gauge(name, doc, [*q, "band"], registry=reg)

        self.depth = per_band("pagedq_queue_depth", "Unfinished jobs in the band's stream (waiting + in flight)")
        self.lag = per_band("pagedq_queue_lag", "Jobs in the band's stream not yet delivered to any worker")
        # What KEDA's redis-streams lagCount reads (docs/deployment.md, Kubernetes): Redis 7's own count, absent on 6.2
        self.group_lag = per_band(
            "pagedq_queue_group_lag",
            "XINFO GROUPS lag of the workers' group on the band's stream, as KEDA's lagCount reads it (NULL as 0)",
        )
        self.group_lag_unknown = per_band(
            "pagedq_queue_group_lag_unknown", "1 while Redis reports the group's lag as NULL (KEDA then reads 0)"
        )
        self.oldest_age = per_band("pagedq_queue_oldest_job_age_seconds", "Age of the band's oldest unfinished job")
        self.pending = per_band("pagedq_pending_jobs", "Jobs of the band delivered and not yet acknowledged")
        self.dead = per_band("pagedq_dead_letters", "Entries in the band's dead-letter stream")
        self.celery_depth = gauge("pagedq_celery_queue_depth", "Messages waiting in the Celery queue")
        self.running = gauge("pagedq_running_requests", "Requests this worker's engine is running")
        self.waiting = gauge("pagedq_waiting_requests", "Requests waiting in this worker's engine")
        self.held = gauge("pagedq_held_jobs", "Jobs this worker holds (backlog + engine)")
        self.blocks_used = gauge("pagedq_kv_blocks_used", "KV cache blocks in use")
        self.blocks_free = gauge("pagedq_kv_blocks_free", "KV cache blocks free")
        # A gauge: no `_total` suffix (Prometheus reserves it for counters).
        self.blocks_total = gauge("pagedq_kv_blocks", "KV cache blocks in the pool")
        self.slot_util = gauge("pagedq_kv_slot_utilization", "Fraction of KV slots of used blocks holding tokens")
        self.tokens = Counter("pagedq_generated_tokens", "Tokens generated", q, registry=reg).labels(queue)
        self.preemptions = Counter("pagedq_preemptions", "Engine preemptions", q, registry=reg).labels(queue)
        self.outages = Counter(
            "pagedq_redis_outages", "Times this worker lost Redis and carried on once it was back", q, registry=reg
        ).labels(queue)
        self.jobs = Counter("pagedq_jobs_finished", "Jobs finished by this worker", [*q, "status"], registry=reg)
        self.ttft = Histogram(
            "pagedq_time_to_first_token_seconds",
            "Enqueue to first token, by the band the job was served in",
            [*q, "band"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "pagedq_e2e_latency_seconds",
            "Enqueue to final record (completed jobs), by band",
            [*q, "band"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        # A timestamp, not an age: `time() - ...` keeps growing between scrapes when a worker stops beating.
        self.heartbeats = Gauge(
            "pagedq_worker_heartbeat_timestamp_seconds",
            "Unix time of each registered worker's last heartbeat (the queue's worker set)",
            [*q, "worker"],
            registry=reg,
        )
        for band in BANDS:  # every band's series from the start (at 0), so rate() and the dashboard see them
            self.ttft.labels(queue, band)
            self.e2e.labels(queue, band)
        self.bands_and_tenants = BandsAndTenantsMetrics(reg, queue)  # seat preemptions, admit delay, tenants
        self.loras = LoraMetrics(reg, queue)  # per LoRA adapter
        self.vllm = VllmMetrics(reg, model_name, LATENCY_BUCKETS) if compat == "vllm" else None
        self._beating: set[str] = set()  # the workers exported last time (a worker that left is removed)
        self._seen = {"tokens": 0, "preemptions": 0, "outages": 0}
        self._seen_status: dict[str, int] = {}
        self.stale_after_s = LIVENESS_STALE_S
        self.last_turn = time.monotonic()  # of the worker loop's last metrics update (start-up counts as one)
        self.engine_loaded = False
        self._probe: SyncRedis | None = None  # its own short-timeout client: a probe must not hang on a dead Redis
        self._metrics_app = make_wsgi_app(reg)
        try:
            self.server = make_server(addr, port, self._app, ThreadingWSGIServer, handler_class=_QuietHandler)
        except OSError as exc:  # a port in use is a start-up mistake: say which flag to change (errors.py)
            raise MetricsPortError(port, addr, exc) from exc
        self._thread = threading.Thread(target=self.server.serve_forever, name="pagedq-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    # ---- HTTP --------------------------------------------------------------------------------
    def _app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path == "/health":
            return _json(start_response, *self.liveness())
        if path == "/ready":
            return _json(start_response, *self.readiness())
        return _json(start_response, False, {"error": f"no such path {path!r}: /metrics, /health, /ready"}, "404")

    def liveness(self) -> tuple[bool, dict]:
        age = time.monotonic() - self.last_turn
        alive = age <= self.stale_after_s
        return alive, {"alive": alive, "last_turn_age_s": round(age, 3), "stale_after_s": self.stale_after_s}

    def readiness(self) -> tuple[bool, dict]:
        redis_ok, error = False, None
        if self._probe is not None:
            try:
                redis_ok = bool(self._probe.ping())
            except Exception as exc:  # any failure to answer means not ready; say which
                error = repr(exc)
        ready = self.engine_loaded and redis_ok and self.liveness()[0]
        body: dict[str, bool | str] = {"ready": ready, "engine_loaded": self.engine_loaded, "redis": redis_ok}
        if error:
            body["redis_error"] = error
        return ready, body

    def _watch(self) -> None:
        """Called from the worker loop: it turned, and so its engine is loaded; a probe client like the worker's."""
        self.last_turn = time.monotonic()
        self.engine_loaded = True
        self.stale_after_s = max(LIVENESS_STALE_S, 10 * float(self.every_s))
        if self._probe is None:
            self._probe = probe_client(self.r, READY_PING_TIMEOUT_S)  # a cluster client for a cluster

    # ---- metrics -----------------------------------------------------------------------------
    def observe(self, record: FinalRecord, band: str) -> None:
        """Once per finished job; band: the priority band it was served in."""
        timings, q = record.timings, self.keys.queue
        if timings.ttft is not None:
            self.ttft.labels(q, band).observe(timings.ttft)
        if record.status == "completed" and timings.total is not None:
            self.e2e.labels(q, band).observe(timings.total)
        if self.vllm is not None:
            self.vllm.observe(record)

    def update(self, snapshot: WorkerSnapshot) -> None:
        """On the metrics timer: engine gauges, counter deltas, and the queue's state from Redis."""
        self._watch()
        engine = snapshot.engine
        self.blocks_total.set(engine.total_blocks)
        self.blocks_free.set(engine.free_blocks)
        self.blocks_used.set(engine.total_blocks - engine.free_blocks)
        self.slot_util.set(engine.kv_slot_utilization)
        self.running.set(engine.running)
        self.waiting.set(engine.waiting)
        self.held.set(snapshot.held_jobs)
        self._advance(self.tokens, "tokens", snapshot.tokens_generated)
        self._advance(self.preemptions, "preemptions", snapshot.preemptions)
        self._advance(self.outages, "outages", snapshot.redis_outages)
        self.bands_and_tenants.update(snapshot)
        self.loras.update(snapshot)
        if self.vllm is not None:
            self.vllm.update(snapshot)
        for status, count in snapshot.stats.items():
            seen = self._seen_status.get(status, 0)
            self.jobs.labels(self.keys.queue, status).inc(count - seen)
            self._seen_status[status] = count
        self._queue_state(self.r)
        if snapshot.front_door_depths:  # the Celery front door, the only one there is
            self.celery_depth.set(sum(snapshot.front_door_depths.values()))

    def _advance(self, counter: Any, name: str, value: int) -> None:
        if value > self._seen[name]:
            counter.inc(value - self._seen[name])
            self._seen[name] = value

    def _queue_state(self, r: Any) -> None:
        k, q = self.keys, self.keys.queue
        pipe = r.pipeline(transaction=False)
        for band in BANDS:
            pipe.xlen(k.jobs_of(band))
            pipe.xpending(k.jobs_of(band), GROUP)
            pipe.xlen(k.dead_of(band))
            pipe.xrange(k.jobs_of(band), "-", "+", count=1)
            pipe.xinfo_groups(k.jobs_of(band))
        pipe.zrangebyscore(k.workers, time.time() - WORKER_SET_WINDOW_S, "+inf", withscores=True, start=0, num=100)
        replies = pipe.execute(raise_on_error=False)
        self._heartbeats(replies[-1])
        for i, band in enumerate(BANDS):
            depth, summary, dead, first, groups = replies[5 * i : 5 * i + 5]
            pending = 0 if isinstance(summary, Exception) else int(summary["pending"])  # NOGROUP before any worker
            self.depth.labels(q, band).set(int(depth))
            self.dead.labels(q, band).set(int(dead))
            self.pending.labels(q, band).set(pending)
            # Finished jobs are deleted from the stream, so what is in it and not pending was never delivered
            # (cheaper than XINFO GROUPS, whose lag Redis reports as unknown after some deletions).
            self.lag.labels(q, band).set(max(int(depth) - pending, 0))
            age = 0.0
            if first and not isinstance(first, Exception):
                age = max(time.time() - int(text(first[0][0]).split("-")[0]) / 1000.0, 0.0)
            self.oldest_age.labels(q, band).set(age)
            self._group_lag(band, groups)

    def _group_lag(self, band: str, groups: Any) -> None:
        """The workers' group's lag from an XINFO GROUPS reply: NULL (Redis cannot count past a deleted entry newer
        than the oldest one left) is exported as 0, as KEDA reads it; Redis 6.2 reports no lag: no series."""
        if isinstance(groups, Exception):  # no stream yet
            return
        for group in groups:
            if text(group["name"]) == GROUP and "lag" in group:
                lag = group["lag"]
                self.group_lag.labels(self.keys.queue, band).set(0 if lag is None else int(lag))
                self.group_lag_unknown.labels(self.keys.queue, band).set(1 if lag is None else 0)

    def _heartbeats(self, reply: Any) -> None:
        """The queue's workers scored by their last heartbeat; those gone from the set lose their series."""
        if isinstance(reply, Exception):
            return
        beats = {text(name): float(score) for name, score in reply}
        for gone in self._beating - beats.keys():
            self.heartbeats.remove(self.keys.queue, gone)
        for name, at in beats.items():
            self.heartbeats.labels(self.keys.queue, name).set(at)
        self._beating = set(beats)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._probe is not None:
            self._probe.close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes and probes every few seconds: no access log
        pass


def _json(start_response: Callable, ok: bool, body: dict, status: str | None = None) -> list[bytes]:
    status = status or ("200" if ok else "503")
    reason = {"200": "OK", "503": "Service Unavailable", "404": "Not Found"}[status]
    payload = json.dumps(body).encode()
    start_response(f"{status} {reason}", [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
    return [payload]
