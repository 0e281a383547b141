"""The scheduler's steady-decode fast path: most sequences' share of most steps.

At 256 decoding sequences the scheduler runs its per-sequence work 256 times a step while the device waits (async
scheduling hides only what fits in a step), so the common case gets a path of its own: a running sequence that
needs exactly its next token, whose slot lies in a block it already holds alone (BlockManager.append_slot). That
is what the general path (`Scheduler._allocate_or_preempt` then `Scheduler._scheduled`) does for it, minus the
checks that cannot fire: no block to take (so no preemption), no copy-on-write, one needed sample. Anything else
(a new block, a shared block, a beam, drafts, a sequence whose in-flight token may end or fork it) stops the run
there: the general path takes it.
"""

from __future__ import annotations

from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.request import Request, ScheduledRequest


def schedule_decodes(
    running: list[Request],
    index: int,
    budget: int,
    manager: BlockManager,
    max_model_len: int,
    scheduled: list[ScheduledRequest],
) -> int:
    """Schedule one decode token for each of running[index:] in turn while it is the steady case (see the module
    doc) and the budget lasts; returns the index of the first not scheduled (left unchanged: the general path takes
    it). Same effects per request as the general path: slot fill, blocks hashed, and `Request.begin_chunk` (its steady
    case, `Request.begin_decode`)."""
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
        if placeholders and request.waits_for_its_token(max_model_len):
            return index  # held back: the general path skips it
        # As Scheduler._scheduled: blocks of known tokens filled by now are hashed too (most steps: none).
        known = start + 1 if start < num_tokens else num_tokens
        if not append_slot(request.request_id, start, token_ids, known, request.cache_salt):
            return index
        append(request.begin_decode())
        index += 1
    return index
