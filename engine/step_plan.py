"""The model runner's copy of a scheduled step (data only, vLLM v1's hand-off): new requests in full, the ones the
runner already holds as diffs since it last saw them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.block_manager import BlockManager
from engine.request import Request
from engine.step_data import CachedRequestData, NewRequestData, ScheduledChunk, StepPlan

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
    for request, num_new, start, needs_sample, _, drafts in scheduled:
        table = manager.block_table(request.request_id)
        if not request.runner_num_tokens:
            chunks.append(
                NewRequestData(
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
            )
        else:
            # Only appended entries, or one copy-on-write replaced (runner_num_blocks was lowered then): every
            # other entry of a running request's table is fixed. Most decode steps send none.
            first = request.runner_num_blocks
            chunks.append(
                CachedRequestData(
                    request.request_id,
                    tuple(request.all_token_ids[request.runner_num_tokens :]),
                    first,
                    tuple(table[first:]),
                    num_new,
                    start,
                    needs_sample,
                    drafts,
                )
            )
        request.runner_num_tokens, request.runner_num_blocks = request.num_tokens, len(table)
    copies, swap_out, swap_in = blocks
    return StepPlan(tuple(chunks), departed, tuple(copies), tuple(swap_out), tuple(swap_in))
