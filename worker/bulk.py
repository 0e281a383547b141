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
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import scripts
from .cli_options import Option, add_options, queue_option
from .client import make_job
from .connection import SyncRedis, connect
from .errors import JobRejected
from .keys import BANDS, JOB_FIELD, QueueKeys, check_band
from .settings import redis_url

OPENAI_IGNORED = {"model", "user"}  # the worker serves one model (model is echoed in the output); user: informational
OPENAI_RENAMED = {"max_completion_tokens": "max_tokens"}
JOB_FIELDS = {
    "prompt",
    "prompt_token_ids",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "priority",
    "deadline",
    "metadata",
}


class LineError(ValueError):
    """One input line cannot become a job; code is the error code written to the errors file."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


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
def parse_line(line: str) -> tuple[str, dict[str, Any], str]:
    """(custom_id, job keywords, "chat" | "completion"); LineError otherwise."""
    custom_id, fields, kind, _ = parse_request(line)
    return custom_id, fields, kind


def parse_request(line: str) -> tuple[str, dict[str, Any], str, str | None]:
    """parse_line's answer and the request's `model` (an OpenAI body's, echoed in the output; else None)."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise LineError("invalid_json", f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise LineError("invalid_json", "a line must be a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "custom_id (a non-empty string) is required")
    fields = _openai_fields(data) if "body" in data else {k: v for k, v in data.items() if k != "custom_id"}
    model = data["body"].get("model") if "body" in data else None
    unknown = sorted(set(fields) - JOB_FIELDS)
    if unknown:
        raise LineError("invalid_request", f"unsupported field(s): {', '.join(unknown)}")
    metadata = fields.get("metadata")
    fields["metadata"] = {**(metadata if isinstance(metadata, dict) else {}), "custom_id": custom_id}
    return (
        custom_id,
        fields,
        "chat" if "messages" in fields else "completion",
        model if isinstance(model, str) else None,
    )


def _openai_fields(data: dict[str, Any]) -> dict[str, Any]:
    body = data.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body must be an object")
    if data.get("method", "POST") != "POST":
        raise LineError("invalid_request", f"method must be POST, got {data.get('method')!r}")
    url = data.get("url", "")
    if url and url not in ("/v1/completions", "/v1/chat/completions"):
        raise LineError("invalid_request", f"unsupported url {url!r} (use /v1/completions or /v1/chat/completions)")
    if body.get("n", 1) != 1 or body.get("stream", False):
        raise LineError("invalid_request", "n > 1 and stream are not supported in bulk runs")
    dropped = OPENAI_IGNORED | {"n", "stream"}
    fields: dict[str, Any] = {OPENAI_RENAMED.get(str(k), str(k)): v for k, v in body.items() if k not in dropped}
    prompt = fields.get("prompt")
    if isinstance(prompt, list):  # OpenAI allows a token list, or a list holding one prompt
        if prompt and all(isinstance(t, int) for t in prompt):
            fields["prompt_token_ids"] = fields.pop("prompt")
        elif len(prompt) == 1:
            fields["prompt"] = prompt[0]
        else:
            raise LineError("invalid_request", "one prompt per request line")
    if isinstance(fields.get("logprobs"), bool):  # chat: logprobs true + top_logprobs k
        top = fields.pop("top_logprobs", 0)
        fields["logprobs"] = top if fields["logprobs"] else None
    return fields


def job_id_for(run_id: str, custom_id: str) -> str:
    return f"bulk.{run_id}.{hashlib.sha256(custom_id.encode()).hexdigest()[:32]}"


def file_digest(path: Path) -> tuple[str, int]:
    """Content hash (the run's identity) and line count, in one pass; a last line without "\n" counts too."""
    h, lines, last = hashlib.sha256(), 0, b"\n"
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return h.hexdigest()[:16], lines + (last != b"\n")


# ---------------------------------------------------------------------------------------------- output lines
def output_line(
    custom_id: str,
    job_id: str,
    record: dict[str, Any],
    kind: str,
    body: dict[str, Any] | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """One output line; `body` replaces the response body built here (the gateway's Batch API passes its own).
    `model`: the request's, echoed as OpenAI's batch output does."""
    if body is not None:
        return {
            "id": f"batch_req_{job_id}",
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": job_id, "body": body},
            "error": None,
        }
    text, finish = record.get("text", ""), record.get("finish_reason")
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}
        if kind == "chat"
        else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    )
    usage = record.get("usage") or {}
    body = {
        "id": job_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {**usage, "total_tokens": usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)},
        "pagedq": {k: record.get(k) for k in ("status", "stop_reason", "timings", "worker", "attempts", "error")},
    }
    if record.get("prompt_logprobs") is not None:
        body["pagedq"]["prompt_logprobs"] = record["prompt_logprobs"]
    return {
        "id": f"batch_req_{job_id}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": job_id, "body": body},
        "error": None,
    }


def error_line(
    custom_id: str | None,
    line_no: int,
    code: str,
    message: str,
    job_id: str | None = None,
    record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    response = None
    if record is not None:
        response = {
            "status_code": 400 if record.get("status") == "rejected" else 500,
            "request_id": job_id,
            "body": record,
        }
    # A line that never became a job has no job id: its row is named after its line (unique in the file).
    return {
        "id": f"batch_req_{job_id}" if job_id else f"batch_req_line_{line_no}",
        "custom_id": custom_id,
        "line": line_no,
        "response": response,
        "error": {"code": code, "message": message},
    }


def read_done(path: Path) -> tuple[set[str], set[int]]:
    """custom_ids already answered in a results/errors file, and line numbers answered without one.
    A partly written last line (interrupted mid-write) is cut off first."""
    ids: set[str] = set()
    lines: set[int] = set()
    if not path.exists():
        return ids, lines
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        raw = raw[: raw.rfind(b"\n") + 1]
        path.write_bytes(raw)
    for text in raw.decode().splitlines():
        entry = json.loads(text)
        if entry.get("custom_id") is not None and (entry.get("error") or {}).get("code") != "duplicate_custom_id":
            ids.add(entry["custom_id"])
        elif entry.get("line") is not None:
            lines.add(entry["line"])
    return ids, lines


# ---------------------------------------------------------------------------------------------- the run
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
        # job id -> (custom_id, line number, kind, the request's model)
        self.pending: dict[str, tuple[str, int, str, str | None]] = {}
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

    def _loop(self, source: Iterator[tuple[int, str, Any, str, str | None]]) -> None:
        exhausted, idle_sleep = False, self.poll_s
        while not exhausted or self.pending:
            batch: list[tuple[int, str, Any, str, str | None]] = []
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

    def _requests(self, done_ids: set[str], done_lines: set[int]) -> Iterator[tuple[int, str, Any, str, str | None]]:
        """(line number, custom_id, Job, kind, model) of every line still to do; writes line errors as it goes."""
        seen: set[str] = set()
        with open(self.input, encoding="utf-8") as fh:
            for line_no, text in enumerate(fh, 1):
                if not text.strip():
                    self.bar.update(1)
                    continue
                if line_no in done_lines:
                    continue
                try:
                    custom_id, fields, kind, model = parse_request(text)
                    if custom_id in seen:
                        raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} appeared on an earlier line")
                    seen.add(custom_id)
                    if custom_id in done_ids:
                        self.counts["skipped"] += 1
                        continue
                    job = make_job(job_id=job_id_for(self.run_id, custom_id), **fields)
                except LineError as exc:
                    cid = _custom_id(text, exc)
                    if cid is not None and cid in done_ids and exc.code != "duplicate_custom_id":
                        self.counts["skipped"] += 1  # answered (in the errors file) before a restart
                    else:
                        self._write_error(error_line(cid, line_no, exc.code, str(exc)))
                    continue
                except JobRejected as exc:
                    self._write_error(error_line(custom_id, line_no, "invalid_request", str(exc)))
                    continue
                yield line_no, custom_id, job, kind, model

    def _enqueue(self, batch: list[tuple[int, str, Any, str, str | None]]) -> None:
        """One script call for the batch (pipelined): ids already enqueued by an earlier run are skipped."""
        args: list[Any] = [self.ttl_s, JOB_FIELD]
        for line_no, custom_id, job, kind, model in batch:
            self.pending[job.id] = (custom_id, line_no, kind, model)
            args += [job.id, job.to_json()]
        keys = [self.keys.jobs_of(self.band), self.keys.bulk_enqueued(self.run_id), self.keys.ids]
        ids = [item[2].id for item in batch]
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
        custom_id, line_no, kind, model = self.pending.pop(job_id)
        finished_before_this_run = job_id in self._prior
        self._prior.discard(job_id)
        if record.get("status") == "completed":
            self.out.write(json.dumps(output_line(custom_id, job_id, record, kind, model=model)) + "\n")
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


def _custom_id(text: str, exc: LineError) -> str | None:
    """The custom_id of a line that failed after it was read (so a resume skips it); None for bad JSON."""
    if exc.code in ("invalid_json", "missing_custom_id"):
        return None
    try:
        return json.loads(text).get("custom_id")
    except ValueError:
        return None


def run(args: argparse.Namespace) -> int:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    r = connect(redis_url(args.redis))
    r.ping()  # an unreachable Redis fails here, before any output file exists (worker/startup_errors.py words it)
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
