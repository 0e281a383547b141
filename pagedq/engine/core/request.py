"""One generation request as the scheduler sees it.

The single mechanism for prefill and decode (vLLM v1): a request has `num_tokens` tokens (prompt plus
outputs so far) of which `num_computed_tokens` already have K/V in the cache. Each step the scheduler
lets the computed count catch up; when it reaches `num_tokens` the model's last logits are sampled and
one more token is appended. Chunked prefill and recompute preemption are just different catch-up paths.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedq.engine.sample.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; will recompute
    SWAPPED = "swapped"  # blocks copied to the CPU pool; will be copied back
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        # Identity tests: checked per sequence several times a step, and `in (tuple)` goes through Enum.__eq__.
        return (
            self is RequestStatus.FINISHED_STOPPED
            or self is RequestStatus.FINISHED_LENGTH
            or self is RequestStatus.FINISHED_ABORTED
        )


class SampledToken(NamedTuple):
    """One token drawn for a sequence, with its log-probability and the top alternatives when asked for.

    A NamedTuple (immutable, and several times cheaper to build than a frozen dataclass: one per draw per step)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    priority: int = 0  # vLLM's sense: a lower value is served sooner and preempted later
    sampling_seed: int = 0  # params.seed, or one the engine drew: every request samples from its own stream
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_index: int = 0  # admission order among equal priorities
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens the prefix cache served at first admission (-1: not admitted yet)
    num_preemptions: int = 0  # for KV blocks or for its seat
    num_seat_preemptions: int = 0  # for its seat (pagedq/engine/core/seats.py bounds them)
    seat_since_step: int = 0  # the scheduler's step count when it last took a seat
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # Entry j: log-probability of prompt token j (and the top alternatives) given tokens < j; entry 0 is None.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    first_token_time: float | None = None
    group_id: str = ""  # the user's request id; sequences forked from it (samples, beams) share it
    index: int = 0  # which sample of its group
    fan_out: int = 0  # extra samples to fork from this sequence when its first token is drawn
    is_beam: bool = False  # beam sequences report candidates instead of appending a token
    beam_candidates: dict[int, float] | None = None  # token -> logprob, set by the step, taken by selection
    # What the model runner holds of this request (0 tokens: no row there; it is sent in full next time).
    runner_num_tokens: int = 0
    runner_num_blocks: int = 0
    # Async scheduling: tokens sampled by steps still in flight (not yet appended), and those steps' count.
    num_placeholders: int = 0
    num_in_flight: int = 0
    epoch: int = 0  # bumped when its computed state is thrown away (recompute): older step results are stale
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id
        if self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities asked for and not all computed yet (its prompt must not come from the cache)."""
        return self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )

    @property
    def needs_logprobs(self) -> bool:
        """Whether the sampler must return this request's log-probabilities (asked for, or needed for ranking)."""
        params = self.sampling_params
        return params.logprobs is not None or params.num_samples > params.n or self.is_beam

    def fork(self, request_id: str, index: int, sampling_seed: int) -> Request:
        """A sibling sequence with the same tokens so far (its blocks are forked by the block manager)."""
        child = Request(
            request_id=request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            eos_token_ids=self.eos_token_ids,
            prompt=self.prompt,
            priority=self.priority,
            sampling_seed=sampling_seed,
            arrival_time=self.arrival_time,
            arrival_index=self.arrival_index,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            group_id=self.group_id,
            index=index,
            is_beam=self.is_beam,
            first_token_time=self.first_token_time,
        )
        child.all_token_ids = list(self.all_token_ids)
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = list(self.logprobs)
        child.prompt_logprobs = self.prompt_logprobs  # complete by now (forks follow the first token), shared
        return child

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, sampled: SampledToken) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        token_id, logprob, top_logprobs = sampled
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.cumulative_logprob += logprob
        if top_logprobs is not None and self.sampling_params.logprobs is not None:
            self.logprobs.append(top_logprobs)

    def check_token_stop(self, max_model_len: int) -> RequestStatus | None:
        """Stop conditions decidable from token ids alone (stop strings need text: the output processor)."""
        params = self.sampling_params
        token_ids = self.all_token_ids
        num_tokens = len(token_ids)
        num_output_tokens = num_tokens - len(self.prompt_token_ids)
        if num_output_tokens >= params.min_tokens:
            last = token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
