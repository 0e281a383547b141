"""Queues a step's writes (deltas, final records) and sends them in one pipeline with the next read.

Round trips per step stay constant however many jobs advanced: every write is one command in the same
pipeline. Final records go through the FINALIZE script (write once + XACK + XDEL atomically).
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog
from redis.exceptions import NoScriptError

from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.job import Choice, FinalRecord, Timings, Usage
from pagedq.worker.protocol.keys import BANDS, DATA_FIELD, DEFAULT_BAND, GROUP, TYPE_FIELD
from pagedq.worker.service.context import ServiceContext
from pagedq.worker.service.held import CELERY_ORIGIN, HeldJob, Sample
from pagedq.worker.service.token_texts import TokenTexts, ids_named

FINALIZE_CHUNK = 256  # jobs per FINALIZE call: bounds how long one script blocks Redis
log = structlog.get_logger("pagedq.publisher")
MAX_DEAD_RAW_BYTES = 1024 * 1024  # of a raw dead letter: enough to see what it was


class Publisher:
    def __init__(self, ctx: ServiceContext, tokenizer: Any = None) -> None:
        self.keys, self.worker_name, self.redis = ctx.keys, ctx.settings.name, ctx.redis
        self.spans = ctx.spans
        # None without a tokenizer (a stub engine): records then name no token texts
        self.token_texts = TokenTexts(tokenizer) if tokenizer is not None else None
        self.ttl, self.maxlen = int(ctx.settings.result_ttl_s), int(ctx.settings.completions_maxlen)
        self._ops: list[tuple[Any, ...]] = []
        self._finals: list[tuple[str, str, str, str, str]] = []  # job_id, entry_id, final_json, dead_json, band
        self._expiring: set[str] = set()  # result streams that already got their TTL
        self.finals_written = 0
        self.duplicates = 0
        # Front-door jobs finalised but not yet reported to their door (Celery's result backend) and acked: their
        # job ids. take() moves them to `_settling`; the worker settles them (take_settled) once the FINALIZE calls
        # of the same take() have succeeded.
        self._door_done: list[str] = []
        self._settling: list[str] = []

    def __len__(self) -> int:
        return len(self._ops) + len(self._finals) + len(self._door_done)

    def ack(self, band: str, entry_id: str, delete: bool = False) -> None:
        """Acknowledge an entry of a band's stream without a final record (delete: and remove it from the stream)."""
        stream = self.keys.jobs_of(band)
        self._ops.append(("XACK", stream, GROUP, entry_id))
        if delete:
            self._ops.append(("XDEL", stream, entry_id))

    def mark_known(self, job_id: str) -> None:
        """Record that a job id is held by a worker (Client.cancel checks it)."""
        self._ops.append(("HSET", self.keys.ids, job_id, 1))

    def delta(
        self, t: HeldJob, text: str, token_ids: list[int], pos: int, logprobs: list | None, index: int | None = None
    ) -> None:
        payload: dict[str, Any] = {"text": text, "token_ids": token_ids, "pos": pos}
        if logprobs:
            payload["logprobs"] = logprobs
        if index is not None:  # n > 1 only: single-sample deltas keep their original shape
            payload["index"] = index
        prompt_ids: list[int] = []
        if t.job.echo and not t.prompt_streamed:  # the first delta brings the prompt
            t.prompt_streamed = True
            prompt_ids = t.prompt_token_ids or []
            payload.update(prompt_token_ids=prompt_ids, prompt_text=t.prompt_text)
            if t.prompt_logprobs is not None:
                payload["prompt_logprobs"] = t.prompt_logprobs
        if self._names_tokens(t):
            named = ids_named([*prompt_ids, *token_ids], [*(payload.get("prompt_logprobs") or ()), *(logprobs or ())])
            payload["token_texts"] = self.token_texts.of(named) if self.token_texts else None
        key = self.keys.result(t.id)
        self._ops.append(("XADD", key, "*", TYPE_FIELD, "delta", DATA_FIELD, json.dumps(payload)))
        if key not in self._expiring:  # one EXPIRE per stream, not per delta; FINALIZE sets it again
            self._expiring.add(key)
            self._ops.append(("EXPIRE", key, self.ttl))

    def final(
        self,
        record: FinalRecord,
        origin: str,
        entry_id: str | None,
        dead: dict | None = None,
        held: HeldJob | None = None,
    ) -> None:
        """Queue a final record. A stream job's entry (in its band's stream) is acknowledged with it; a Celery
        job is acknowledged on the Celery side once FINALIZE has run. held: the held job it ends (its spans)."""
        if self.spans is not None and held is not None:
            self.spans.settled(held, record)
        self._expiring.discard(self.keys.result(record.id))
        if origin == CELERY_ORIGIN:
            self._door_done.append(record.id)
            entry_id = None
        elif origin not in BANDS:
            raise ValueError(f"unknown origin {origin!r}")
        self._finals.append(
            (
                record.id,
                entry_id or "",
                record.model_dump_json(),
                json.dumps(dead) if dead else "",
                origin if origin in BANDS else DEFAULT_BAND,
            )
        )

    def dead_raw(self, entry_id: str, raw: Any, error: str, band: str = DEFAULT_BAND) -> None:
        """Dead-letter an entry as the bytes it holds (it could not even be rejected) and acknowledge it."""
        raw_bytes = raw if isinstance(raw, bytes) else str(raw).encode(errors="replace") if raw is not None else b""
        data = json.dumps(
            {
                "job": None,
                "entry_id": entry_id,
                "band": band,
                "error": error,
                "attempts": 1,
                "worker": self.worker_name,
                "raw_bytes": len(raw_bytes),
            }
        )
        k = self.keys
        self._ops.append(
            (
                "EVALSHA",
                scripts.SHA["dead_raw"],
                2,
                k.jobs_of(band),
                k.dead_of(band),
                GROUP,
                entry_id,
                entry_id,
                data,
                raw_bytes[:MAX_DEAD_RAW_BYTES],
            )
        )

    def record(
        self, t: HeldJob, status: str, error: str | None = None, now: float | None = None, error_code: str | None = None
    ) -> FinalRecord:
        """The final record of a held job. Built without re-validation (hot path; every field is ours)."""
        now = now or time.time()
        timings = Timings.model_construct(
            queue_wait=_dt(t.enqueued_at, t.admitted_at),
            ttft=_dt(t.enqueued_at, t.first_token_at),
            total=_dt(t.enqueued_at, now),
        )
        choices = None
        if t.samples:
            choices = [
                Choice.model_construct(
                    index=i,
                    text="".join(s.text_parts),
                    token_ids=s.token_ids,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=s.logprobs,
                )
                for i, s in sorted(t.samples.items())
            ]
        completion_tokens = sum(len(s.token_ids) for s in t.samples.values()) if t.samples else len(t.token_ids)
        token_texts = None
        if self.token_texts is not None and self._names_tokens(t):
            samples: list[HeldJob | Sample] = [*t.samples.values()] or [t]
            entries = [e for s in samples for e in (s.logprobs or ())] + list(t.prompt_logprobs or ())
            ids = [*(t.prompt_token_ids or ()), *(i for s in samples for i in s.token_ids)]
            token_texts = self.token_texts.of(ids_named(ids, entries))
        usage = Usage.model_construct(prompt_tokens=t.prompt_tokens, completion_tokens=completion_tokens)
        return FinalRecord.model_construct(
            id=t.id,
            status=status,
            text=t.text,
            token_ids=t.token_ids,
            finish_reason=t.finish_reason,
            stop_reason=t.stop_reason,
            usage=usage,
            timings=timings,
            metadata=t.job.metadata,
            error=error,
            error_code=error_code,
            logprobs=t.logprobs,
            prompt_logprobs=t.prompt_logprobs,
            worker=self.worker_name,
            attempts=t.attempts,
            choices=choices,
            prompt_token_ids=t.prompt_token_ids,
            prompt_text=t.prompt_text,
            token_texts=token_texts,
        )

    @staticmethod
    def _names_tokens(t: HeldJob) -> bool:
        """Whether t's records name their tokens as text: with logprobs or prompt logprobs (the gateway renders
        them; a tokenizer-free consumer needs them too)."""
        return t.job.logprobs is not None or t.job.prompt_logprobs is not None

    def prompt_text(self, prompt_token_ids: list[int]) -> str | None:
        """A prompt given as token ids, as text (echo); None without a tokenizer."""
        return self.token_texts.decode(prompt_token_ids) if self.token_texts is not None else None

    def take(self) -> list[tuple[Any, ...]]:
        """Every queued write as commands: the deltas, then one FINALIZE call per FINALIZE_CHUNK jobs."""
        ops, self._ops = self._ops, []
        finals, self._finals = self._finals, []
        self._settling, self._door_done = self._door_done, []
        if self.spans is not None:
            self.spans.sending()
        k = self.keys
        for i in range(0, len(finals), FINALIZE_CHUNK):
            chunk = finals[i : i + FINALIZE_CHUNK]
            keys, args = [k.completions, k.cancelled, k.ids, k.runs], [GROUP, self.ttl, self.maxlen]
            for job_id, entry_id, final_json, dead_json, band in chunk:
                keys += [k.final(job_id), k.result(job_id), k.jobs_of(band), k.dead_of(band)]
                args += [entry_id, job_id, final_json, dead_json]
            ops.append(("EVALSHA", scripts.SHA["finalize"], len(keys), *keys, *args))
        return ops

    def restore(self, ops: list[tuple[Any, ...]]) -> None:
        """Put back what take() returned when its pipeline failed to reach Redis: sent first next time."""
        self._ops = ops + self._ops
        self._door_done = self._settling + self._door_done
        self._settling = []
        if self.spans is not None:
            self.spans.unsent()

    def take_settled(self) -> list[str]:
        """The front-door job ids whose final records the last take()'s pipeline wrote: theirs to settle now."""
        done, self._settling = self._settling, []
        return done

    def check(self, ops: list[tuple[Any, ...]], results: list[Any]) -> None:
        """Inspect the results of ops sent in a pipeline; re-send finalize calls that hit NOSCRIPT."""
        retry = []
        for op, res in zip(ops, results):
            if isinstance(res, NoScriptError):
                retry.append(op)
            elif isinstance(res, Exception) and op[1] == scripts.SHA["dead_raw"]:
                # not even the raw copy could be stored: acknowledge anyway, the log keeps the evidence
                log.error("dead_letter_failed", entry_id=op[6], error=repr(res))
                self._ops += [("XACK", op[3], GROUP, op[6]), ("XDEL", op[3], op[6])]
            elif isinstance(res, Exception):
                raise res
            elif op[0] == "EVALSHA" and op[1] == scripts.SHA["finalize"]:
                written = sum(int(x) for x in res)
                self.finals_written += written
                self.duplicates += len(res) - written
        if retry:
            scripts.load_all(self.redis)
            pipe = self.redis.pipeline(transaction=False)
            for op in retry:
                pipe.execute_command(*op)
            self.check(retry, pipe.execute(raise_on_error=False))


def _dt(start: float, end: float | None) -> float | None:
    return None if end is None else round(max(end - start, 0.0), 6)
