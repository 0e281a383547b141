"""What Client and AsyncClient share, without I/O: validating jobs, the commands each call sends and the
reading of their replies. The two clients only send the commands (redis, or redis.asyncio) and loop.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pagedq.engine.limits import SAMPLING_LIMITS
from pagedq.worker.protocol.errors import JobRejected, QueueFullError, ResultTimeout
from pagedq.worker.protocol.job import Delta, FinalRecord, Job, build_job, new_job_id
from pagedq.worker.protocol.keys import (
    BANDS,
    DATA_FIELD,
    JOB_FIELD,
    TYPE_FIELD,
    QueueKeys,
    band_for_priority,
    check_band,
)
from pagedq.worker.protocol.limits import MAX_TENANT_QUEUED
from pagedq.worker.protocol.replies import text
from pagedq.worker.protocol.trace_context import current_fields

# A producer's job-id prefix (ClientCore.job_id_prefix): what a job id may hold, and no glob character, since the
# producer's Redis ACL user names its keys by it (deploy/redis/users.acl, docs/security.md).
JOB_ID_PREFIX = re.compile(r"^[A-Za-z0-9_.:\-]{1,100}$")
POLL_MS = 1_000  # longest single XREAD BLOCK; timeouts are enforced between blocks
FLOAT_FIELDS = tuple(name for name, limit in SAMPLING_LIMITS.items() if limit.kind is float and limit.in_job)


def make_job(
    prompt: str | None = None,
    *,
    prompt_token_ids: list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
    stream: bool = False,
    priority: int = 0,
    deadline: float | _dt.datetime | None = None,
    metadata: dict | None = None,
    job_id: str | None = None,
    **sampling: Any,
) -> Job:
    """Validate one job (raises JobRejected naming every problem; nothing is sent)."""
    if isinstance(deadline, _dt.datetime):
        deadline = deadline.timestamp()
    elif isinstance(deadline, int) and not isinstance(deadline, bool):
        deadline = float(deadline)
    fields: dict[str, Any] = dict(
        sampling,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        stream=stream,
        priority=priority,
        deadline=deadline,
        metadata=metadata,
    )
    for name in FLOAT_FIELDS:  # ints are fine where floats are meant
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
    return job, band_of(band, job)


def band_of(band: str | None, job: Job) -> str:
    """The band named, else the one the job's priority maps to (JobRejected for an unknown band)."""
    try:
        return check_band(band) if band is not None else band_for_priority(job.vllm_priority)
    except ValueError as exc:
        raise JobRejected(str(exc)) from None


def traced(built: list[tuple[Job, str]]) -> list[tuple[Job, str]]:
    """The jobs, each without a trace context of its own given the caller's current one (where the caller traces:
    protocol/trace_context.py), so the worker's spans of each job continue the trace that submitted it."""
    fields = current_fields()
    if not fields:
        return built
    return [(job if job.traceparent else job.model_copy(update=fields), band) for job, band in built]


def submit_args(
    keys: QueueKeys, jobs: list[tuple[Job, str]], limit: int | None, tenant_limit: int | None = None
) -> tuple[list[str], list]:
    """KEYS and ARGV of the SUBMIT script for these (job, band) pairs (limit None or 0: no depth limit;
    tenant_limit: the unfinished jobs one tenant may have, None or 0: no limit)."""
    args: list = [int(limit or 0), JOB_FIELD, int(tenant_limit or 0)]
    streams = [keys.ids]
    for job, band in jobs:
        counted = bool(tenant_limit) and job.tenant is not None
        args += [job.id, job.to_json(), "1" if counted else ""]
        streams += [keys.jobs_of(band), keys.tenant_queued(job.tenant) if counted and job.tenant else keys.ids]
    return streams, args


def cancel_args(keys: QueueKeys, job_id: str) -> tuple[list[str], list]:
    """KEYS and ARGV of the CANCEL script."""
    return [keys.final(job_id), keys.cancelled, keys.ids], [job_id, time.time()]


def check_submit_reply(reply: list, adding: int, limit: int | None, tenant_limit: int | None = None) -> list[str]:
    head = text(reply[0])
    if head == "FULL":
        where = text(reply[2])
        tenant = where.split(":tenant:", 1)[1].rsplit(":", 1)[0] if ":tenant:" in where else None
        bound = tenant_limit if tenant is not None else limit
        raise QueueFullError(int(text(reply[1])), int(bound or 0), adding, stream=where, tenant=tenant)
    return [text(x) for x in reply[1:]]


def parse_result_entry(entry_id: Any, fields: Mapping) -> tuple[str, Delta | FinalRecord]:
    kind = text(fields.get(b"type", fields.get(TYPE_FIELD, b"")))
    data = fields.get(b"data", fields.get(DATA_FIELD))
    if kind == "final":
        return "final", FinalRecord.model_validate_json(data)
    payload = json.loads(data)
    return "delta", Delta(**payload, offset=text(entry_id))


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


Entry = tuple[str, "Delta | FinalRecord"]  # ("delta", Delta) or ("final", FinalRecord)


class ResultReader:
    """Reading one job's result stream: the XREAD to send next, the entries of its reply, and what to do when
    a read came back empty (the final record by its own key: the stream may have expired or been trimmed)."""

    def __init__(self, keys: QueueKeys, job_id: str, offset: str, timeout: float | None, per_item: bool) -> None:
        self.job_id, self.key, self.last = job_id, keys.result(job_id), offset
        self.final_key = keys.final(job_id)
        self.timeout, self.per_item = timeout, per_item
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def xread_kwargs(self) -> dict[str, Any]:
        return {"streams": {self.key: self.last}, "count": 256, "block": _block_ms(self.deadline)}

    def entries(self, reply: object) -> Iterator[Entry]:
        """reply: XREAD's RESP2 answer for the one stream read, ``[[key, [(id, fields), ...]]]``, or empty."""
        if not reply:
            return
        if not isinstance(reply, list):
            raise TypeError(f"XREAD answered {type(reply).__name__}; the clients speak RESP2, which answers a list")
        for entry_id, fields in reply[0][1]:
            self.last = text(entry_id)
            yield parse_result_entry(entry_id, fields)
            if self.per_item and self.timeout is not None:  # the caller took it: the wait for the next starts
                self.deadline = time.monotonic() + self.timeout

    def when_idle(self, raw_final: bytes | str | None) -> Iterator[Entry]:
        """After an empty read, given GET final: the record if there is one; ResultTimeout past the deadline."""
        if raw_final:
            yield "final", FinalRecord.model_validate_json(raw_final)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise ResultTimeout(f"no final record for job {self.job_id} within {self.timeout}s")


class ClientCore:
    """The queue a client talks to and everything its calls compute before and after the round trip."""

    def __init__(
        self,
        queue: str,
        max_queue_depth: int | None,
        max_tenant_queued: int | None = None,
        job_id_prefix: str | None = None,
    ) -> None:
        self.keys = QueueKeys(queue)
        self.max_queue_depth = max_queue_depth
        if max_tenant_queued is not None and not 1 <= max_tenant_queued <= MAX_TENANT_QUEUED:
            raise ValueError(f"max_tenant_queued must be None or in [1, {MAX_TENANT_QUEUED}], got {max_tenant_queued}")
        self.max_tenant_queued = max_tenant_queued
        if job_id_prefix is not None and not JOB_ID_PREFIX.fullmatch(job_id_prefix):
            raise ValueError(f"job_id_prefix must match {JOB_ID_PREFIX.pattern}, got {job_id_prefix!r}")
        # The ids of this producer's jobs start with it: a producer's Redis ACL user may read only those results.
        self.job_id_prefix = job_id_prefix

    def _one(self, prompt: str | None, band: str | None, kwargs: dict[str, Any]) -> list[tuple[Job, str]]:
        if self.job_id_prefix is not None and "job_id" not in kwargs:
            kwargs = {**kwargs, "job_id": self.job_id_prefix + new_job_id()}
        job = make_job(prompt, **kwargs)
        return traced(self._owned([(job, band_of(band, job))]))

    def _many(self, jobs: Iterable[Job | Mapping[str, Any]]) -> list[tuple[Job, str]]:
        return traced(self._owned([as_banded(self._with_own_id(j)) for j in jobs]))

    def _with_own_id(self, item: Job | Mapping[str, Any]) -> Job | Mapping[str, Any]:
        if self.job_id_prefix is None or not isinstance(item, Mapping) or "id" in item or "job_id" in item:
            return item
        return {**item, "job_id": self.job_id_prefix + new_job_id()}

    def _owned(self, built: list[tuple[Job, str]]) -> list[tuple[Job, str]]:
        """The jobs, once each id is known to start with job_id_prefix (JobRejected naming the first that does not)."""
        prefix = self.job_id_prefix
        for job, _ in built:
            if prefix is not None and not job.id.startswith(prefix):
                raise JobRejected(
                    f"job id {job.id!r} does not start with this client's job_id_prefix {prefix!r} "
                    "(its Redis user may read only the results of jobs with that prefix)"
                )
        return built

    def _submit_script(self, built: list[tuple[Job, str]]) -> tuple[list[str], list]:
        return submit_args(self.keys, built, self.max_queue_depth, self.max_tenant_queued)

    def _submitted(self, reply: list, built: list[tuple[Job, str]]) -> list[str]:
        check_submit_reply(reply, len(built), self.max_queue_depth, self.max_tenant_queued)
        return [job.id for job, _ in built]

    def _cancel_script(self, job_id: str) -> tuple[list[str], list]:
        return cancel_args(self.keys, job_id)

    def _depth_keys(self, band: str | None) -> list[str]:
        return [self.keys.jobs_of(b) for b in ([band] if band is not None else BANDS)]

    @staticmethod
    def _parse_final(raw: bytes | str | None) -> FinalRecord | None:
        return FinalRecord.model_validate_json(raw) if raw else None

    def _reader(self, job_id: str, offset: str, timeout: float | None, per_item: bool) -> ResultReader:
        return ResultReader(self.keys, job_id, offset, timeout, per_item)


def _block_ms(deadline: float | None) -> int:
    if deadline is None:
        return POLL_MS
    return max(1, min(POLL_MS, int((deadline - time.monotonic()) * 1000)))
