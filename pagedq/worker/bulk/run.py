"""`pagedq bulk INPUT.jsonl OUTPUT.jsonl`: run a file of requests through the queue, resumably.

Input lines: the OpenAI Batch format (`{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {"prompt" or "messages", "max_tokens", "temperature", ...}}`) or a plain
`{"custom_id", "prompt" | "messages" | "prompt_token_ids", <job fields>}`. Output lines follow the OpenAI
batch output shape (`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`),
written as each job finishes (not in input order); everything that did not complete (bad JSON, invalid
request, duplicate custom_id, rejected/failed/cancelled/expired) goes to the errors file instead.

Idempotent by custom_id: the job id is derived from the input file's content hash (or --run-id) and the
custom_id, and jobs are enqueued by a script that adds each id to a per-run set first, so a rerun after an
interruption skips custom_ids already in OUTPUT/errors, awaits jobs already enqueued and enqueues the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedq.worker.bulk.lines import (
    LineError,
    Request,
    custom_id_of,
    error_line,
    file_digest,
    job_id_for,
    output_line,
    read_done,
    read_request,
)
from pagedq.worker.client.core import make_job
from pagedq.worker.flags import Option, add_options, queue_option
from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.connection import SyncRedis, connect
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.keys import BANDS, JOB_FIELD, QueueKeys, check_band
from pagedq.worker.protocol.settings import redis_url

OPTIONS = (
    Option("errors", Path, None, "errors file (default: OUTPUT with .errors.jsonl)", nullable=True),
    queue_option(),
    Option("band", str, "bulk", "priority band of the jobs", choices=tuple(BANDS)),
    Option("window", int, 256, "jobs in flight at most (backpressure)", bounds={"ge": 1, "le": 100_000}),
    Option(
        "run_id",
        str,
        None,
        "namespace of the job ids (default: the input's content hash); a new one re-runs everything",
        nullable=True,
    ),
    Option("ttl", int, 86_400, "seconds the run's enqueue record is kept", bounds={"ge": 1}),
    Option("no_progress", bool, False, "no progress bar on stderr"),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", type=Path, help="JSONL file of requests (OpenAI batch lines or plain job lines)")
    p.add_argument("output", type=Path, help="JSONL file the results are appended to")
    p.add_argument("--redis", default=None, help="Redis URL (default: $PAGEDQ_REDIS_URL or redis://localhost:6379/0)")
    add_options(p, OPTIONS)


# ---------------------------------------------------------------------------------------------- input lines
class BulkRun:
    """Enqueue the input's requests within a window of in-flight jobs, write each result as it finishes."""

    def __init__(
        self,
        r: SyncRedis,
        input_path: Path,
        output_path: Path,
        errors_path: Path | None = None,
        *,
        queue: str = "default",
        band: str = "bulk",
        window: int = 256,
        run_id: str | None = None,
        ttl_s: int = 86_400,
        progress: bool = True,
        poll_s: float = 0.05,
    ) -> None:
        self.r, self.keys, self.window, self.ttl_s, self.poll_s = r, QueueKeys(queue), max(1, window), ttl_s, poll_s
        self.band = check_band(band)
        self.input, self.output = input_path, output_path
        self.errors = errors_path or output_path.with_suffix(".errors.jsonl")
        digest, self.total_lines = file_digest(input_path)
        self.run_id = run_id or digest
        # job id -> (custom_id, line number, the parsed line: its kind, model and ToolSpec). A resumed run re-reads
        # every line not answered yet, jobs in flight at the kill too, so this is rebuilt from the input.
        self.pending: dict[str, tuple[str, int, Request]] = {}
        # "tokens": completion tokens of the results written; "run_tokens": of those that finished while this
        # run watched (what tok/s counts: a resume collects results finished before it in one burst).
        self.counts = {
            "completed": 0,
            "errors": 0,
            "skipped": 0,
            "enqueued": 0,
            "awaited": 0,
            "tokens": 0,
            "run_tokens": 0,
        }
        self._prior: set[str] = set()  # enqueued by an earlier run and not seen unfinished by this one
        self.progress = progress
        self._started = time.monotonic()

    def run(self) -> dict[str, int]:
        """Process every line not answered yet; returns the counts. KeyboardInterrupt stops it cleanly."""
        done_ids, done_lines = read_done(self.output)
        more_ids, more_lines = read_done(self.errors)
        done_ids |= more_ids
        done_lines |= more_lines
        from tqdm import tqdm

        self.bar = tqdm(
            total=self.total_lines,
            initial=len(done_ids) + len(done_lines),
            unit="job",
            file=sys.stderr,
            disable=not self.progress,
            mininterval=0.5,
            dynamic_ncols=True,
        )
        with open(self.output, "a") as self.out, open(self.errors, "a") as self.err:
            try:
                self._loop(self._requests(done_ids, done_lines))
            finally:
                self.bar.close()
        return self.counts

    def _loop(self, source: Iterator[tuple[int, Any, Request]]) -> None:
        exhausted, idle_sleep = False, self.poll_s
        while not exhausted or self.pending:
            batch: list[tuple[int, Any, Request]] = []
            while not exhausted and len(self.pending) + len(batch) < self.window:
                item = next(source, None)
                if item is None:
                    exhausted = True
                else:
                    batch.append(item)
            if batch:
                self._enqueue(batch)
            if self._collect():
                idle_sleep = self.poll_s
            elif self.pending:
                time.sleep(idle_sleep)
                idle_sleep = min(idle_sleep * 1.5, 0.5)  # long jobs: poll less often

    def _requests(self, done_ids: set[str], done_lines: set[int]) -> Iterator[tuple[int, Any, Request]]:
        """(line number, Job, the parsed line) of every line still to do; writes line errors as it goes."""
        seen: set[str] = set()
        with open(self.input, encoding="utf-8") as fh:
            for line_no, text in enumerate(fh, 1):
                if not text.strip():
                    self.bar.update(1)
                    continue
                if line_no in done_lines:
                    continue
                try:
                    request = read_request(text)
                    custom_id = request.custom_id
                    if custom_id in seen:
                        raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} appeared on an earlier line")
                    seen.add(custom_id)
                    if custom_id in done_ids:
                        self.counts["skipped"] += 1
                        continue
                    job = make_job(job_id=job_id_for(self.run_id, custom_id), **request.fields)
                except LineError as exc:
                    cid = custom_id_of(text, exc)
                    if cid is not None and cid in done_ids and exc.code != "duplicate_custom_id":
                        self.counts["skipped"] += 1  # answered (in the errors file) before a restart
                    else:
                        self._write_error(error_line(cid, line_no, exc.code, str(exc)))
                    continue
                except JobRejected as exc:
                    self._write_error(error_line(custom_id, line_no, "invalid_request", str(exc)))
                    continue
                yield line_no, job, request

    def _enqueue(self, batch: list[tuple[int, Any, Request]]) -> None:
        """One script call for the batch (pipelined): ids already enqueued by an earlier run are skipped."""
        args: list[Any] = [self.ttl_s, JOB_FIELD]
        for line_no, job, request in batch:
            self.pending[job.id] = (request.custom_id, line_no, request)
            args += [job.id, job.to_json()]
        keys = [self.keys.jobs_of(self.band), self.keys.bulk_enqueued(self.run_id), self.keys.ids]
        ids = [item[1].id for item in batch]
        self._prior.update(i for i, known in zip(ids, self.r.smismember(keys[1], ids)) if known)
        sent = int(scripts.call(self.r, "bulk_enqueue", keys, args))
        self.counts["enqueued"] += sent
        self.counts["awaited"] += len(batch) - sent

    def _collect(self) -> int:
        """Write the results of finished jobs (one MGET per 1000 in flight); returns how many finished."""
        ids, finished = list(self.pending), 0
        for i in range(0, len(ids), 1000):
            chunk = ids[i : i + 1000]
            for job_id, raw in zip(chunk, self.r.mget([self.keys.final(j) for j in chunk])):
                if raw is not None:
                    self._write_result(job_id, json.loads(raw))
                    finished += 1
                else:
                    self._prior.discard(job_id)  # still running: it finishes during this run
        if finished:
            self.out.flush()
            self.err.flush()
            elapsed = max(time.monotonic() - self._started, 1e-9)
            self.bar.set_postfix(
                done=self.counts["completed"],
                failed=self.counts["errors"],
                tok_s=f"{self.counts['run_tokens'] / elapsed:.0f}",
                refresh=False,
            )
        return finished

    def _write_result(self, job_id: str, record: dict[str, Any]) -> None:
        custom_id, line_no, request = self.pending.pop(job_id)
        finished_before_this_run = job_id in self._prior
        self._prior.discard(job_id)
        if record.get("status") == "completed":
            line = output_line(custom_id, job_id, record, request.kind, model=request.model, tools=request.tools)
            self.out.write(json.dumps(line) + "\n")
            self.counts["completed"] += 1
            tokens = (record.get("usage") or {}).get("completion_tokens", 0)
            self.counts["tokens"] += tokens
            if not finished_before_this_run:
                self.counts["run_tokens"] += tokens
            self.bar.update(1)
        else:
            self._write_error(
                error_line(
                    custom_id,
                    line_no,
                    record.get("status", "failed"),
                    record.get("error") or record.get("status", ""),
                    job_id,
                    record,
                )
            )

    def _write_error(self, entry: dict[str, Any]) -> None:
        self.err.write(json.dumps(entry) + "\n")
        self.counts["errors"] += 1
        self.bar.update(1)


def run(args: argparse.Namespace) -> int:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    r = connect(redis_url(args.redis))
    # An unreachable Redis fails here, before any output file exists (pagedq/worker/cli/startup_errors.py words it).
    r.ping()
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
        progress=not args.no_progress,
    )
    try:
        counts = runner.run()
    except KeyboardInterrupt:
        print(
            f"\ninterrupted with {len(runner.pending)} jobs in flight: they keep running; run the same "
            f"command again to collect them (nothing is enqueued twice)",
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
