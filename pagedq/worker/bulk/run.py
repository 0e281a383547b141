"""`pagedq bulk INPUT.jsonl OUTPUT.jsonl`: run a file of requests through the queue, resumably.

Input lines: the OpenAI Batch format (`{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {"prompt" or "messages", "max_tokens", "temperature", ...}}`) or a plain
`{"custom_id", "prompt" | "messages" | "prompt_token_ids", <job fields>}`. Output lines follow the OpenAI
batch output shape (`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`),
written as each job finishes (not in input order); everything that did not complete (bad JSON, invalid
request, duplicate custom_id, rejected/failed/cancelled/expired) goes to the errors file instead.

Idempotent by custom_id: the job id is derived from the input file's content hash (or --run-id, bound to that
hash) and the custom_id, and jobs are enqueued by a script that adds each id to a per-run set first, so a rerun
after an interruption skips custom_ids already in OUTPUT/errors, awaits jobs already enqueued and enqueues the
rest. What a run may touch (never its input, never another file's last line) is bulk/resume.py's to say.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagedq.worker.bulk.resume import BulkRefused
from pagedq.worker.bulk.runner import BulkRun
from pagedq.worker.flags import Option, add_options, queue_option
from pagedq.worker.protocol.connection import connect
from pagedq.worker.protocol.keys import BANDS
from pagedq.worker.protocol.settings import redis_url
from pagedq.worker.protocol.tool_calls import DEFAULT_MAX_TOOL_CALLS

OPTIONS = (
    Option("errors", Path, None, "errors file (default: OUTPUT with .errors.jsonl)", nullable=True),
    queue_option(),
    Option("band", str, "bulk", "priority band of the jobs", choices=tuple(BANDS)),
    Option("window", int, 256, "jobs in flight at most (backpressure)", bounds={"ge": 1, "le": 100_000}),
    Option(
        "run_id",
        str,
        None,
        "namespace of the job ids (default: the input's content hash; one given is bound to its input); a new one "
        "re-runs everything",
        nullable=True,
    ),
    Option("ttl", int, 86_400, "seconds the run's enqueue record is kept", bounds={"ge": 1}),
    Option(
        "max_tool_calls",
        int,
        DEFAULT_MAX_TOOL_CALLS,
        'calls of one tool_choice "required" answer at most, when parallel_tool_calls allows more than one',
        bounds={"ge": 1, "le": 1024},
    ),
    Option("no_progress", bool, False, "no progress bar on stderr"),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", type=Path, help="JSONL file of requests (OpenAI batch lines or plain job lines)")
    p.add_argument("output", type=Path, help="JSONL file the results are appended to")
    p.add_argument("--redis", default=None, help="Redis URL (default: $PAGEDQ_REDIS_URL or redis://localhost:6379/0)")
    add_options(p, OPTIONS)


def run(args: argparse.Namespace) -> int:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    r = connect(redis_url(args.redis))
    # An unreachable Redis fails here, before any output file exists (pagedq/worker/cli/startup_errors.py words it).
    r.ping()
    runner: BulkRun | None = None
    try:
        runner = BulkRun(
            r,
            args.input,
            args.output,
            args.errors,
            queue=args.queue,
            band=args.band,
            window=args.window,
            run_id=args.run_id,
            ttl_s=args.ttl,
            max_tool_calls=args.max_tool_calls,
            progress=not args.no_progress,
        )
        counts = runner.run()
    except BulkRefused as refused:  # the same words and status as a start-up mistake (cli/startup_errors.py)
        print(f"pagedq bulk: error: {refused}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # while reading the input's hash too: no job in flight yet
        print(
            f"\ninterrupted with {len(runner.pending) if runner else 0} jobs in flight: they keep running; run the "
            f"same command again to collect them (nothing is enqueued twice)",
            file=sys.stderr,
        )
        return 130
    # Files and counts under separate keys: "errors" is the count, "errors_file" the path.
    print(
        json.dumps(
            {"run_id": runner.run_id, "output_file": str(args.output), "errors_file": str(runner.errors), **counts}
        )
    )
    return 0
