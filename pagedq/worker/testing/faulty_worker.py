"""`pagedq worker` with test-only fault injection around its engine (faults.py; switched on by PAGEDQ_FAULT_PROMPT
and PAGEDQ_FAULT_MODE): what tests start as `python -m pagedq.worker.testing.faulty_worker worker ARGS` to crash or
break a worker process. The production command (pagedq/worker/cli/main.py) has no fault code: this entry point
runs the same worker with the engine it builds wrapped."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import structlog

from pagedq.engine.cli import run_command
from pagedq.worker.cli.engine import build_engine
from pagedq.worker.cli.main import build_parser, cmd_worker, run_worker
from pagedq.worker.cli.startup_errors import with_readable_errors
from pagedq.worker.testing import faults


def build_faulty_engine(args: argparse.Namespace) -> tuple[Any, str]:
    engine, model = build_engine(args)
    wrapped = faults.wrap_from_env(engine)
    if wrapped is not engine:
        structlog.get_logger("pagedq.worker").warning("fault_injection_on", **faults.requested_by())
    return wrapped, model


def cmd_faulty_worker(args: argparse.Namespace) -> int:
    return run_worker(args, build_faulty_engine)


def main(argv: list[str] | None = None) -> int:
    args = build_parser(prog="faulty_worker").parse_args(argv)
    if args.func is not cmd_worker:
        raise SystemExit(f"faulty_worker runs `worker` only, not {args.command!r}")
    args.func = with_readable_errors(cmd_faulty_worker)  # as pagedq/worker/cli/main.py's main() does
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
