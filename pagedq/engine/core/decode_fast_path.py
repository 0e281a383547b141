"""The scheduler's record of a sequence's share of a step, and the steady-decode fast path that makes most of them.

At 256 decoding sequences the scheduler runs its per-sequence work 256 times a step while the device waits (async
scheduling hides only what fits in a step), so the common case gets a path of its own: a running sequence that
needs exactly its next token, whose slot lies in a block it already holds alone (BlockManager.append_slot). That
is what the general path (`Scheduler._allocate_or_preempt` then `Scheduler._scheduled`) does for it, minus the
checks that cannot fire: no block to take (so no preemption), no copy-on-write, one needed sample. Anything else
(a new block, a shared block, a beam, drafts, a sequence whose in-flight token may end or fork it) returns None
and takes the general path.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.request import Request


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


def waits_for_its_token(request: Request, max_model_len: int) -> bool:
    """Whether a request whose last sample is still in flight (async scheduling) must not run again yet: it
    has reached its length limit by that token (vLLM's guard: no wasted step), or that token fans out into
    siblings, which must fork from the state before the next position is computed."""
    if not request.num_placeholders:
        return False
    num_tokens = request.num_tokens + request.num_placeholders
    return (
        request.fan_out > 0
        or num_tokens - request.num_prompt_tokens >= request.sampling_params.max_tokens
        or num_tokens >= max_model_len
    )


def schedule_decodes(
    running: list[Request], index: int, budget: int, manager: BlockManager, max_model_len: int, scheduled: list
) -> int:
    """Schedule one decode token for each of running[index:] in turn while it is the steady case (see the module
    doc) and the budget lasts; returns the index of the first not scheduled (left unchanged: the general path takes
    it). Same effects per request as the general path: slot fill, blocks hashed, counts advanced."""
    end = min(len(running), index + budget)
    append_slot, append = manager.append_slot, scheduled.append
    while index < end:
        request = running[index]
        token_ids = request.all_token_ids
        num_tokens = len(token_ids)
        placeholders = request.num_placeholders
        start = request.num_computed_tokens
        if num_tokens + placeholders - start != 1 or request.is_beam:
            return index  # a prefill chunk, nothing to compute, or a beam
        if placeholders and waits_for_its_token(request, max_model_len):
            return index  # held back: the general path skips it
        # As Scheduler._scheduled: blocks of known tokens filled by now are hashed too (most steps: none).
        if not append_slot(request.request_id, start, token_ids, start + 1 if start < num_tokens else num_tokens):
            return index
        request.num_computed_tokens = start + 1
        request.num_in_flight += 1
        request.num_placeholders = placeholders + 1
        append(_new_scheduled(ScheduledRequest, (request, 1, start, True, request.epoch, ())))
        index += 1
    return index
