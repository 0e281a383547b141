"""Helpers shared by the engine tests (test modules import them from here, never from one another)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from pagedq.engine import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.request import Request, RequestStatus, SampledToken
from pagedq.engine.core.scheduler import Scheduler, SchedulerOutput
from pagedq.engine.core.swap import SwapSpace
from pagedq.engine.step.post_step import advance_sequences
from tests.conftest import random_tokens

BLOCK = 4  # the block size of the scheduler tests' pools


def run_step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, set[str]]:
    output = scheduler.schedule()
    sampled = {s.request.request_id: [SampledToken(token)] for s in output.scheduled if s.needs_sample}
    finished_before = {r.request_id for r in scheduler.running}
    advance_sequences(scheduler, output, sampled, max_model_len=10_000)
    return output, finished_before


def random_traffic(
    seed: int, swap: bool, penalties: bool = False
) -> Iterator[tuple[Scheduler, SchedulerOutput | None]]:
    """Random arrivals, shared prefixes, forks, aborts and preemptions, driven by a fake runner; yields
    (scheduler, output) after each schedule and (scheduler, None) after each step of the final drain."""
    rng = random.Random(seed)
    manager = BlockManager(24, BLOCK)
    swap_space = SwapSpace(16) if swap else None
    scheduler = Scheduler(manager, max_num_seqs=6, max_num_batched_tokens=20, swap_space=swap_space)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    live: list[Request] = []
    for step in range(200):
        if rng.random() < 0.3 and step < 150:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randint(1, 8))]
            max_tokens = rng.randint(1, 20)
            params = SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=True,
                n=rng.choice([1, 1, 2, 3]),
                repetition_penalty=rng.choice([1.0, 1.3]) if penalties else 1.0,
                min_tokens=min(max_tokens, rng.choice([0, 2])) if penalties else 0,
                stop_token_ids=[3],
            )
            request = Request(
                f"r{step}", prompt, params, fan_out=params.best_of - 1, priority=rng.randint(-1, 1), eos_token_ids=(2,)
            )
            scheduler.add_request(request)
            live.append(request)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            if not victim.is_finished:
                scheduler.finish_request(victim, RequestStatus.FINISHED_ABORTED)
        output = scheduler.schedule()
        yield scheduler, output
        sampled = {
            s.request.request_id: [SampledToken(rng.randrange(4, 50)) for _ in range(1 + s.request.fan_out)]
            for s in output.scheduled
            if s.needs_sample
        }
        advanced = advance_sequences(scheduler, output, sampled, max_model_len=10_000)
        live += [r for r in advanced if r not in live]
    while scheduler.has_unfinished():
        run_step(scheduler)
        yield scheduler, None


def random_engine_traffic(seed: int) -> list[tuple]:
    """Generation (n, best_of, seeds, penalties, stop ids, logit bias) and beam requests with priorities, arriving
    over time."""
    rng = random.Random(seed)
    bias_rng = random.Random(-seed)  # its own stream: the rest of the traffic stays what it was
    prefixes = [random_tokens(rng.randint(4, 30), seed=seed * 10 + i) for i in range(3)]
    requests = []
    for i in range(rng.randint(6, 14)):
        shared = rng.choice(prefixes) if rng.random() < 0.6 else []
        prompt = shared + random_tokens(rng.randint(1, 12), seed=seed * 100 + i)
        arrival, priority = rng.randint(0, 25), rng.randint(-1, 1)
        if rng.random() < 0.2:
            params = BeamSearchParams(
                beam_width=rng.choice([2, 3]), max_tokens=rng.randint(3, 12), ignore_eos=rng.random() < 0.5
            )
            requests.append(("beam", f"b{i}", prompt, params, arrival, priority))
            continue
        n = rng.choice([1, 1, 2, 3])
        params = SamplingParams(
            n=n,
            best_of=n + rng.choice([0, 0, 1]),
            max_tokens=rng.randint(2, 16),
            min_tokens=rng.choice([0, 2]),
            temperature=rng.choice([0.0, 0.8]),
            top_k=rng.choice([-1, 10]),
            top_p=rng.choice([1.0, 0.9]),
            seed=rng.randrange(1000),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=rng.choice([[], [7, 9]]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            output_kind=RequestOutputKind.FINAL_ONLY,
            logit_bias=bias_rng.choice(
                [None, None, {bias_rng.randrange(3, 500): bias_rng.choice([-100.0, 4.0, 100.0])}]
            ),
        )
        requests.append(("generate", f"g{i}", prompt, params, arrival, priority))
    return requests


def stop_cut_after_min_tokens(text: str, prefix_text: str, stop: str) -> str:
    """vLLM's rule: the first occurrence of `stop` that ends past the text of the first min_tokens tokens."""
    at = text.find(stop, max(0, len(prefix_text) - len(stop) + 1))
    assert at != -1, f"{stop!r} does not recur in {text!r} after {prefix_text!r}"
    return text[:at]


# Pools small enough that random mixed traffic is preempted (recompute or swap), with and without the prefix cache:
# the differential tests (async vs sync, tight vs roomy) run in each.
TIGHT_POOLS: dict[str, dict[str, Any]] = {
    "recompute": dict(num_kv_blocks=24, max_num_batched_tokens=16),
    "swap": dict(num_kv_blocks=24, max_num_batched_tokens=16, preemption_mode="swap", swap_space_gib=0.001),
    "no-prefix-cache": dict(num_kv_blocks=34, max_num_batched_tokens=24, enable_prefix_caching=False, max_num_seqs=8),
}


class HistoryProposer:
    """A speculative proposer's bookkeeping (pagedq/engine/spec_decode Proposer): each request's history, kept as the
    engine feeds it; subclasses say what to propose from it."""

    def __init__(self) -> None:
        self.histories: dict[str, list[int]] = {}

    def add_request(self, req_id: str, token_ids: Sequence[int]) -> None:
        assert req_id not in self.histories, f"{req_id} added twice"
        self.histories[req_id] = list(token_ids)

    def append(self, req_id: str, token_ids: Sequence[int]) -> None:
        self.histories[req_id] += token_ids

    def fork(self, parent_id: str, child_id: str) -> None:
        self.histories[child_id] = list(self.histories[parent_id])

    def remove(self, req_id: str) -> None:
        del self.histories[req_id]

    def propose(self, req_id: str, max_drafts: int) -> list[int]:
        raise NotImplementedError
