"""The `pagedq` command: the queue's commands (`worker`, `demo`, `bulk`, `status`, `dlq`, `serve`, `bench worker`,
`bench gateway`, `bench fleet`) next to the engine's (`generate`, from pagedq/engine/cli.py) and the benchmarks'
(`bench throughput|host|kernels`, from pagedq/bench/cli.py).

Every flag of the queue's commands is also a PAGEDQ_* variable (pagedq/worker/flags.py); `python -m pagedq.worker ...`
is the same command. Building the parser imports neither torch nor the engine's modules beyond pagedq/engine/options.py.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from pagedq.bench.cli import register_benches
from pagedq.engine.cli import package_version, register_commands, run_command
from pagedq.worker.cli.engine import build_engine, engine_device
from pagedq.worker.cli.startup_errors import with_readable_errors
from pagedq.worker.flags import Option, SettingsParser, add_options, dataclass_options, engine_flag_options
from pagedq.worker.logs import configure_logging
from pagedq.worker.service.config import WorkerSettings

# The engine a worker, demo or bench runs: the engine's knobs (pagedq/engine/options.py) and the queue-side choices.
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
    Option("celery", bool, False, "also serve the Celery queue of worker.celery.app"),
    Option(
        "local_redis_port",
        int,
        6379,
        "with neither --redis nor PAGEDQ_REDIS_URL: use the Redis answering on 127.0.0.1 at this port (the default "
        "URL of serve, Client() and the other commands), else start a private redis-server on it, else on a free "
        "port (logged with its URL); 0: a private redis-server on a free port always",
        bounds={"ge": 0, "le": 65535},
    ),
)
DEMO_OPTIONS = (Option("max_tokens", int, 32, "tokens per demo answer at most", bounds={"ge": 1}),)
BENCH_OPTIONS = (
    Option("stub_jobs", int, 20_000, "jobs through the stub engine (queue layer)", bounds={"ge": 1}),
    Option("e2e_jobs", int, 64, "jobs through the real engine (0 skips it)", bounds={"ge": 0}),
    Option("e2e_max_tokens", int, 32, "tokens per end-to-end job", bounds={"ge": 1}),
    Option("e2e_repeats", int, 3, "alternate offline/worker runs; best of each", bounds={"ge": 1}),
    Option(
        "e2e_prompt_tokens",
        str,
        "",
        "LOW:HIGH: token-id prompts of LOW to HIGH tokens (seeded) instead of text prompts (issue 23: 16:200)",
    ),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the top-level queue commands."""
    p = subparsers.add_parser("worker", help="serve generation jobs from a Redis queue")
    add_worker_args(p)
    p.set_defaults(func=cmd_worker)
    d = subparsers.add_parser("demo", help="embedded Redis + worker on the demo model; enqueue a few jobs")
    add_options(d, (*ENGINE_OPTIONS, *DEMO_OPTIONS))
    d.set_defaults(func=cmd_demo)
    from pagedq.worker.bulk import run as bulk
    from pagedq.worker.ops import dlq, status

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
    """`pagedq serve` (pagedq/worker/gateway/): FastAPI and uvicorn are imported only when it runs."""

    @staticmethod
    def add_args(p: argparse.ArgumentParser) -> None:
        from pagedq.worker.gateway.serve import add_args

        add_args(p)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from pagedq.worker.gateway.serve import run

        return run(args)


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add `bench worker`, `bench gateway` and `bench fleet` under the `bench` group."""
    p = bench_subparsers.add_parser("worker", help="queue-layer and end-to-end worker throughput (one JSON line)")
    from pagedq.bench.worker.mixed import OPTIONS as MIXED_OPTIONS

    add_options(p, (*ENGINE_OPTIONS, *BENCH_OPTIONS, *MIXED_OPTIONS))
    p.set_defaults(func=cmd_bench)
    g = bench_subparsers.add_parser("gateway", help="pagedq serve vs the native client on the stub engine (JSON)")
    from pagedq.bench.worker.gateway_args import add_args as add_gateway_bench_args

    add_gateway_bench_args(g)
    g.set_defaults(func=cmd_bench_gateway)
    f = bench_subparsers.add_parser("fleet", help="worker processes scaled out, in and killed under a backlog (JSON)")
    from pagedq.bench.worker.fleet_args import add_args as add_fleet_bench_args

    add_fleet_bench_args(f)
    f.set_defaults(func=cmd_bench_fleet)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis",
        default=None,
        help="Redis URL (default: $PAGEDQ_REDIS_URL, else the Redis on 127.0.0.1:6379, else a private redis-server "
        "started there: see --local-redis-port)",
    )
    add_options(p, (*ENGINE_OPTIONS, *WORKER_OPTIONS))


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
    return run_worker(args, build_engine)


EngineBuilder = Callable[[argparse.Namespace], tuple[Any, str]]  # the engine for the flags, and its model's name


def run_worker(args: argparse.Namespace, engine_builder: EngineBuilder) -> int:
    """`pagedq worker` with the engine engine_builder makes (the tests' fault-injecting entry point passes its own:
    pagedq/worker/testing/faulty_worker.py)."""
    import structlog

    from pagedq.worker import telemetry
    from pagedq.worker.assembly import Worker
    from pagedq.worker.ops.local_redis import local_redis
    from pagedq.worker.protocol.connection import connect
    from pagedq.worker.protocol.settings import configured_redis_url

    configure_logging(args.log_level)
    log = structlog.get_logger("pagedq.worker")
    telemetry.start("pagedq-worker")  # OTEL_* variables: the jobs' spans (pagedq/worker/service/job_spans.py)
    embedded = None
    args.redis = configured_redis_url(args.redis)
    if args.redis is None:
        local = local_redis(args.local_redis_port)
        embedded = local.server
        args.redis = local.url
        (log.warning if local.warn else log.info)(local.event, url=local.url, reason=local.reason)
    try:
        redis_client = connect(args.redis)
        redis_client.ping()  # a wrong or unreachable Redis is reported now, not after a model load of minutes
        check_lora_modules(args)  # likewise
        engine, model = engine_builder(args)
        if args.engine == "llm":
            from pagedq.engine.structured_output import backend

            if not backend.installed():  # else each structured request would be refused only when it comes
                log.warning("structured_outputs_unavailable", hint=backend.INSTALL_HINT)
        device = engine_device(engine, args.device)
        worker = Worker(engine, redis_client, settings_from_args(args, device, model))
        return worker.run()
    finally:
        telemetry.shutdown()
        if embedded is not None:
            embedded.stop()


def check_lora_modules(args: argparse.Namespace) -> None:
    """--lora-modules well formed, and the real engine started with adapter slots for them (LoraModulesError)."""
    from pagedq.worker.protocol.registry import LoraModulesError, parse_lora_modules

    if parse_lora_modules(args.lora_modules) and args.engine == "llm" and not args.enable_lora:
        raise LoraModulesError("--lora-modules needs --enable-lora (the engine's LoRA adapter slots)")


def cmd_demo(args: argparse.Namespace) -> int:
    from pagedq.worker.cli.demo import run_demo

    configure_logging("warning")
    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedq.bench.worker.throughput import run_bench

    configure_logging("error")
    return run_bench(args)


def cmd_bench_gateway(args: argparse.Namespace) -> int:
    from pagedq.bench.worker.gateway import run

    configure_logging("error")
    return run(args)


def cmd_bench_fleet(args: argparse.Namespace) -> int:
    from pagedq.bench.worker.fleet import run_bench

    configure_logging("error")
    return run_bench(args)


def build_parser(prog: str = "pagedq") -> argparse.ArgumentParser:
    """The `pagedq` command (also `python -m pagedq.worker`): the engine's commands and the queue's."""
    parser = SettingsParser(prog=prog, description="LLM inference worker over a paged KV cache")
    parser.add_argument("--version", action="version", version=f"pagedq {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    register_commands(commands)
    register(commands)
    register_bench(register_benches(commands))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func = with_readable_errors(args.func)  # known start-up mistakes: one line, one JSON log line, exit 2
    return run_command(args)
