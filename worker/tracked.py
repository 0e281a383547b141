"""What the worker knows about one job it holds (read from the stream, not yet finalised)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .job import Job
from .keys import BANDS, DEFAULT_BAND, band_for_priority


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
class Tracked:
    entry_id: str  # unique only within its origin's stream
    job: Job
    origin: str = DEFAULT_BAND  # the band whose stream it came from, or "celery"
    attempts: int = 0  # runs started (in any worker); a job recovered from a dead worker counts its lost run
    runs_alone: int = 0  # of those, runs started alone as a suspect (persisted in the queue's runs hash)
    guarded: bool = False  # let in ahead of busier bands by the starvation guard (admission.Lanes)
    recovered: bool = False  # from a dead worker (own pending list at restart, XAUTOCLAIM, Celery redelivery)
    seq: int = 0  # read order, the tie-break after priority
    enqueued_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    in_engine: bool = False
    suspect: bool = False  # in a batch whose step raised, or recovered from a dead worker: rerun alone
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, float]] | None = None
    prompt_logprobs: list[dict[str, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    blocks_estimate: int = 0
    last_error: str | None = None
    samples: dict[int, Sample] = field(default_factory=dict)  # n > 1 only, by sample index

    def __post_init__(self) -> None:
        if not self.enqueued_at:
            self.enqueued_at = entry_time(self.entry_id)

    @property
    def key(self) -> str:
        """The held job's identity in this worker (and its engine request id): origin and entry id."""
        return f"{self.origin}/{self.entry_id}"

    @property
    def band(self) -> str:
        """The priority band it is admitted in: its stream's, or for a Celery job the one its priority maps to."""
        return self.origin if self.origin in BANDS else band_for_priority(self.job.priority)

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def estimate_blocks(self, block_size: int) -> int:
        # Text prompts are not tokenised here (the engine does it); ~4 bytes per token is a fair guess.
        job = self.job
        if job.prompt_token_ids is not None:
            prompt = len(job.prompt_token_ids)
        else:  # chat templates add a few dozen tokens of markup per turn
            text = job.prompt if job.prompt is not None else "".join(m.content for m in job.messages)
            prompt = len(text.encode()) // 4 + 1 + (32 * len(job.messages) if job.messages else 0)
        return math.ceil((prompt + job.max_tokens) / max(block_size, 1))

    def reset_output(self) -> None:
        """Forget partial output before a rerun (deltas restart at pos 0; consumers dedupe by pos)."""
        self.token_ids, self.text_parts, self.logprobs, self.prompt_logprobs = [], [], None, None
        self.finish_reason = self.stop_reason = None
        self.samples = {}
        self.first_token_at = None
        self.in_engine = False
