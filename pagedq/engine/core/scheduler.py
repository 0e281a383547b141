"""Continuous batching: which sequences advance this step, by how many tokens, and who is preempted.

Each step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs: a request that will
fork n / best_of samples takes a seat for each when admitted). Running sequences go first, in admission
order: a decoding one needs one token, a half-prefilled one the rest of its prompt (chunked to what the
budget allows). Priorities are vLLM's: a lower value is served sooner. When the pool runs dry the
lowest-priority (highest value), most recently admitted running sequence is
preempted: by recompute (its blocks are freed and it will be prefilled again, which prefix caching makes
cheap) or by swap (its blocks are copied to a CPU pool and back). It then waits ahead of new arrivals of its
priority. Waiting sequences are admitted only in steps that preempted nobody for blocks.

Seats are preempted too (pagedq/engine/core/seats.py): when a waiting request outranks running ones and no seat is
free, the lowest-priority, most recently admitted of them gives up its seat, by the same recompute or swap,
within bounds.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.decode_fast_path import schedule_decodes
from pagedq.engine.core.request import Request, RequestStatus, ScheduledRequest
from pagedq.engine.core.seats import SeatPolicy, seat_victims, seats_of, waiting_groups
from pagedq.engine.core.step_plan import StepPlan, build_plan
from pagedq.engine.core.swap import SwapSpace


class Lookahead(Protocol):
    """Speculative decoding as the scheduler sees it (pagedq/engine/spec_decode/drafts.py's `Speculation`)."""

    def lookahead(self, request: Request, budget: int, manager: BlockManager, reserve: int) -> tuple[int, ...]:
        """Drafts for a sequence scheduled for one token, their KV slots allocated; `reserve`: free blocks to leave
        for the sequences still to schedule."""
        ...


_NUM_NEW, _DRAFTS = attrgetter("num_new_tokens"), attrgetter("draft_token_ids")


@dataclass
class SchedulerOutput:
    """The scheduler's record of a step (live requests, for what happens after it) and `plan`, its data-only
    copy for the model runner."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    plan: StepPlan = field(default_factory=StepPlan)

    @property
    def num_batched_tokens(self) -> int:
        return sum(map(_NUM_NEW, self.scheduled))

    @property
    def num_drafts(self) -> int:
        return sum(map(len, map(_DRAFTS, self.scheduled)))  # C loops: read twice per step

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        swap_space: SwapSpace | None = None,
        max_model_len: int = 2**62,
        seat_policy: SeatPolicy | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.swap_space = swap_space  # None: preemption by recompute
        self.running: list[Request] = []
        # Heap of (admission key, push order, request): forked siblings share an arrival index, so the push
        # order breaks ties and requests themselves are never compared.
        self._waiting: list[tuple[tuple[int, int, int], int, Request]] = []
        self._push_counter = itertools.count()
        self._admission_counter = itertools.count()
        self.num_preemptions = 0  # for blocks and for seats
        self.seat_policy = seat_policy or SeatPolicy()
        self.num_seat_preemptions = 0
        self.num_schedules = 0  # the step clock of the seat policy
        self._left_runner: list[str] = []  # ids whose runner rows must go (named in the next plan)

    # ---- queue bookkeeping -------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests in the order they will be admitted."""
        return [item[-1] for item in sorted(self._waiting)]

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.running)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.arrival_index = next(self._admission_counter)
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        # The lowest value first (a preempted low-priority one must not block the one that took its seat); among
        # equals preempted requests go ahead of new arrivals; then first come first served.
        resumed = request.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
        key = (request.priority, 0 if resumed else 1, request.arrival_index)
        heapq.heappush(self._waiting, (key, next(self._push_counter), request))

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of whichever queue holds it and return its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self._waiting = [item for item in self._waiting if item[-1] is not request]
            heapq.heapify(self._waiting)
        if request.status is RequestStatus.SWAPPED:
            self._swap_space().discard(request.request_id)
        request.status = status
        self.block_manager.free(request.request_id)
        self._forget_in_runner(request)

    def _forget_in_runner(self, request: Request) -> None:
        if request.leave_runner():
            self._left_runner.append(request.request_id)

    def fork(self, parent: Request, child: Request) -> None:
        """Run `child` (a fork of running `parent`) from now on, sharing the parent's blocks."""
        self.block_manager.fork(parent.request_id, child.request_id)
        child.status = RequestStatus.RUNNING
        child.seat_since_step = parent.seat_since_step
        self.running.append(child)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self, speculation: Lookahead | None = None) -> SchedulerOutput:
        """The step; with `speculation`, decoding sequences may bring drafts (pagedq/engine/spec_decode/drafts.py)."""
        output = SchedulerOutput()
        self.num_schedules += 1
        # Seats first: a victim not yet scheduled in this step can be swapped, not only recomputed.
        num_seat_victims = self._preempt_for_seats(output)
        budget = self.max_num_batched_tokens
        index = 0
        running, scheduled, manager = self.running, output.scheduled, self.block_manager
        while index < len(running) and budget > 0:
            if speculation is None:  # most sequences most steps: one token into a block of their own
                reached = schedule_decodes(running, index, budget, manager, self.max_model_len, scheduled)
                budget, index = budget - (reached - index), reached
                if index == len(running) or not budget:
                    break
            request = running[index]
            placeholders = request.num_placeholders
            num_new = min(len(request.all_token_ids) + placeholders - request.num_computed_tokens, budget)
            if num_new == 0 or (placeholders and request.waits_for_its_token(self.max_model_len)):
                index += 1  # a beam waiting for its siblings' candidates, or see Request.waits_for_its_token
                continue
            num_preempted = len(output.preempted)
            if not self._allocate_or_preempt(request, num_new, output):
                break  # the request itself was preempted: nothing after it in the list runs either
            drafts: tuple[int, ...] = ()
            if speculation is not None and num_new == 1:  # lookahead slots from spare blocks only
                drafts = speculation.lookahead(request, budget - 1, self.block_manager, len(self.running) - index - 1)
            output.scheduled.append(self._scheduled(request, num_new, drafts))
            budget -= num_new + len(drafts)
            if len(output.preempted) > num_preempted:
                # Victims may have sat before this request in the list, and may already have been scheduled
                # (lower priority but admitted earlier): they left the step, and their tokens the budget.
                index = self.running.index(request)
                budget = self.max_num_batched_tokens - output.num_batched_tokens
            index += 1
        if len(output.preempted) == num_seat_victims:  # nobody preempted for blocks
            self._admit_waiting(budget, output)
        output.plan = self._plan(output)
        return output

    def _free_seats(self) -> int:
        # A sequence still to fan out (n / best_of before its first token) holds a seat for each sample it forks.
        return self.max_num_seqs - len(self.running) - sum(r.fan_out for r in self.running)

    def _preempt_for_seats(self, output: SchedulerOutput) -> int:
        """Preempt the running sequences whose seats waiting ones of higher priority take (core/seats.py)."""
        if not (self._waiting and self.running and self.seat_policy.enabled):
            return 0
        head = self._waiting[0][-1]
        # The common case, checked cheaply: nobody waiting outranks anyone running, or the head has its seats.
        if head.priority >= max(r.priority for r in self.running) or (
            not head.is_beam and self._free_seats() >= seats_of([head])
        ):
            return 0
        groups = waiting_groups([item[-1] for item in sorted(self._waiting)])
        victims = seat_victims(self.running, groups, self._free_seats(), self.num_schedules, self.seat_policy)
        for victim in victims:
            self._preempt(victim, output)
            victim.num_seat_preemptions += 1
        self.num_seat_preemptions += len(victims)
        return len(victims)

    def _swap_space(self) -> SwapSpace:
        """The swap space a SWAPPED request implies (only preemption by swapping makes one)."""
        if self.swap_space is None:
            raise RuntimeError("a request is SWAPPED but this scheduler has no swap space")
        return self.swap_space

    def take_departures(self) -> tuple[str, ...]:
        """Ids of requests the runner holds that have left since the last plan (for a step that runs nothing)."""
        departed, self._left_runner = tuple(self._left_runner), []
        return departed

    def _plan(self, output: SchedulerOutput) -> StepPlan:
        """The runner's copy of the step (pagedq/engine/core/step_plan.py)."""
        blocks = (output.blocks_to_copy, output.blocks_to_swap_out, output.blocks_to_swap_in)
        return build_plan(self.block_manager, output.scheduled, blocks, self.take_departures())

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        """Make room for `num_new` more tokens of a running request, preempting others if needed."""
        start = request.num_computed_tokens
        while (copies := self.block_manager.allocate_slots(request.request_id, start, start + num_new)) is None:
            victim = self._pick_victim()
            # A beam group runs or waits as a whole: its next selection needs every live beam's candidates, so
            # beams left running while their siblings wait would hold blocks and never advance.
            group = [r for r in self.running if r.group_id == victim.group_id] if victim.is_beam else [victim]
            for member in group:
                self._preempt(member, output)
            if request.status is not RequestStatus.RUNNING:
                return False
        if copies:  # copy-on-write replaced the entry of the block being written: the runner must hear of it
            request.runner_blocks_changed_from(start // self.block_manager.block_size)
        output.blocks_to_copy += copies
        return True

    def _pick_victim(self) -> Request:
        """The lowest-priority (highest value) running request; among equals the most recently admitted."""
        lowest = max(r.priority for r in self.running)
        return next(r for r in reversed(self.running) if r.priority == lowest)

    def requeue_for_recompute(self, request: Request) -> None:
        """Send a running request back to the waiting queue with nothing computed (after a failed step)."""
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.reset_for_recompute()
        self._forget_in_runner(request)
        self._push_waiting(request)

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        already_scheduled = self._unschedule(request, output)
        self.running.remove(request)
        swapped = None
        # Swap only what holds exactly its computed tokens: not a request scheduled this step (its table has
        # blocks and copy-on-write targets this step was to fill), not a beam (swapping would unshare its blocks),
        # not one whose first token, still in flight, fans out (the fork needs its blocks on the device). A step in
        # flight for it still lands: its blocks are copied out after that step wrote them, its result is applied.
        if (
            self.swap_space is not None
            and not already_scheduled
            and not request.is_beam
            and not (request.num_in_flight and request.fan_out)
        ):
            manager = self.block_manager
            held, first = manager.held_blocks(request.request_id), manager.first_held(request.request_id)
            swapped = self.swap_space.swap_out(request.request_id, held, first)
        self.block_manager.free(request.request_id)
        self._forget_in_runner(request)
        if swapped is not None:
            output.blocks_to_swap_out += swapped
            request.status = RequestStatus.SWAPPED
        else:  # recompute (also the fallback when the CPU pool is full)
            request.status = RequestStatus.PREEMPTED
            request.reset_for_recompute()
        request.num_preemptions += 1
        self.num_preemptions += 1
        output.preempted.append(request)
        self._push_waiting(request)

    def _unschedule(self, request: Request, output: SchedulerOutput) -> bool:
        """Take a request that is being preempted back out of this step, if it was already in it."""
        for position, item in enumerate(output.scheduled):
            if item.request is request:
                del output.scheduled[position]
                request.cancel_chunk(item)
                self.block_manager.uncache_uncomputed(request.request_id, item.start_position)
                own = set(self.block_manager.held_blocks(request.request_id))
                output.blocks_to_copy = [(src, dst) for src, dst in output.blocks_to_copy if dst not in own]
                return True
        return False

    def _admit_waiting(self, budget: int, output: SchedulerOutput) -> None:
        if not self._waiting:
            return
        free_seats = self._free_seats()
        while self._waiting and budget > 0 and free_seats > 0:
            group = self._waiting_group(self._waiting[0][-1])
            seats = seats_of(group)
            if seats > free_seats or budget < len(group):
                break  # head-of-line: a lower-priority request must not overtake it
            admitted: list[Request] = []
            for position, request in enumerate(group):
                # Leave a token of budget for each member still to come: a group enters whole or not at all.
                if not self._admit(request, budget - (len(group) - 1 - position), output):
                    break
                admitted.append(request)
                budget -= output.scheduled[-1].num_new_tokens
            if len(admitted) < len(group):
                for request in reversed(admitted):
                    self._unschedule(request, output)
                    self.block_manager.free(request.request_id)
                    request.reset_computed()
                break
            self._leave_waiting(group)
            free_seats -= seats
            for request in group:
                request.status = RequestStatus.RUNNING
                request.seat_since_step = self.num_schedules
                self.running.append(request)

    def _waiting_group(self, head: Request) -> list[Request]:
        """What must be admitted together with the head of the queue: all waiting beams of its group, or itself."""
        if not head.is_beam:
            return [head]
        return [item[-1] for item in sorted(self._waiting) if item[-1].group_id == head.group_id]

    def _leave_waiting(self, group: list[Request]) -> None:
        if len(group) == 1:
            heapq.heappop(self._waiting)
        else:
            self._waiting = [item for item in self._waiting if item[-1] not in group]
            heapq.heapify(self._waiting)

    def _admit(self, request: Request, budget: int, output: SchedulerOutput) -> bool:
        manager = self.block_manager
        swapped = request.status is RequestStatus.SWAPPED
        if not swapped and not request.needs_prompt_logprobs:  # cached prompt blocks would skip their logits
            request.start_computed_at(
                manager.match_prefix(request.request_id, request.all_token_ids, request.cache_namespace)
            )
        start = request.num_computed_tokens
        num_new = min(request.num_tokens - start, budget)
        # A swapped request needs device blocks for what it had computed too: allocate from position 0.
        copies = manager.allocate_slots(request.request_id, 0 if swapped else start, start + num_new, first_query=start)
        if copies is None:
            if not swapped:
                manager.free(request.request_id)  # give back the prefix blocks it took
                request.reset_computed()
            return False
        output.blocks_to_copy += copies
        if swapped:
            held, first = manager.held_blocks(request.request_id), manager.first_held(request.request_id)
            output.blocks_to_swap_in += self._swap_space().swap_in(request.request_id, held, first)
        if request.num_cached_tokens < 0:  # as vLLM: the hits of the first admission (a recompute is not reported)
            request.num_cached_tokens = start
        output.scheduled.append(self._scheduled(request, num_new))
        return True

    def _scheduled(self, request: Request, num_new: int, drafts: tuple[int, ...] = ()) -> ScheduledRequest:
        """Record a request's chunk (`Request.begin_chunk`: it counts as computed from now on, vLLM v1, so the next
        step can be scheduled while this one runs)."""
        # Blocks this step fills are cached now, not after the step: a request admitted later in this same
        # step may then reuse them, since every layer stores the whole batch's K/V before attending. Only blocks
        # of known tokens: one holding a placeholder is hashed once its token is in.
        end = min(request.num_computed_tokens + num_new, len(request.all_token_ids))
        self.block_manager.cache_full_blocks(request.request_id, request.all_token_ids, end, request.cache_namespace)
        return request.begin_chunk(num_new, drafts)
