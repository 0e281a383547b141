"""`pagedq bench worker --mixed`: interactive jobs behind a bulk backlog, against the same jobs on an idle
queue, and the bulk backlog's throughput against a bulk-only run; one worker on the stub engine (or, with
`--mixed-engine llm`, the real engine on `--model`, default the demo model), all in the same run and the same
process. Prints one JSON line."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np

from pagedq.bench.worker.tenants import bench_tenants
from pagedq.worker.assembly import Worker
from pagedq.worker.client.sync_client import Client
from pagedq.worker.flags import Option
from pagedq.worker.protocol.connection import connect
from pagedq.worker.protocol.job import FinalRecord
from pagedq.worker.service.config import WorkerSettings
from pagedq.worker.service.engine_api import WorkerEngine
from pagedq.worker.testing.stub_engine import StubEngine

OPTIONS: tuple[Option, ...] = (
    Option("mixed", bool, False, "mixed traffic: interactive behind a bulk backlog"),
    Option("mixed_bulk_jobs", int, 3000, "bulk backlog jobs", bounds={"ge": 1}),
    Option("mixed_bulk_tokens", int, 32, "tokens per bulk job", bounds={"ge": 1}),
    Option("mixed_web_jobs", int, 20, "interactive jobs", bounds={"ge": 1}),
    Option("mixed_web_tokens", int, 8, "tokens per interactive job", bounds={"ge": 1}),
    Option("mixed_web_every", float, 0.1, "seconds between interactive submissions", bounds={"ge": 0}),
    Option("mixed_step_delay", float, 0.01, "stub engine seconds per step", bounds={"ge": 0}),
    Option("mixed_max_num_seqs", int, 32, "the engine's max_num_seqs", bounds={"ge": 1}),
    Option(
        "mixed_part",
        str,
        "all",
        "runs: bands (interactive, bulk), tenants (A, B), all",
        choices=("all", "bands", "tenants"),
    ),
    Option(
        "mixed_tenant_a_jobs", int, 2000, "tenant A's bulk jobs (0: no tenant runs)", bounds={"ge": 0, "le": 100_000}
    ),
    Option("mixed_tenant_b_jobs", int, 50, "tenant B's bulk jobs, behind A's", bounds={"ge": 1, "le": 100_000}),
    Option("mixed_tenant_tokens", int, 16, "tokens per job of tenants A and B", bounds={"ge": 1, "le": 100_000}),
    Option(
        "mixed_engine",
        str,
        "stub",
        "llm: the real engine on --model (default: the demo model) with --device, "
        "--dtype, --block-size, --num-kv-blocks, --max-num-batched-tokens; a fresh one per run",
        choices=("stub", "llm"),
    ),
)


def _engine(args: argparse.Namespace) -> WorkerEngine:
    if args.mixed_engine == "stub":
        return StubEngine(max_num_seqs=args.mixed_max_num_seqs, step_delay_s=args.mixed_step_delay)
    from pagedq.engine import LLMEngine, SamplingParams
    from pagedq.engine.options import engine_kwargs_from

    engine = LLMEngine(args.model, **{**engine_kwargs_from(args), "max_num_seqs": args.mixed_max_num_seqs})
    engine.add_request("warm-up", "warm up", SamplingParams(max_tokens=4))  # first-step costs out of the runs
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_step_stats()
    return engine


def _step_s(args: argparse.Namespace, engine: WorkerEngine) -> float:
    """One engine step: the stub's delay, or the real engine's mean step over the run."""
    if args.mixed_engine == "stub":
        return args.mixed_step_delay
    stats_of = getattr(engine, "stats", None)  # LLMEngine's; the worker protocol does not need it
    if stats_of is None:
        raise TypeError(f"--mixed-engine {args.mixed_engine}: {type(engine).__name__} reports no step stats")
    stats = stats_of()
    return sum(stats[f"{phase}_ms_per_step"] for phase in ("schedule", "execute", "postprocess")) / 1e3


def _worker(args: argparse.Namespace, url: str, queue: str, burst: bool, **overrides: Any) -> Worker:
    # The stub engine never takes a seat from a running job (pagedq/engine/core/seats.py is the real engine's): it keeps
    # two free
    overrides = {"reserve_seqs": 2 if args.mixed_engine == "stub" else 0, **overrides}
    settings = WorkerSettings(queue=queue, name=f"bench-{queue}", burst=burst, heartbeat_every_s=60.0, **overrides)
    return Worker(_engine(args), connect(url), settings)


def _submit_web(client: Client, args: argparse.Namespace) -> list[str]:
    ids = []
    for i in range(args.mixed_web_jobs):
        ids.append(
            client.submit(
                prompt=f"web request {i}",
                max_tokens=args.mixed_web_tokens,
                temperature=0.0,
                ignore_eos=True,
                priority=10,
            )
        )
        time.sleep(args.mixed_web_every)
    return ids


def _latencies(client: Client, ids: list[str]) -> dict[str, float]:
    records = [client.result(job_id, timeout=600) for job_id in ids]
    assert all(r.ok for r in records), [r.error for r in records if not r.ok][:3]
    ttft = np.array([r.timings.ttft for r in records])
    total = np.array([r.timings.total for r in records])
    return {
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4),
        "total_p50_s": round(float(np.percentile(total, 50)), 4),
        "total_p99_s": round(float(np.percentile(total, 99)), 4),
    }


def _bulk(client: Client, args: argparse.Namespace) -> list[str]:
    jobs = [
        dict(
            prompt=f"bulk document {i}",
            max_tokens=args.mixed_bulk_tokens,
            temperature=0.0,
            ignore_eos=True,
            band="bulk",
        )
        for i in range(args.mixed_bulk_jobs)
    ]
    ids = []
    for i in range(0, len(jobs), 1000):
        ids += client.submit_many(jobs[i : i + 1000])
    return ids


def idle_run(url: str, args: argparse.Namespace) -> dict[str, float]:
    client = Client(url, queue="mixidle")
    worker = _worker(args, url, "mixidle", burst=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        ids = _submit_web(client, args)
        return _latencies(client, ids)
    finally:
        worker.request_stop(drain_timeout_s=5.0)
        thread.join(timeout=30)


def mixed_run(url: str, args: argparse.Namespace) -> tuple[dict[str, float], float, float]:
    """Interactive latencies behind the backlog, and the backlog's bulk tokens/s over the whole burst run."""
    client = Client(url, queue="mixed")
    bulk = _bulk(client, args)
    web: list[str] = []

    def web_traffic() -> None:  # once the backlog is under way
        while client.r.xlen(client.keys.completions) < min(100, len(bulk) // 10):
            time.sleep(0.01)
        web.extend(_submit_web(client, args))

    thread = threading.Thread(target=web_traffic, daemon=True)
    thread.start()
    seconds, engine = _timed_burst(args, url, "mixed")
    thread.join(timeout=600)
    unserved = [job_id for job_id in web if not client.r.exists(client.keys.final(job_id))]
    if unserved or len(web) < args.mixed_web_jobs:
        raise RuntimeError(
            f"the bulk backlog ran out before the interactive jobs did ({len(unserved)} left unserved): "
            "raise --mixed-bulk-jobs or --mixed-bulk-tokens"
        )
    return _latencies(client, web), _bulk_tokens(client, bulk) / seconds, _step_s(args, engine)


def bulk_only_run(url: str, args: argparse.Namespace) -> float:
    client = Client(url, queue="bulkonly")
    bulk = _bulk(client, args)
    seconds, _ = _timed_burst(args, url, "bulkonly", reserve_seqs=0)  # all slots: what bulk had before bands
    return _bulk_tokens(client, bulk) / seconds


def _timed_burst(args: argparse.Namespace, url: str, queue: str, **overrides: Any) -> tuple[float, WorkerEngine]:
    worker = _worker(args, url, queue, burst=True, **overrides)
    start = time.perf_counter()
    worker.run()
    return time.perf_counter() - start, worker.engine


def _bulk_tokens(client: Client, ids: list[str]) -> int:
    pipe = client.r.pipeline(transaction=False)
    for job_id in ids:
        pipe.get(client.keys.final(job_id))
    records = [FinalRecord.model_validate_json(raw) for raw in pipe.execute()]
    return sum(len(r.token_ids) for r in records if r.ok)


def _finals(client: Client, ids: list[str]) -> list[FinalRecord]:
    pipe = client.r.pipeline(transaction=False)
    for job_id in ids:
        pipe.get(client.keys.final(job_id))
    return [FinalRecord.model_validate_json(raw) for raw in pipe.execute()]


def bench_mixed(url: str, args: argparse.Namespace) -> dict[str, Any]:
    engine_name = (
        f"stub, {args.mixed_step_delay} s/step"
        if args.mixed_engine == "stub"
        else f"llm {args.model or 'demo model'} on {args.device}"
    )
    out: dict[str, Any] = {"engine": f"{engine_name}, max_num_seqs {args.mixed_max_num_seqs}"}
    if args.mixed_part in ("all", "bands"):
        out.update(bench_bands(url, args))
    if args.mixed_part in ("all", "tenants") and args.mixed_tenant_a_jobs:
        out["tenants"] = bench_tenants(_worker, url, args)
    return out


def bench_bands(url: str, args: argparse.Namespace) -> dict[str, Any]:
    idle = idle_run(url, args)
    mixed, mixed_tok_s, step = mixed_run(url, args)
    only_tok_s = bulk_only_run(url, args)
    return {
        "engine_step_s": round(step, 4),  # the mean step of the mixed run
        "bulk_jobs": args.mixed_bulk_jobs,
        "bulk_tokens": args.mixed_bulk_tokens,
        "interactive_jobs": args.mixed_web_jobs,
        "interactive_tokens": args.mixed_web_tokens,
        "interactive_idle": idle,
        "interactive_behind_backlog": mixed,
        # issue 23's targets: p99 behind the backlog within 3x idle p99 + 0.5 s; bulk keeps 0.85 of its throughput
        "interactive_p99_target_s": round(3 * idle["total_p99_s"] + 0.5, 4),
        "interactive_p99_met": mixed["total_p99_s"] <= 3 * idle["total_p99_s"] + 0.5,
        "bulk_tokens_per_s_mixed": round(mixed_tok_s, 1),
        "bulk_tokens_per_s_bulk_only": round(only_tok_s, 1),
        "bulk_throughput_ratio": round(mixed_tok_s / only_tok_s, 3),
        "bulk_target_met": mixed_tok_s >= 0.85 * only_tok_s,
    }
