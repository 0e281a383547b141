"""`pagedq status`: workers (from their heartbeats), queue depth, pending jobs and dead letters.

Read-only, plain Redis reads. Without --queue, every queue that has a job stream is shown.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from redis.exceptions import ResponseError

from pagedq.worker.flags import Option, add_options, queue_option
from pagedq.worker.protocol.connection import SyncRedis, connect
from pagedq.worker.protocol.keys import BANDS, GROUP, PREFIX, QueueKeys
from pagedq.worker.protocol.replies import text
from pagedq.worker.protocol.settings import redis_url

OPTIONS = (
    queue_option("queue to show (repeatable; the variable: comma-separated; default: all)", None, append=True),
    Option("json", bool, False, "print one JSON object instead of tables"),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", default=None, help="Redis URL (default: $PAGEDQ_REDIS_URL or redis://localhost:6379/0)")
    add_options(p, OPTIONS)


def discover_queues(r: SyncRedis) -> list[str]:
    """Queues with a job stream or registered workers (SCAN, never KEYS)."""
    found = set()
    for pattern in (f"{PREFIX}:{{*}}:jobs", f"{PREFIX}:{{*}}:workers"):
        for key in r.scan_iter(match=pattern, count=1000):
            name = text(key)
            found.add(name[name.index("{") + 1 : name.index("}")])
    return sorted(found) or ["default"]


def queue_status(r: SyncRedis, queue: str, now: float | None = None) -> dict[str, Any]:
    """One queue's counts and its workers (a worker whose heartbeat expired shows as `gone`)."""
    now = time.time() if now is None else now
    k = QueueKeys(queue)
    pipe = r.pipeline(transaction=False)
    for band in BANDS:
        pipe.xlen(k.jobs_of(band))
        pipe.xpending(k.jobs_of(band), GROUP)
        pipe.xlen(k.dead_of(band))
    pipe.zcard(k.cancelled)
    pipe.zrange(k.workers, 0, -1, withscores=True)
    replies = _checked(pipe.execute(raise_on_error=False))
    bands = {}
    for i, band in enumerate(BANDS):
        depth, summary, dead = replies[3 * i : 3 * i + 3]
        pending = 0 if summary is None else int(summary["pending"])  # None: NOGROUP, no worker has started yet
        bands[band] = {
            "depth": int(depth),
            "pending": pending,
            "undelivered": max(int(depth) - pending, 0),
            "dead_letters": int(dead),
        }
    cancels, members = replies[-2:]
    names = [(text(name), score) for name, score in members]
    beats = r.mget([k.heartbeat(name) for name, _ in names]) if names else []
    workers = [_worker_row(name, score, raw, now) for (name, score), raw in zip(names, beats)]
    totals = {
        field: sum(b[field] for b in bands.values()) for field in ("depth", "pending", "undelivered", "dead_letters")
    }
    return {
        "queue": queue,
        **totals,
        "bands": bands,
        "cancel_requests": int(cancels),
        "workers": workers,
        "tenants": tenant_totals([w for w in workers if w["state"] != "gone"]),
        "loras": tenant_totals([w for w in workers if w["state"] != "gone"], "loras"),
    }


def _checked(replies: list[Any]) -> list[Any]:
    """Pipeline replies with NOGROUP (a queue no worker has read yet) as None; any other error reply raised
    (a MOVED reply taken for a count was the TypeError of issue 12)."""
    out = []
    for reply in replies:
        if isinstance(reply, ResponseError) and "NOGROUP" in str(reply):
            reply = None
        elif isinstance(reply, Exception):
            raise reply
        out.append(reply)
    return out


def _worker_row(name: str, last_beat: float, raw: bytes | str | None, now: float) -> dict[str, Any]:
    row: dict[str, Any] = {"worker": name, "heartbeat_age_s": round(now - last_beat, 1), "state": "gone"}
    if raw:
        hb = json.loads(raw)
        row.update(
            state=hb.get("state", "?"),
            device=hb.get("device"),
            model=hb.get("model"),
            running=hb.get("running"),
            waiting=hb.get("waiting"),
            held=hb.get("held_jobs"),
            kv_utilization=hb.get("kv_utilization"),
            free_blocks=hb.get("free_blocks"),
            total_blocks=hb.get("total_blocks"),
            completed=hb.get("completed"),
            failed=hb.get("failed"),
            rejected=hb.get("rejected"),
            heartbeat_age_s=round(now - hb.get("updated_at", last_beat), 1),
            host=hb.get("host"),
            pid=hb.get("pid"),
            celery_queue=hb.get("celery_queue"),
            tenants=hb.get("tenants") or {},
            loras=hb.get("loras") or {},
            admit_delay=hb.get("admit_delay") or {},
        )
    return row


def tenant_totals(workers: list[dict[str, Any]], key: str = "tenants") -> dict[str, dict[str, int]]:
    """Per tenant (or per LoRA adapter: key "loras"), summed over the live workers' heartbeats (each names its
    busiest)."""
    totals: dict[str, dict[str, int]] = {}
    for w in workers:
        for tenant, figures in (w.get(key) or {}).items():
            row = totals.setdefault(tenant, {})
            for key, value in figures.items():
                row[key] = row.get(key, 0) + int(value)
    return totals


def render(statuses: list[dict[str, Any]]) -> str:
    lines = []
    for st in statuses:
        lines.append(
            f"queue {st['queue']}: depth {st['depth']} (undelivered {st['undelivered']}, pending "
            f"{st['pending']}), dead letters {st['dead_letters']}, cancel requests {st['cancel_requests']}"
        )
        for band, b in st["bands"].items():
            lines.append(
                f"  band {band}: depth {b['depth']} (undelivered {b['undelivered']}, pending "
                f"{b['pending']}), dead letters {b['dead_letters']}"
            )
        header = [
            "WORKER",
            "STATE",
            "BEAT AGE",
            "DEVICE",
            "MODEL",
            "RUNNING",
            "WAITING",
            "KV USED",
            "DONE",
            "FAILED",
            "REJECTED",
            "READ-TO-ADMIT-P99-MS",
        ]
        rows = [
            [
                w["worker"],
                w["state"],
                f"{w['heartbeat_age_s']}s",
                w.get("device") or "-",
                _short(w.get("model")),
                _n(w.get("running")),
                _n(w.get("waiting")),
                "-" if w.get("kv_utilization") is None else f"{100 * w['kv_utilization']:.1f}%",
                _n(w.get("completed")),
                _n(w.get("failed")),
                _n(w.get("rejected")),
                ",".join(f"{band}={d['p99_ms']}" for band, d in (w.get("admit_delay") or {}).items()) or "-",
            ]
            for w in st["workers"]
        ]
        if not rows:
            lines.append("  (no workers)")
            continue
        _table(lines, header, rows)
        tenants = st.get("tenants") or {}
        if tenants:
            keys = ("waiting", "in_engine", "admitted", "admitted_tokens")
            _table(
                lines,
                ["TENANT", *(k.upper().replace("_", " ") for k in keys)],
                [[name or "(none)", *(_n(figures.get(k)) for k in keys)] for name, figures in tenants.items()],
            )
        loras = st.get("loras") or {}
        if loras:
            keys = ("waiting", "running", "requests", "tokens")
            _table(
                lines,
                ["LORA ADAPTER", *(k.upper() for k in keys)],
                [[name, *(_n(figures.get(k)) for k in keys)] for name, figures in sorted(loras.items())],
            )
    return "\n".join(lines)


def _table(lines: list[str], header: list[str], rows: list[list[Any]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        lines.append("  " + "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())


def run(args: argparse.Namespace) -> int:
    r = connect(redis_url(args.redis))
    statuses = [queue_status(r, q) for q in (args.queue or discover_queues(r))]
    print(json.dumps({"queues": statuses}) if args.json else render(statuses))
    return 0


def _short(model: str | None, width: int = 40) -> str:
    if not model:
        return "-"
    return model if len(model) <= width else "…" + model[-(width - 1) :]


def _n(value: Any) -> str:
    return "-" if value is None else str(value)
