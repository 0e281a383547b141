"""Producer API (sync): submit jobs, stream deltas, wait for results, cancel.

    from worker import Client
    client = Client("redis://localhost:6379/0")
    job_id = client.submit(prompt="Hello", max_tokens=32, temperature=0)
    print(client.result(job_id, timeout=60).text)

Everything here is plain Redis: a producer in another language does the same with XADD / XREAD / GET
(see the wire protocol in the README).
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from typing import Any, Iterable, Iterator, Mapping

from redis import Redis

from . import scripts
from .errors import JobRejected, QueueFullError, ResultTimeout
from .job import Delta, FinalRecord, Job, build_job
from .keys import BANDS, DATA_FIELD, JOB_FIELD, TYPE_FIELD, QueueKeys, band_for_priority, check_band

POLL_MS = 1_000  # longest single XREAD BLOCK; timeouts are enforced between blocks


def make_job(prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
             messages: list[dict[str, str]] | None = None, stream: bool = False,
             priority: int = 0, deadline: float | _dt.datetime | None = None, metadata: dict | None = None,
             job_id: str | None = None, **sampling: Any) -> Job:
    """Validate one job (raises JobRejected naming every problem; nothing is sent)."""
    if isinstance(deadline, _dt.datetime):
        deadline = deadline.timestamp()
    elif isinstance(deadline, int) and not isinstance(deadline, bool):
        deadline = float(deadline)
    fields: dict[str, Any] = dict(sampling, prompt=prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                                  stream=stream, priority=priority, deadline=deadline, metadata=metadata)
    for name in ("temperature", "top_p", "min_p"):  # ints are fine where floats are meant
        if type(fields.get(name)) is int:
            fields[name] = float(fields[name])
    if job_id is not None:
        fields["id"] = job_id
    return build_job(**fields)


def as_job(item: Job | Mapping[str, Any]) -> Job:
    if isinstance(item, Job):
        return item
    if not isinstance(item, Mapping):
        raise JobRejected(f"a job must be a Job or a mapping of submit() keywords, got {type(item).__name__}")
    kwargs = dict(item)
    if "id" in kwargs:
        kwargs["job_id"] = kwargs.pop("id")
    return make_job(**kwargs)


def as_banded(item: Job | Mapping[str, Any]) -> tuple[Job, str]:
    """A job and its band: the mapping's "band" keyword, else the band its priority maps to."""
    band = None
    if isinstance(item, Mapping) and "band" in item:
        item = dict(item)
        band = item.pop("band")
    job = as_job(item)
    return job, _band(band, job)


def _band(band: str | None, job: Job) -> str:
    try:
        return check_band(band) if band is not None else band_for_priority(job.priority)
    except ValueError as exc:
        raise JobRejected(str(exc)) from None


def submit_args(keys: QueueKeys, jobs: list[tuple[Job, str]], limit: int | None) -> tuple[list[str], list]:
    """KEYS and ARGV of the SUBMIT script for these (job, band) pairs (limit None or 0: no depth limit)."""
    args: list = [int(limit or 0), JOB_FIELD]
    streams = [keys.ids]
    for job, band in jobs:
        args += [job.id, job.to_json()]
        streams.append(keys.jobs_of(band))
    return streams, args


def cancel_args(keys: QueueKeys, job_id: str) -> tuple[list[str], list]:
    """KEYS and ARGV of the CANCEL script."""
    return [keys.final(job_id), keys.cancelled, keys.ids], [job_id, time.time()]


def check_submit_reply(reply: list, adding: int, limit: int | None) -> list[str]:
    head = _s(reply[0])
    if head == "FULL":
        raise QueueFullError(int(_s(reply[1])), int(limit or 0), adding, stream=_s(reply[2]))
    return [_s(x) for x in reply[1:]]


def parse_result_entry(entry_id: Any, fields: Mapping) -> tuple[str, Delta | FinalRecord]:
    kind = _s(fields.get(b"type", fields.get(TYPE_FIELD, b"")))
    data = fields.get(b"data", fields.get(DATA_FIELD))
    if kind == "final":
        return "final", FinalRecord.model_validate_json(data)
    payload = json.loads(data)
    return "delta", Delta(**payload, offset=_s(entry_id))


class DeltaFilter:
    """Skips deltas already seen: a redelivered job restarts its deltas at pos 0."""

    def __init__(self) -> None:
        self.next_pos: dict[int, int] = {}  # by sample index (n > 1 jobs stream several samples)

    def keep(self, delta: Delta) -> bool:
        next_pos = self.next_pos.get(delta.index)
        if next_pos is not None and delta.pos < next_pos:
            return False
        self.next_pos[delta.index] = delta.pos + len(delta.token_ids)
        return True


class Client:
    def __init__(self, url: str = "redis://localhost:6379/0", queue: str = "default", *,
                 max_queue_depth: int | None = None, redis: Redis | None = None) -> None:
        self.r = redis if redis is not None else Redis.from_url(url)
        self.keys = QueueKeys(queue)
        self.max_queue_depth = max_queue_depth

    def close(self) -> None:
        self.r.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- producing
    def submit(self, prompt: str | None = None, *, band: str | None = None, **kwargs: Any) -> str:
        """Enqueue one job; returns its id. Keywords: prompt_token_ids, messages (chat: a list of
        {"role", "content"}, rendered by the worker with the model's chat template), max_tokens, temperature,
        top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, logprobs, prompt_logprobs, stream, priority,
        deadline, metadata, job_id. band: "interactive", "default" or "bulk" (default: from priority, > 0
        interactive, < 0 bulk)."""
        job = make_job(prompt, **kwargs)
        return self._submit([(job, _band(band, job))])[0]

    def submit_many(self, jobs: Iterable[Job | Mapping[str, Any]]) -> list[str]:
        """Validate every job, then enqueue all in one round trip (all or none when a depth limit is set)."""
        return self._submit([as_banded(j) for j in jobs])

    def _submit(self, built: list[tuple[Job, str]]) -> list[str]:
        if not built:
            return []
        keys, args = submit_args(self.keys, built, self.max_queue_depth)
        check_submit_reply(scripts.call(self.r, "submit", keys, args), len(built), self.max_queue_depth)
        return [job.id for job, _ in built]

    def cancel(self, job_id: str) -> bool:
        """Ask the workers to cancel a queued or running job; False (and nothing written) if it already has
        its final record or is unknown: never submitted by a client nor read by a worker yet."""
        keys, args = cancel_args(self.keys, job_id)
        return bool(scripts.call(self.r, "cancel", keys, args))

    def queue_depth(self, band: str | None = None) -> int:
        """Jobs not yet finished (waiting plus in flight), of one band or of all."""
        bands = [band] if band is not None else BANDS
        return sum(int(self.r.xlen(self.keys.jobs_of(b))) for b in bands)

    # --- consuming
    def final(self, job_id: str) -> FinalRecord | None:
        raw = self.r.get(self.keys.final(job_id))
        return FinalRecord.model_validate_json(raw) if raw else None

    def result(self, job_id: str, timeout: float | None = None) -> FinalRecord:
        """Wait for the job's final record (raises ResultTimeout)."""
        for kind, item in self._entries(job_id, "0-0", timeout):
            if kind == "final":
                return item
        raise AssertionError("unreachable")

    def stream(self, job_id: str, offset: str = "0-0", timeout: float | None = None) -> Iterator[Delta]:
        """Yield the job's deltas as they arrive, until its final record. Resume after a disconnect with
        offset=<the last delta's .offset>. timeout bounds the wait for each next record."""
        seen = DeltaFilter()
        for kind, item in self._entries(job_id, offset, timeout, per_item=True):
            if kind == "final":
                return
            if seen.keep(item):
                yield item

    def _entries(self, job_id: str, offset: str, timeout: float | None, per_item: bool = False) -> Iterator:
        key, last = self.keys.result(job_id), offset
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            reply = self.r.xread({key: last}, count=256, block=_block_ms(deadline))
            for entry_id, fields in (reply[0][1] if reply else []):
                last = _s(entry_id)
                yield parse_result_entry(entry_id, fields)
                if per_item and timeout is not None:
                    deadline = time.monotonic() + timeout
            if not reply:
                record = self.final(job_id)  # the result stream may have expired or been trimmed
                if record is not None:
                    yield "final", record
                if deadline is not None and time.monotonic() >= deadline:
                    raise ResultTimeout(f"no final record for job {job_id} within {timeout}s")


def _block_ms(deadline: float | None) -> int:
    if deadline is None:
        return POLL_MS
    return max(1, min(POLL_MS, int((deadline - time.monotonic()) * 1000)))


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
