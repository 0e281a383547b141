"""The loop of `pagedq bulk` (pagedq/worker/bulk/run.py is the command): read the input's lines, enqueue their
jobs within a window (bulk/admission.py), write each result as it finishes, and on a resume skip what this run
already answered (bulk/resume.py)."""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedq.worker.bulk.admission import Admission
from pagedq.worker.bulk.lines import (
    JSON_WHITESPACE,
    LineError,
    Request,
    custom_id_of,
    error_line,
    file_digest,
    job_id_for,
    output_line,
    read_request,
)
from pagedq.worker.bulk.resume import Done, RunState, check_files, check_run_id, read_done
from pagedq.worker.client.core import make_job
from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.connection import SyncRedis
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.job import Job
from pagedq.worker.protocol.keys import QueueKeys, check_band
from pagedq.worker.protocol.registry import adapter_names
from pagedq.worker.protocol.replies import text as reply_text
from pagedq.worker.protocol.tool_calls import DEFAULT_MAX_TOOL_CALLS


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
        max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS,
        progress: bool = True,
        poll_s: float = 0.05,
    ) -> None:
        self.r, self.keys, self.window, self.ttl_s, self.poll_s = r, QueueKeys(queue), max(1, window), ttl_s, poll_s
        self.band = check_band(band)
        self.max_tool_calls = max_tool_calls  # bounds a tool_choice "required" list of calls
        self.input, self.output = input_path, output_path
        self.errors = errors_path or output_path.with_suffix(".errors.jsonl")
        check_files(self.input, self.output, self.errors)  # before anything is read or written
        self.digest, self.total_lines = file_digest(input_path)
        self.run_id = check_run_id(run_id) if run_id is not None else self.digest
        self._binding = self.digest if run_id is not None else ""  # the default run id is the input's hash already
        self.admission = Admission(self.keys, self.band, self.run_id, ttl_s)
        self.state = RunState(r, self.keys, self.run_id, ttl_s)
        # job id -> (custom_id, line number, the parsed line: its kind, model and ToolSpec, the job). A resumed run
        # re-reads every line not answered yet, jobs in flight at the kill too, so this is rebuilt from the input.
        self.pending: dict[str, tuple[str, int, Request, Job]] = {}
        self.waiting: deque[tuple[int, Job, Request]] = deque()  # read, not enqueued yet (or again: expired)
        # "tokens": completion tokens of the results written; "run_tokens": of those that finished while this
        # run watched (what tok/s counts: a resume collects results finished before it in one burst).
        # "requeued": jobs enqueued again because their result expired before a resume collected it.
        self.counts = {
            "completed": 0,
            "errors": 0,
            "skipped": 0,
            "enqueued": 0,
            "awaited": 0,
            "requeued": 0,
            "tokens": 0,
            "run_tokens": 0,
        }
        self._prior: set[str] = set()  # enqueued by an earlier run and not seen unfinished by this one
        self.progress = progress
        self._started = time.monotonic()

    def job_id(self, custom_id: str) -> str:
        return job_id_for(self.run_id, custom_id, self._binding)

    def run(self) -> dict[str, int]:
        """Process every line not answered yet; returns the counts. KeyboardInterrupt stops it cleanly.
        BulkRefused (nothing written) if the run id belongs to another input."""
        self.state.bind(self.digest)
        done = Done()
        for path in (self.output, self.errors):
            read_done(path, done, self.job_id, owned=self.state.owns(path))
        if done.foreign:
            print(f"pagedq bulk: {done.foreign} lines of the output files are not this run's: ignored", file=sys.stderr)
        from tqdm import tqdm

        self.bar = tqdm(
            total=self.total_lines,
            initial=len(done.ids) + len(done.lines),
            unit="job",
            file=sys.stderr,
            disable=not self.progress,
            mininterval=0.5,
            dynamic_ncols=True,
        )
        with self.state.open_append(self.output) as self.out, self.state.open_append(self.errors) as self.err:
            try:
                self._loop(self._requests(done))
            finally:
                self.bar.close()
        return self.counts

    def _loop(self, source: Iterator[tuple[int, Job, Request]]) -> None:
        exhausted, idle_sleep = False, self.poll_s
        while not exhausted or self.pending or self.waiting:
            while not exhausted and len(self.pending) + len(self.waiting) < self.window:
                item = next(source, None)
                if item is None:
                    exhausted = True
                else:
                    self.waiting.append(item)
            if self.waiting:
                self._enqueue()
            if self._collect():
                idle_sleep = self.poll_s
            elif self.pending or self.waiting:
                self._requeue_expired()
                time.sleep(idle_sleep)
                idle_sleep = min(idle_sleep * 1.5, 0.5)  # long jobs: poll less often

    def _requests(self, done: Done) -> Iterator[tuple[int, Job, Request]]:
        """(line number, Job, the parsed line) of every line still to do; writes line errors as it goes. Lines are
        split on "\\n" only: a JSON string may hold U+2028 and the like unescaped."""
        seen: set[str] = set()
        adapters = adapter_names(self.r, self.keys)  # an OpenAI body's model naming one runs under it
        with open(self.input, "rb") as fh:
            for line_no, raw in enumerate(fh, 1):
                if not raw.strip(JSON_WHITESPACE.encode()):
                    self.bar.update(1)
                    continue
                text, custom_id = "", None
                try:
                    text = _decoded(raw, line_no)
                    request = read_request(text, self.max_tool_calls, adapters)
                    custom_id = request.custom_id
                    if custom_id in seen:
                        raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} appeared on an earlier line")
                    seen.add(custom_id)
                    if custom_id in done.ids:
                        self.counts["skipped"] += 1
                        continue
                    job = make_job(job_id=self.job_id(custom_id), **request.fields)
                except (LineError, JobRejected) as exc:
                    code = exc.code if isinstance(exc, LineError) else "invalid_request"
                    cid = custom_id_of(text, exc) if isinstance(exc, LineError) else custom_id
                    if line_no not in done.lines:
                        self._write_error(error_line(cid, line_no, code, str(exc)))
                    elif cid is not None and code != "duplicate_custom_id":
                        self.counts["skipped"] += 1  # a request answered (in the errors file) before a restart
                    continue
                yield line_no, job, request

    def _enqueue(self) -> None:
        """One script call for the jobs waiting (pipelined): ids already enqueued by an earlier run are awaited."""
        batch = list(self.waiting)
        ids = [job.id for _, job, _ in batch]
        known = self.r.smismember(self.keys.bulk_enqueued(self.run_id), ids)
        keys, args = self.admission.enqueue([job for _, job, _ in batch])
        taken, sent = self.admission.taken(scripts.call(self.r, "bulk_enqueue", keys, args))
        for (line_no, job, request), before in zip(batch[:taken], known):
            self.waiting.popleft()
            self.pending[job.id] = (request.custom_id, line_no, request, job)
            if before:
                self._prior.add(job.id)
        self.counts["enqueued"] += sent
        self.counts["awaited"] += taken - sent

    def _requeue_expired(self) -> None:
        """Jobs awaited whose result expired unread go back to be enqueued again (else the run would wait forever)."""
        if not self.pending or not self.admission.expiry_due():
            return
        ids = list(self.pending)
        for i in range(0, len(ids), 1000):
            keys, args = self.admission.forget_expired(ids[i : i + 1000])
            for job_id in map(reply_text, scripts.call(self.r, "forget_expired", keys, args)):
                _, line_no, request, job = self.pending.pop(job_id)
                self._prior.discard(job_id)
                self.waiting.appendleft((line_no, job, request))
                self.counts["requeued"] += 1

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
        custom_id, line_no, request, _ = self.pending.pop(job_id)
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


def _decoded(raw: bytes, line_no: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:  # JSON is UTF-8: a line that is not is not JSON
        message = f"line {line_no} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise LineError("invalid_json", message) from None
