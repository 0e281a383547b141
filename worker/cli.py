"""The `pagedq` command: the queue's commands (`worker`, `demo`, `bulk`, `status`, `dlq`, `serve`, `bench worker`,
`bench gateway`) next to the engine's (`generate`, `bench throughput|host|kernels`, from engine/cli.py).

Every flag of the queue's commands is also a PAGEDQ_* variable (worker/cli_options.py); `python -m worker ...` is the
same command. Building the parser imports neither torch nor the engine's modules beyond engine/options.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from engine.cli import package_version, register_commands, run_command

from .cli_options import Option, SettingsParser, add_options, dataclass_options, engine_flag_options
from .config import WorkerSettings
from .startup_errors import with_readable_errors

# The engine a worker, demo or bench runs: the engine's knobs (engine/options.py) and the queue-side choices.
ENGINE_OPTIONS: tuple[Option, ...] = (
    Option("model", str, None, "model folder (default: the demo model)", nullable=True),
    *engine_flag_options(),
    Option(
        "engine",
        str,
        "llm",
        "stub: a fake engine that returns at once (queue tests and benchmarks)",
        choices=("llm", "stub"),
    ),
    Option("stub_step_delay", float, 0.0, "seconds per stub engine step", bounds={"ge": 0}),
    Option("log_level", str, "info", "level of the JSON log on stderr", choices=("debug", "info", "warning", "error")),
)
WORKER_OPTIONS: tuple[Option, ...] = (
    *dataclass_options(WorkerSettings),
    Option("celery", bool, False, "also serve the Celery queue of worker.celery_app"),
)
DEMO_OPTIONS = (Option("max_tokens", int, 32, "tokens per demo answer at most", bounds={"ge": 1}),)
BENCH_OPTIONS = (
    Option("stub_jobs", int, 20_000, "jobs through the stub engine (queue layer)", bounds={"ge": 1}),
    Option("e2e_jobs", int, 64, "jobs through the real engine (0 skips it)", bounds={"ge": 0}),
    Option("e2e_max_tokens", int, 32, "tokens per end-to-end job", bounds={"ge": 1}),
    Option("e2e_repeats", int, 3, "alternate offline/worker runs; best of each", bounds={"ge": 1}),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the top-level queue commands."""
    p = subparsers.add_parser("worker", help="serve generation jobs from a Redis queue")
    add_worker_args(p)
    p.set_defaults(func=cmd_worker)
    d = subparsers.add_parser("demo", help="embedded Redis + worker on the demo model; enqueue a few jobs")
    add_options(d, (*ENGINE_OPTIONS, *DEMO_OPTIONS))
    d.set_defaults(func=cmd_demo)
    from . import bulk, dlq, status

    for name, module, help_text in (
        ("bulk", bulk, "run a JSONL file of requests (OpenAI batch format) through the queue, resumably"),
        ("status", status, "workers, queue depths, pending jobs and dead letters"),
        ("dlq", dlq, "list, retry or purge dead-lettered jobs"),
        ("serve", _LazyServe, "OpenAI-compatible HTTP gateway over the queue (completions, chat, batches)"),
    ):
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


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add `bench worker` and `bench gateway` under the `bench` group."""
    p = bench_subparsers.add_parser("worker", help="queue-layer and end-to-end worker throughput (one JSON line)")
    from .bench_mixed import OPTIONS as MIXED_OPTIONS

    add_options(p, (*ENGINE_OPTIONS, *BENCH_OPTIONS, *MIXED_OPTIONS))
    p.set_defaults(func=cmd_bench)
    g = bench_subparsers.add_parser("gateway", help="pagedq serve vs the native client on the stub engine (JSON)")
    from .gateway.bench_args import add_args as add_gateway_bench_args

    add_gateway_bench_args(g)
    g.set_defaults(func=cmd_bench_gateway)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis", default=None, help="Redis URL (default: $PAGEDQ_REDIS_URL, else a private redis-server is started)"
    )
    add_options(p, (*ENGINE_OPTIONS, *WORKER_OPTIONS))


class _CurrentStderr:
    """Whatever sys.stderr is when a line is written. structlog's PrintLogger keeps the file it was given, and a
    worker started later in the same process (tests capturing stderr, an embedding app replacing it) must not
    write to a closed one: that raised in the worker loop and stopped it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info") -> None:
    import structlog

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(_CurrentStderr()),  # type: ignore[arg-type]  # a TextIO's write
        cache_logger_on_first_use=True,
    )


def build_engine(args: argparse.Namespace) -> tuple[Any, str]:
    """The engine named by the arguments and the model name to report."""
    if args.engine == "stub":
        from .stub_engine import StubEngine

        limits = {"max_model_len": args.max_model_len} if args.max_model_len else {}
        engine = StubEngine(
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            step_delay_s=args.stub_step_delay,
            **limits,
        )
        return engine, "stub"
    from engine import LLMEngine
    from engine.options import engine_kwargs_from
    from engine.startup import freeze_startup_objects

    model = args.model
    if model is None:
        from engine.demo_model import demo_model_path

        model = str(demo_model_path())
    engine = LLMEngine(model, **engine_kwargs_from(args))
    freeze_startup_objects()  # a long-lived worker: keep the engine's start-up objects out of the cyclic GC
    return engine, str(model)


def settings_from_args(args: argparse.Namespace, device: str, model: str) -> WorkerSettings:
    """WorkerSettings from the parsed flags (each flagged field by its option's name)."""
    values = {o.target or o.name: getattr(args, o.name) for o in dataclass_options(WorkerSettings)}
    if values["name"] is None:
        del values["name"]  # the field's default: hostname-pid
    # --celery turns the Celery front door on; its broker defaults to $CELERY_BROKER_URL, else the worker's Redis
    values["celery_broker"] = (
        (args.celery_broker or os.environ.get("CELERY_BROKER_URL") or args.redis) if args.celery else None
    )
    return WorkerSettings(**values, device=device, model=model)


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
        log.info(
            "embedded_redis_started",
            url=embedded.url,
            reason="no Redis configured (neither --redis nor PAGEDQ_REDIS_URL): started a private redis-server",
        )
    try:
        redis_client = connect(args.redis)
        redis_client.ping()  # a wrong or unreachable Redis is reported now, not after a model load of minutes
        engine, model = build_engine(args)
        device = _engine_device(engine, args.device)
        worker = Worker(wrap_from_env(engine), redis_client, settings_from_args(args, device, model))
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


def build_parser(prog: str = "pagedq") -> argparse.ArgumentParser:
    """The `pagedq` command (also `python -m worker`): the engine's commands and the queue's."""
    parser = SettingsParser(prog=prog, description="LLM inference worker over a paged KV cache")
    parser.add_argument("--version", action="version", version=f"pagedq {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    benches = register_commands(commands)
    register(commands)
    register_bench(benches)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func = with_readable_errors(args.func)  # known start-up mistakes: one line, one JSON log line, exit 2
    return run_command(args)
