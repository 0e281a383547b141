"""The model runner's copy of a scheduled step (data only, vLLM v1's hand-off): new requests in full, the ones the
runner already holds as diffs since it last saw them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagedq.engine.block_manager import BlockManager
from pagedq.engine.request import Request
from pagedq.engine.step_data import CachedRequestData, NewRequestData, ScheduledChunk, StepPlan

# scheduler.ScheduledRequest: request, num_new, start, sample, epoch, drafts
Scheduled = tuple[Request, int, int, bool, int, tuple[int, ...]]


def build_plan(
    manager: BlockManager,
    scheduled: Iterable[Scheduled],
    blocks: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]], Sequence[tuple[int, int]]],
    departed: tuple[str, ...],
) -> StepPlan:
    """The plan of a step; `blocks`: its (copy-on-write, swap-out, swap-in) pairs; `departed`: ids whose runner rows
    must go. Records on each request what the runner now holds of it."""
    chunks: list[ScheduledChunk] = []
    append, tables, new_cached = chunks.append, manager.block_tables, tuple.__new__
    for request, num_new, start, needs_sample, _, drafts in scheduled:
        table = tables.get(request.request_id, ())
        num_blocks, token_ids = len(table), request.all_token_ids
        if not request.runner_num_tokens:
            append(_new_request_data(request, table, num_new, start, needs_sample, drafts))
        else:
            # Only appended entries, or one copy-on-write replaced (runner_num_blocks was lowered then): every
            # other entry of a running request's table is fixed. Most decode steps send none. Built with
            # tuple.__new__: a NamedTuple's own __new__ is a Python call, and this runs per sequence per step.
            first = request.runner_num_blocks
            new_tokens = tuple(token_ids[request.runner_num_tokens :])
            new_blocks = tuple(table[first:]) if first < num_blocks else ()
            append(
                new_cached(
                    CachedRequestData,
                    (request.request_id, new_tokens, first, new_blocks, num_new, start, needs_sample, drafts),
                )
            )
        request.runner_num_tokens, request.runner_num_blocks = len(token_ids), num_blocks
    copies, swap_out, swap_in = blocks
    return StepPlan(tuple(chunks), departed, tuple(copies), tuple(swap_out), tuple(swap_in))


def _new_request_data(
    request: Request, table: Sequence[int], num_new: int, start: int, needs_sample: bool, drafts: tuple[int, ...]
) -> NewRequestData:
    """A request the runner does not hold, in full."""
    return NewRequestData(
        request.request_id,
        tuple(request.all_token_ids),
        request.num_prompt_tokens,
        request.sampling_params,
        request.sampling_seed,
        request.eos_token_ids,
        tuple(table),
        num_new,
        start,
        needs_sample,
        request.fan_out,
        request.needs_logprobs,
        len(request.prompt_logprobs),
        drafts,
    )
