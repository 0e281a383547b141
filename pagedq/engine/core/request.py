"""One generation request as the scheduler sees it.

The single mechanism for prefill and decode (vLLM v1): a request has `num_tokens` tokens (prompt plus
outputs so far) of which `num_computed_tokens` already have K/V in the cache. Each step the scheduler
lets the computed count catch up; when it reaches `num_tokens` the model's last logits are sampled and
one more token is appended. Chunked prefill and recompute preemption are just different catch-up paths.

A request's progress (how far it is computed, what is in flight, what the model runner holds of it) changes only
through `Request`'s own transitions, below its fields: the scheduler, its fast path, the plan builder and the
post-step call them, and nobody assigns those fields.
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


class ScheduledRequest(NamedTuple):
    """One sequence's share of a step, the scheduler's own record of it (the runner gets `SchedulerOutput.plan`).

    A NamedTuple rather than a frozen dataclass: one is built per sequence per step, and it is 3x cheaper.
    """

    request: Request
    num_new_tokens: int
    start_position: int  # the request's num_computed_tokens when scheduled
    needs_sample: bool  # this chunk reaches the request's last token, so its logits yield the next token
    epoch: int  # the request's epoch when scheduled: a result from before a recompute preemption is stale
    draft_token_ids: tuple[int, ...] = ()  # speculative drafts after its last token (counted in num_new_tokens)


_new_scheduled = tuple.__new__  # builds a ScheduledRequest without the NamedTuple's Python-level __new__


@dataclass(slots=True)
class Request:
    """A sequence and its progress. The progress fields, and the one owner of their transitions:

        num_computed_tokens  positions whose K/V is in the cache or being written by a step in flight (it advances
                             when a chunk is scheduled, vLLM v1, so the next step can be scheduled while this one
                             runs; a verify row's drafts count until verification cuts it back)
        num_placeholders     tokens sampled by steps in flight, not appended yet (async scheduling)
        num_in_flight        steps in flight that hold a chunk of it
        epoch                bumped when its computed state is thrown away (recompute): results of older steps
                             are stale and dropped
        runner_num_tokens    tokens the model runner holds of it (0: no row there, it is sent in full next time)
        runner_num_blocks    block-table entries the runner holds that are still right (lowered when an entry
                             changes: copy-on-write, blocks trimmed after verification)

    Only the methods under "progress" below change them (and the constructor, which `fork` goes through):
    begin_chunk (or begin_decode, its steady case) / cancel_chunk / land_chunk for a chunk's life, keep_verified
    after verification, start_computed_at / reset_computed / reset_for_recompute for admission and preemption,
    sent_to_runner / runner_blocks_changed_from / leave_runner for what the runner holds.
    """

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
    # The group's other waves of samples, when there are more than seats (LLMEngine._sample_waves): on its first only
    later_waves: list[Request] = field(default_factory=list, repr=False)
    is_beam: bool = False  # beam sequences report candidates instead of appending a token
    beam_candidates: dict[int, float] | None = None  # token -> logprob, set by the step, taken by selection
    # Seeds its prefix-cache hash chain: sequences whose K/V over the same tokens differ (LongRoPE's short and long
    # rows, pagedq/engine/layers/rotary.py) never share blocks
    cache_namespace: bytes = b""
    # Progress (the class doc: what each means; only the methods under "progress" change them)
    runner_num_tokens: int = 0
    runner_num_blocks: int = 0
    num_placeholders: int = 0
    num_in_flight: int = 0
    epoch: int = 0
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
            cache_namespace=self.cache_namespace,
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

    # ---- progress: the only writers of the fields the class doc lists -------------------------------------------
    def begin_chunk(self, num_new: int, drafts: tuple[int, ...] = ()) -> ScheduledRequest:
        """Schedule the next `num_new` positions (and `drafts` after them, a verify row): they count as computed
        from now on, the step is in flight, and a token it samples is a placeholder until its result lands."""
        start = self.num_computed_tokens
        end = start + num_new
        needs_sample = end == len(self.all_token_ids) + self.num_placeholders
        self.num_computed_tokens = end + len(drafts)
        self.num_in_flight += 1
        if needs_sample and not self.is_beam:
            self.num_placeholders += 1
        return _new_scheduled(ScheduledRequest, (self, num_new + len(drafts), start, needs_sample, self.epoch, drafts))

    def begin_decode(self) -> ScheduledRequest:
        """`begin_chunk(1)` where the scheduler's fast path has checked the steady decode (one token, which samples,
        not a beam): the same transition without the general case's tests (it runs per sequence per step)."""
        start = self.num_computed_tokens
        self.num_computed_tokens = start + 1
        self.num_in_flight += 1
        self.num_placeholders += 1
        return _new_scheduled(ScheduledRequest, (self, 1, start, True, self.epoch, ()))

    def cancel_chunk(self, item: ScheduledRequest) -> None:
        """Take back `item`, scheduled in the step being built (the request is preempted before the step runs)."""
        self.num_computed_tokens = item.start_position
        self.num_in_flight -= 1
        if item.needs_sample and not self.is_beam:
            self.num_placeholders -= 1

    def land_chunk(self, item: ScheduledRequest) -> None:
        """`item`'s step is back (its result is current: same epoch): it is no longer in flight, nor its sample a
        placeholder (the caller appends the token)."""
        self.num_in_flight -= 1
        if item.needs_sample and not self.is_beam:
            self.num_placeholders -= 1

    def keep_verified(self) -> None:
        """After a verify row's tokens are appended: computed up to its last token (the rejected drafts' slots hold
        nothing; the last token is computed next step)."""
        self.num_computed_tokens = len(self.all_token_ids) - 1

    def start_computed_at(self, num_computed: int) -> None:
        """Admission: the first `num_computed` tokens' K/V is already there (the prefix cache's blocks)."""
        self.num_computed_tokens = num_computed

    def reset_computed(self) -> None:
        """Nothing computed, nothing in flight to disown: a waiting request whose admission fell through."""
        self.num_computed_tokens = 0

    def reset_for_recompute(self) -> None:
        """Its K/V is thrown away (recompute preemption, a failed step): nothing computed, and the results of
        steps still in flight for it are stale (a new epoch), so they neither land nor count as placeholders."""
        self.num_computed_tokens = self.num_placeholders = self.num_in_flight = 0
        self.epoch += 1

    def sent_to_runner(self, num_blocks: int) -> None:
        """A step's plan carries it: the runner now holds all its tokens and `num_blocks` table entries."""
        self.runner_num_tokens, self.runner_num_blocks = len(self.all_token_ids), num_blocks

    def runner_blocks_changed_from(self, index: int) -> None:
        """Its block table changed from entry `index` on (copy-on-write, trimmed): the runner's copy is right only
        below it, the next plan sends the rest."""
        if index < self.runner_num_blocks:
            self.runner_num_blocks = index

    def leave_runner(self) -> bool:
        """Its runner row goes (finished, preempted): whether the runner held one (the plan must name it then); it
        is sent in full if it comes back."""
        if not self.runner_num_tokens:
            return False
        self.runner_num_tokens = self.runner_num_blocks = 0
        return True

    def waits_for_its_token(self, max_model_len: int) -> bool:
        """Whether a request whose last sample is still in flight (async scheduling) must not run again yet: it
        has reached its length limit by that token (vLLM's guard: no wasted step), or that token fans out into
        siblings, which must fork from the state before the next position is computed."""
        if not self.num_placeholders:
            return False
        num_tokens = len(self.all_token_ids) + self.num_placeholders
        return (
            self.fan_out > 0
            or num_tokens - len(self.prompt_token_ids) >= self.sampling_params.max_tokens
            or num_tokens >= max_model_len
        )

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
