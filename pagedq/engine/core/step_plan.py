"""What crosses between the scheduler and the model runner: plain data keyed by request id, never a `Request`, and
`build_plan`, which makes a step's plan from the scheduler's live requests.

As vLLM v1's `SchedulerOutput`: a request the runner does not hold yet (new, resumed after a preemption, a fresh
fork or beam) comes in full; one it holds comes as a diff (tokens appended since it last saw it, block-table
entries from the first that changed). Requests that left (finished, aborted, preempted) are named so the runner
drops their rows. The runner answers with a `ModelRunnerOutput` keyed by request id. Everything here is an
immutable snapshot taken at schedule time: the scheduler's own objects move on while the step runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.request import Request, SampledToken, ScheduledRequest
from pagedq.engine.sample.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedq.engine.lora.adapter import LoRAAdapter


class NewRequestData(NamedTuple):
    """A request the runner has no row for: everything it needs to run and sample it from now on.

    NamedTuples (immutable, like frozen dataclasses, and 3x cheaper to build: one per request per step)."""

    req_id: str
    token_ids: tuple[int, ...]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    sampling_seed: int
    eos_token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]  # the whole block table
    num_new_tokens: int
    start_position: int  # num_computed_tokens when scheduled
    needs_sample: bool  # this chunk reaches the last token: its logits give the next one
    fan_out: int = 0  # extra draws from the same logits at the first sample (n / best_of)
    wants_logprobs: bool = False  # asked for, or needed for ranking (best_of, beams)
    num_prompt_logprobs_done: int = 0  # prompt log-probability entries the request already has
    draft_token_ids: tuple[int, ...] = ()  # speculative drafts after its last token (in num_new_tokens)
    lora_slot: int = -1  # the device slot of its LoRA adapter (-1: the base model); fixed while it runs


class CachedRequestData(NamedTuple):
    """A request the runner holds: what changed since it last saw it."""

    req_id: str
    new_token_ids: tuple[int, ...]  # appended since (sampled, chosen by beam selection)
    block_ids_from: int  # index of the first block-table entry below that changed (growth or copy-on-write)
    block_ids: tuple[int, ...]  # entries [block_ids_from:]
    num_new_tokens: int
    start_position: int
    needs_sample: bool
    draft_token_ids: tuple[int, ...] = ()


ScheduledChunk = NewRequestData | CachedRequestData


@dataclass(frozen=True)
class StepPlan:
    """One step for the runner, in the scheduler's order."""

    chunks: tuple[ScheduledChunk, ...] = ()
    finished_req_ids: tuple[str, ...] = ()  # rows to drop before anything else
    blocks_to_copy: tuple[tuple[int, int], ...] = ()  # copy-on-write (src, dst)
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()  # (device, host)
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()  # (host, device)
    # LoRA adapters to load into device slots before this step's forward (pagedq/engine/lora/slots.py)
    lora_loads: tuple[tuple[int, LoRAAdapter], ...] = ()

    @property
    def new_requests(self) -> list[NewRequestData]:
        return [c for c in self.chunks if isinstance(c, NewRequestData)]

    @property
    def cached_requests(self) -> list[CachedRequestData]:
        return [c for c in self.chunks if isinstance(c, CachedRequestData)]


@dataclass
class ModelRunnerOutput:
    """Per request id: the draws of a request that reached its last token (several for a fan-out), and the
    prompt log-probability entries this step computed (in prompt order)."""

    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)


def build_plan(
    manager: BlockManager,
    scheduled: Iterable[ScheduledRequest],
    blocks: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]], Sequence[tuple[int, int]]],
    departed: tuple[str, ...],
    lora_loads: tuple[tuple[int, LoRAAdapter], ...] = (),
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
            # Only appended entries, or those changed since (runner_num_blocks was lowered then): every
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
        request.sent_to_runner(num_blocks)
    copies, swap_out, swap_in = blocks
    return StepPlan(tuple(chunks), departed, tuple(copies), tuple(swap_out), tuple(swap_in), lora_loads)


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
        request.lora_slot,
    )
