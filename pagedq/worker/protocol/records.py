"""The result records of the wire protocol: a job's one final record and its streamed deltas."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedq.worker.protocol.errors import JobFailed

Status = Literal["completed", "failed", "cancelled", "expired", "rejected"]


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Timings(BaseModel):
    """Seconds. queue_wait: enqueue to admission; ttft: enqueue to first token; total: enqueue to final."""

    queue_wait: float | None = None
    ttft: float | None = None
    total: float | None = None


class Choice(BaseModel):
    """One of the n samples of a job with n > 1, in the final record's ``choices`` (index order)."""

    index: int
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[str, float]] | None = None


class FinalRecord(BaseModel):
    """The one final record of a job, in its result stream and in the completions stream."""

    model_config = ConfigDict(extra="ignore")

    id: str
    status: Status
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    metadata: dict[str, Any] | None = None
    error: str | None = None
    # what kind of refusal a rejection is, where callers act on it: "context_length_exceeded" (the prompt and
    # max_tokens do not fit the model's context; the gateway answers it in OpenAI's shape); None otherwise
    error_code: str | None = None
    logprobs: list[dict[str, float]] | None = None
    prompt_logprobs: list[dict[str, float] | None] | None = None  # entry j: prompt token j; the first is None
    worker: str | None = None
    attempts: int = 1
    # n > 1: every sample (the top-level text/token_ids/finish_reason/logprobs are sample 0's); None when n = 1
    choices: list[Choice] | None = None
    # echo (or prompt_logprobs): the prompt as the engine read it, and as text
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    # logprobs or prompt_logprobs: the text of every token id the record names (keys: ids as strings)
    token_texts: dict[str, str] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "completed"

    def raise_for_status(self) -> FinalRecord:
        if not self.ok:
            raise JobFailed(self)
        return self


class Delta(BaseModel):
    """One streamed piece of output. ``pos`` is the number of tokens generated before it: a redelivered job
    restarts at pos 0, so consumers skip what they already have. ``offset`` is the result stream entry id to
    resume from. With n > 1 each sample has its own ``index`` and ``pos``."""

    text: str
    token_ids: list[int]
    pos: int
    offset: str = ""
    index: int = 0  # the sample it belongs to (n > 1); pos counts that sample's tokens
    logprobs: list[dict[str, float]] | None = None
    token_texts: dict[str, str] | None = None  # as the final record's, for the ids this delta names
    # echo: the job's first delta also carries the prompt (and its logprobs when asked)
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    prompt_logprobs: list[dict[str, float] | None] | None = None
