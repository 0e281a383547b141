"""The jobs a worker holds: one identity and one state per job, in one registry.

A held job is named by its JobKey: its origin (the band whose stream it came from, or Celery) and its job id.
Stream entry ids are unique only within one stream, so they are not an identity; the entry id is kept only to
acknowledge the entry. The same job id from two origins (two bands, or Celery and a stream) is two held jobs,
each acknowledged in its own place; the first final record written wins (FINALIZE).

States (JobState): BACKLOG (read, not yet in the engine) → IN_ENGINE → FINAL, with SUSPECT (waiting to be rerun
alone after a failed step, or recovered from a dead worker) between. Every move is checked against MOVES.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from pagedq.engine.sample.sampling_params import SamplingParams
from pagedq.worker.protocol.job import Job
from pagedq.worker.protocol.keys import BANDS, band_for_priority

CELERY_ORIGIN = "celery"  # held jobs that came from the Celery queue: no stream entry to acknowledge


class JobKey(NamedTuple):
    origin: str  # a band name or CELERY_ORIGIN
    job_id: str

    def __str__(self) -> str:
        """The engine request id. Neither band names nor job ids ([A-Za-z0-9_.:-]) contain '/'."""
        return f"{self.origin}/{self.job_id}"

    @classmethod
    def parse(cls, request_id: str) -> JobKey:
        origin, _, job_id = request_id.partition("/")
        return cls(origin, job_id)


class JobState(enum.Enum):
    BACKLOG = "backlog"
    IN_ENGINE = "in_engine"
    SUSPECT = "suspect"
    FINAL = "final"


WAITING = (JobState.BACKLOG, JobState.SUSPECT)  # held, not in the engine: what admission chooses from
MOVES = {
    JobState.BACKLOG: {JobState.IN_ENGINE, JobState.SUSPECT, JobState.FINAL},
    JobState.SUSPECT: {JobState.IN_ENGINE, JobState.SUSPECT, JobState.FINAL},
    JobState.IN_ENGINE: {JobState.SUSPECT, JobState.FINAL},
    JobState.FINAL: set(),
}


class IllegalMove(RuntimeError):
    """A state change the model does not allow (a bug in the worker, never the job's fault)."""


def entry_time(entry_id: str) -> float:
    """Unix time of a stream entry id (Redis' clock at XADD): the enqueue time, independent of producer clocks."""
    try:
        return int(entry_id.split("-", 1)[0]) / 1000.0
    except ValueError:
        return time.time()


@dataclass
class Sample:
    """One of the n parallel samples of a job with n > 1 (the engine's CompletionOutput.index)."""

    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class HeldJob:
    key: JobKey
    job: Job
    entry_id: str | None = None  # the stream entry to acknowledge (None for Celery); unique only in its stream
    state: JobState = JobState.BACKLOG
    attempts: int = 0  # runs started (in any worker); a job recovered from a dead worker counts its lost run
    runs_alone: int = 0  # of those, runs started alone as a suspect (persisted in the queue's runs hash)
    alone: bool = False  # in the engine as a suspect's run alone: nothing is admitted beside it
    guarded: bool = False  # let in ahead of busier bands by the starvation guard (admission.Lanes)
    recovered: bool = False  # from a dead worker (own pending list at restart, XAUTOCLAIM, Celery redelivery)
    seq: int = 0  # read order, the tie-break after priority
    size: int = 0  # characters of its entry's JSON as read (0: it came through a front door); prompt_pool.py reads it
    enqueued_at: float = 0.0
    read_at: float = 0.0  # time.monotonic() when read (or polled): the start of its read-to-admit delay
    read_unix: float = 0.0  # the same moment as unix time, kept after admission (its spans: service/job_spans.py)
    admitted_at: float | None = None
    first_token_at: float | None = None
    started: bool = False  # the engine has produced output for it (it left the engine's waiting queue)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, served by the engine's prefix cache
    preempted_at: list[float] = field(default_factory=list)  # when each of its preemptions was seen (its spans)
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, float]] | None = None
    prompt_logprobs: list[dict[str, float] | None] | None = None
    prompt_token_ids: list[int] | None = None  # kept for echo and prompt_logprobs (the records carry them)
    prompt_text: str | None = None
    prompt_streamed: bool = False  # echo: the first delta carried the prompt
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    engine_input: str | list[int] | None = None  # the prompt as the engine gets it (chat rendered); see prepared
    sampling_params: SamplingParams | None = None  # built once, when prepared (admission.prepare); every run uses it
    blocks_needed: int = 0  # KV blocks it takes in the engine at its longest, by the engine's own count
    admission_tokens: int = 0  # prompt + max_tokens x samples: its cost in its tenant's share (service/tenants.py)
    last_error: str | None = None
    samples: dict[int, Sample] = field(default_factory=dict)  # n > 1 only, by sample index

    def __post_init__(self) -> None:
        if not self.enqueued_at:
            self.enqueued_at = entry_time(self.entry_id) if self.entry_id else time.time()

    def move(self, state: JobState) -> None:
        if state not in MOVES[self.state]:
            raise IllegalMove(f"job {self.key}: {self.state.value} -> {state.value}")
        self.state = state
        if state is not JobState.IN_ENGINE:
            self.alone = self.started = False

    @property
    def prepared(self) -> bool:
        return self.engine_input is not None

    @property
    def origin(self) -> str:
        return self.key.origin

    @property
    def request_id(self) -> str:
        return str(self.key)

    @property
    def in_engine(self) -> bool:
        return self.state is JobState.IN_ENGINE

    @property
    def waiting_in_engine(self) -> bool:
        """Handed to the engine, no output yet: still in the engine's waiting queue as far as we know."""
        return self.state is JobState.IN_ENGINE and not self.started

    @cached_property  # fixed (origin and job are), and read per held job several times a turn
    def band(self) -> str:
        """The priority band it is admitted in: its stream's, or for a Celery job the one its priority maps to."""
        return self.origin if self.origin in BANDS else band_for_priority(self.job.vllm_priority)

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def reset_output(self) -> None:
        """Forget partial output before a rerun (deltas restart at pos 0; consumers dedupe by pos)."""
        self.token_ids, self.text_parts, self.logprobs, self.prompt_logprobs = [], [], None, None
        self.finish_reason = self.stop_reason = None
        self.prompt_streamed = False
        self.samples = {}
        self.first_token_at = None
        self.preempted_at = []


class HeldJobs:
    """Every job a worker holds, by JobKey. A job leaves only through finish() (its state becomes FINAL)."""

    def __init__(self) -> None:
        self._jobs: dict[JobKey, HeldJob] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[HeldJob]:
        return iter(list(self._jobs.values()))  # a copy: callers finish jobs while iterating

    def __contains__(self, key: object) -> bool:
        return key in self._jobs

    def get(self, key: JobKey) -> HeldJob | None:
        return self._jobs.get(key)

    def by_request_id(self, request_id: str) -> HeldJob | None:
        return self._jobs.get(JobKey.parse(request_id))

    def add(self, t: HeldJob) -> None:
        if t.key in self._jobs:
            raise IllegalMove(f"job {t.key} is already held")
        if t.state not in WAITING:
            raise IllegalMove(f"job {t.key} enters the registry as {t.state.value}")
        self._jobs[t.key] = t

    def finish(self, t: HeldJob) -> None:
        """The job is settled (final record queued, dead-lettered, or rejected by the engine)."""
        t.move(JobState.FINAL)
        if self._jobs.get(t.key) is t:
            del self._jobs[t.key]

    def in_state(self, *states: JobState) -> list[HeldJob]:
        return [t for t in self._jobs.values() if t.state in states]

    def waiting(self) -> list[HeldJob]:
        """The backlog: held jobs not in the engine (BACKLOG and SUSPECT)."""
        return self.in_state(*WAITING)

    def with_job_ids(self, job_ids: set[str]) -> list[HeldJob]:
        return [t for t in self._jobs.values() if t.id in job_ids]

    def job_ids(self) -> list[str]:
        return sorted({key.job_id for key in self._jobs})

    def entry_ids(self, origin: str) -> list[str]:
        return [t.entry_id for t in self._jobs.values() if t.origin == origin and t.entry_id]

    def past_deadline(self, now: float) -> list[HeldJob]:
        return [t for t in self._jobs.values() if t.job.deadline is not None and now >= t.job.deadline]
