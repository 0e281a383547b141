"""`pagedq bench worker --mixed` (--mixed-part tenants): tenant A's bulk backlog, then tenant B's jobs; B's
completion time against B alone, A's throughput against A alone (pagedq/worker/service/tenants.py's fair shares)."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any

from pagedq.worker.assembly import Worker
from pagedq.worker.client.sync_client import Client
from pagedq.worker.protocol.job import FinalRecord


def _tenant_jobs(tenant: str, count: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [
        dict(
            prompt=f"{tenant} document {i}",
            max_tokens=args.mixed_tenant_tokens,
            temperature=0.0,
            ignore_eos=True,
            band="bulk",
            tenant=tenant,
        )
        for i in range(count)
    ]


MakeWorker = Callable[..., Worker]  # mixed._worker: (args, url, queue, burst, **settings) -> a worker on a fresh engine


def tenant_run(
    make_worker: MakeWorker, url: str, args: argparse.Namespace, queue: str, a_jobs: int, b_jobs: int
) -> dict[str, float]:
    """A's jobs enqueued, a worker started (reading far enough ahead to see past A's backlog: --tenant-read-ahead),
    and once A's are under way, B's: the seconds from B's enqueue to its last final record, and A's tokens/s from
    the worker's start to A's last final record."""
    client = Client(url, queue=queue)
    a_ids: list[str] = []
    for i in range(0, a_jobs, 1000):
        a_ids += client.submit_many(_tenant_jobs("A", a_jobs, args)[i : i + 1000])
    worker = make_worker(args, url, queue, burst=False, tenant_read_ahead=a_jobs + b_jobs)  # loads the engine
    thread = threading.Thread(target=worker.run, daemon=True)
    started = time.time()
    thread.start()
    out: dict[str, float] = {}
    try:
        while a_ids and client.r.xlen(client.keys.completions) < min(100, a_jobs // 10):
            time.sleep(0.01)
        b_ids = client.submit_many(_tenant_jobs("B", b_jobs, args)) if b_jobs else []
        if b_ids:  # a final record's `total` runs from its job's enqueue
            out["b_done_s"] = round(max(r.timings.total or 0.0 for r in _results(client, b_ids)), 3)
        if a_ids:  # waited for in turn, so the wait ends as A's last final record is written
            finals = _results(client, a_ids)
            out["a_tokens_per_s"] = round(sum(len(r.token_ids) for r in finals) / (time.time() - started), 1)
    finally:
        worker.request_stop(drain_timeout_s=5.0)
        thread.join(timeout=30)
    return out


def _results(client: Client, ids: list[str]) -> list[FinalRecord]:
    records = [client.result(job_id, timeout=3600) for job_id in ids]
    if not all(r.ok for r in records):
        raise RuntimeError(f"a tenant job did not complete: {[r.error for r in records if not r.ok][:3]}")
    return records


def bench_tenants(make_worker: MakeWorker, url: str, args: argparse.Namespace) -> dict[str, Any]:
    a_jobs, b_jobs = args.mixed_tenant_a_jobs, args.mixed_tenant_b_jobs
    b_alone = tenant_run(make_worker, url, args, "tenantb", 0, b_jobs)["b_done_s"]
    a_alone = tenant_run(make_worker, url, args, "tenanta", a_jobs, 0)["a_tokens_per_s"]
    both = tenant_run(make_worker, url, args, "tenantab", a_jobs, b_jobs)
    return {
        "a_jobs": a_jobs,
        "b_jobs": b_jobs,
        "tokens_per_job": args.mixed_tenant_tokens,
        "b_done_alone_s": b_alone,
        "b_done_behind_a_s": both["b_done_s"],
        "b_slowdown": round(both["b_done_s"] / b_alone, 3),
        "b_target_met": both["b_done_s"] <= 2 * b_alone,
        "a_tokens_per_s_alone": a_alone,
        "a_tokens_per_s_with_b": both["a_tokens_per_s"],
        "a_throughput_ratio": round(both["a_tokens_per_s"] / a_alone, 3),
        "a_target_met": both["a_tokens_per_s"] >= 0.9 * a_alone,
    }
