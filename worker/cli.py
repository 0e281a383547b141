"""CLI wiring: `pagedq worker`, `demo`, `bulk`, `status`, `dlq`, `serve`, `bench worker` (registered by engine/cli.py).

Also runnable without the top-level CLI: ``python -m worker worker --engine stub ...``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from .config import WorkerSettings, default_worker_name


def register(subparsers: Any) -> None:
    """Add the top-level commands `worker` and `demo`."""
    p = subparsers.add_parser("worker", help="serve generation jobs from a Redis queue")
    add_worker_args(p)
    p.set_defaults(func=cmd_worker)
    d = subparsers.add_parser("demo", help="embedded Redis + worker on the demo model; enqueue a few jobs")
    add_engine_args(d)
    d.add_argument("--max-tokens", type=int, default=32, help="tokens per demo answer at most (default 32)")
    d.set_defaults(func=cmd_demo)
    from . import bulk, dlq, status

    for name, module, help_text in (
            ("bulk", bulk, "run a JSONL file of requests (OpenAI batch format) through the queue, resumably"),
            ("status", status, "workers, queue depths, pending jobs and dead letters"),
            ("dlq", dlq, "list, retry or purge dead-lettered jobs"),
            ("serve", _LazyServe, "OpenAI-compatible HTTP gateway over the queue (completions, chat, batches)")):
        sub = subparsers.add_parser(name, help=help_text)
        module.add_args(sub)
        sub.set_defaults(func=module.run)


class _LazyServe:
    """`pagedq serve` (worker/gateway/): FastAPI and uvicorn are imported only when it runs."""

    @staticmethod
    def add_args(p: argparse.ArgumentParser) -> None:
        from .gateway.serve import add_args

        add_args(p)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from .gateway.serve import run

        return run(args)


def register_bench(bench_subparsers: Any) -> None:
    """Add `bench worker` under the `bench` group."""
    p = bench_subparsers.add_parser("worker", help="queue-layer and end-to-end worker throughput (one JSON line)")
    add_engine_args(p)
    p.add_argument("--stub-jobs", type=int, default=20_000, help="jobs through the stub engine (queue layer)")
    p.add_argument("--e2e-jobs", type=int, default=64, help="jobs through the real engine (0 skips it)")
    p.add_argument("--e2e-max-tokens", type=int, default=32, help="tokens per end-to-end job (default 32)")
    p.add_argument("--e2e-repeats", type=int, default=3, help="alternate offline/worker runs; best of each")
    from .bench_mixed import add_args as add_mixed_args

    add_mixed_args(p)
    p.set_defaults(func=cmd_bench)
    g = bench_subparsers.add_parser("gateway", help="pagedq serve vs the native client on the stub engine (JSON)")
    from .gateway.bench_args import add_args as add_gateway_bench_args

    add_gateway_bench_args(g)
    g.set_defaults(func=cmd_bench_gateway)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="where the engine runs")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float16, bfloat16, float32")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: sized from GPU memory)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once at most (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens per engine step at most (default 8192)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--engine", default="llm", choices=["llm", "stub"],
                   help="stub: a fake engine that returns at once (queue tests and benchmarks)")
    p.add_argument("--stub-step-delay", type=float, default=0.0, help="seconds per stub engine step")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="level of the JSON log on stderr (default info)")


def add_worker_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    d = WorkerSettings()
    p.add_argument("--redis", default=None,
                   help="Redis URL (default: $PAGEDQ_REDIS_URL, else a private redis-server is started)")
    p.add_argument("--queue", default=d.queue, help=f"queue name (default {d.queue})")
    p.add_argument("--name", default=None, help="consumer name; keep it stable to re-read own pending jobs on restart")
    p.add_argument("--burst", action="store_true", help="exit once nothing is queued, pending or running")
    p.add_argument("--lease-ms", type=int, default=d.lease_ms,
                   help=f"ms a held job's lease lasts unrenewed before another worker may claim it "
                        f"(default {d.lease_ms})")
    p.add_argument("--max-attempts", type=int, default=d.max_attempts,
                   help=f"deliveries of a job before it is dead-lettered (default {d.max_attempts})")
    p.add_argument("--engine-failure-limit", type=int, default=d.engine_failure_limit,
                   help="distinct jobs failing alone in a row after which the engine counts as broken: the worker "
                        "exits with status 3, leaving its jobs unacknowledged for redelivery")
    p.add_argument("--result-ttl", type=int, default=d.result_ttl_s, help="seconds results are kept")
    p.add_argument("--completions-maxlen", type=int, default=d.completions_maxlen,
                   help=f"approximate length cap of the completions stream (default {d.completions_maxlen})")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help=f"seconds to finish in-flight jobs after SIGTERM (default {d.drain_timeout_s})")
    p.add_argument("--redis-outage", type=float, default=d.redis_outage_s,
                   help="seconds to keep generating and reconnecting while Redis is unreachable before exiting "
                        "with status 4")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help=f"jobs read ahead into the engine's waiting queue at most (default {d.max_waiting})")
    p.add_argument("--band-min-share", type=float, default=d.band_min_share,
                   help="starvation guard: least share of admissions a lower band keeps while higher ones are busy")
    p.add_argument("--reserve-seqs", type=int, default=d.reserve_seqs,
                   help="engine sequence slots the bulk band leaves free for interactive/default jobs")
    p.add_argument("--block-ms", type=int, default=d.block_ms,
                   help=f"ms to block on XREADGROUP when the engine is idle (default {d.block_ms})")
    p.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_every_s,
                   help=f"seconds between heartbeats (default {d.heartbeat_every_s})")
    p.add_argument("--celery", action="store_true", help="also serve the Celery queue of worker.celery_app")
    p.add_argument("--celery-broker", default=None,
                   help="Celery broker URL (default: $CELERY_BROKER_URL, else the --redis URL)")
    p.add_argument("--celery-backend", default=None, help="result backend URL (default: $CELERY_RESULT_BACKEND, "
                   "else the broker)")
    p.add_argument("--celery-queue", default=None, help="Celery queue (default: $PAGEDQ_CELERY_QUEUE or pagedq)")
    p.add_argument("--celery-visibility-timeout", type=float, default=None,
                   help="seconds before an unacked Celery message is redelivered (default 3600); above the longest job")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-addr", default=d.metrics_addr,
                   help="address the metrics endpoint binds (default 127.0.0.1; it has no authentication)")


def configure_logging(level: str = "info") -> None:
    import structlog

    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def build_engine(args: argparse.Namespace) -> tuple[Any, str]:
    """The engine named by the arguments and the model name to report."""
    if args.engine == "stub":
        from .stub_engine import StubEngine

        engine = StubEngine(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                            max_num_seqs=args.max_num_seqs, step_delay_s=args.stub_step_delay)
        return engine, "stub"
    from engine import LLMEngine
    from engine.startup import freeze_startup_objects

    model = args.model
    if model is None:
        from engine.demo_model import demo_model_path

        model = str(demo_model_path())
    engine = LLMEngine(model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                       num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager)
    freeze_startup_objects()  # a long-lived worker: keep the engine's start-up objects out of the cyclic GC
    return engine, str(model)


def settings_from_args(args: argparse.Namespace, device: str, model: str) -> WorkerSettings:
    return WorkerSettings(
        queue=args.queue, name=args.name or default_worker_name(), lease_ms=args.lease_ms,
        max_attempts=args.max_attempts, engine_failure_limit=args.engine_failure_limit, result_ttl_s=args.result_ttl, completions_maxlen=args.completions_maxlen,
        block_ms=args.block_ms, max_waiting=args.max_waiting, drain_timeout_s=args.drain_timeout,
        redis_outage_s=args.redis_outage,
        heartbeat_every_s=args.heartbeat_interval, burst=args.burst, device=device, model=model,
        celery_broker=((args.celery_broker or os.environ.get("CELERY_BROKER_URL") or args.redis)
                       if args.celery else None),
        celery_backend=args.celery_backend, celery_queue=args.celery_queue,
        celery_visibility_timeout_s=args.celery_visibility_timeout, metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr, band_min_share=args.band_min_share, reserve_seqs=args.reserve_seqs,
    )


def cmd_worker(args: argparse.Namespace) -> int:
    import structlog

    from .connection import connect
    from .embedded_redis import EmbeddedRedis
    from .faults import wrap_from_env
    from .settings import configured_redis_url
    from .worker import Worker

    configure_logging(args.log_level)
    log = structlog.get_logger("pagedq.worker")
    embedded = None
    args.redis = configured_redis_url(args.redis)
    if args.redis is None:
        embedded = EmbeddedRedis().start()
        args.redis = embedded.url
        log.info("embedded_redis_started", url=embedded.url,
                 reason="no Redis configured (neither --redis nor PAGEDQ_REDIS_URL): started a private redis-server")
    try:
        engine, model = build_engine(args)
        device = _engine_device(engine, args.device)
        worker = Worker(wrap_from_env(engine), connect(args.redis), settings_from_args(args, device, model))
        return worker.run()
    finally:
        if embedded is not None:
            embedded.stop()


def _engine_device(engine: Any, default: str) -> str:
    for owner in (engine, getattr(engine, "model_runner", None), getattr(engine, "config", None)):
        device = getattr(owner, "device", None)
        if device is not None:
            return str(device)
    return default


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    configure_logging("warning")
    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    configure_logging("error")
    return run_bench(args)


def cmd_bench_gateway(args: argparse.Namespace) -> int:
    from .gateway.bench import run

    configure_logging("error")
    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """`python -m worker`: the queue commands without the engine's top-level CLI."""
    from engine.cli import StrictArgumentParser, package_version

    parser = StrictArgumentParser(prog="python -m worker")
    parser.add_argument("--version", action="version", version=f"pagedq {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    register_bench(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
