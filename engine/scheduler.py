"""Continuous batching: which requests advance this step, by how many tokens, and who is preempted.

Each step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running
requests go first, in admission order: a decoding one needs one token, a half-prefilled one the rest of
its prompt (chunked to what the budget allows). When the pool runs dry the lowest-priority, most recently
admitted running request is preempted by recompute: its blocks are freed and it waits again, ahead of
new arrivals, with num_computed_tokens reset. Waiting requests are admitted only in steps that preempted
nobody, so a preempted request is not immediately re-admitted only to be preempted again.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, fixed when scheduled (the request itself moves on afterwards)."""

    request: Request
    num_new_tokens: int
    start_position: int  # the request's num_computed_tokens when scheduled
    block_table: list[int]
    needs_sample: bool  # this chunk reaches the request's last token, so its logits yield the next token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple[int, int, int], Request]] = []  # heap on _waiting_key
        self._admission_counter = itertools.count()
        self.num_preemptions = 0

    # ---- queue bookkeeping -------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests in the order they will be admitted."""
        return [request for _, request in sorted(self._waiting, key=lambda item: item[0])]

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.running)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.arrival_index = next(self._admission_counter)
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        # Preempted requests go ahead of new arrivals; then higher priority; then first come first served.
        key = (0 if request.status is RequestStatus.PREEMPTED else 1, -request.priority, request.arrival_index)
        heapq.heappush(self._waiting, (key, request))

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of whichever queue holds it and return its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self._waiting = [item for item in self._waiting if item[1] is not request]
            heapq.heapify(self._waiting)
        request.status = status
        self.block_manager.free(request.request_id)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, output):
                break  # the request itself was preempted: nothing after it in the list runs either
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1
        if not output.preempted:
            budget = self._admit_waiting(budget, output)
        return output

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        """Make room for `num_new` more tokens of a running request, preempting others if needed."""
        while not self.block_manager.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
            victim = self._pick_victim()
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _pick_victim(self) -> Request:
        """The lowest-priority running request; among equals the most recently admitted."""
        lowest = min(r.priority for r in self.running)
        return next(r for r in reversed(self.running) if r.priority == lowest)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    def _admit_waiting(self, budget: int, output: SchedulerOutput) -> int:
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._waiting[0][1]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.block_manager.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                break  # head-of-line: a lower-priority request must not overtake it
            heapq.heappop(self._waiting)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request, num_new, start, self.block_manager.block_table(request.request_id),
                                needs_sample=start + num_new == request.num_tokens)

    # ---- after the forward pass -----------------------------------------------------------------
    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int], max_model_len: int
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests that hit a token-level stop.

        Returns every request that got a new token this step (finished ones included).
        """
        advanced = []
        for item in output.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            token = sampled.get(request.request_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            request.append_output_token(token)
            advanced.append(request)
            stop = request.check_token_stop(max_model_len)
            if stop is not None:
                self.finish_request(request, stop)
        return advanced
