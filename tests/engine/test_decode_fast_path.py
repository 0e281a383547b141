"""The scheduler's steady-decode fast path (engine/core/decode_fast_path.py) against the general path it shortcuts.

Random traffic (shared prefixes, forks, aborts, priorities, tight pools that preempt by recompute and by swap, prefix
caching on and off, one or two steps in flight) is scheduled twice: with the fast path, and with it switched off so
that every sequence takes Scheduler._allocate_or_preempt and Scheduler._scheduled. Every step must be the same in
both: what is scheduled, the runner's plan, preemptions, block moves, block tables, fill counters, slot
utilization and the prefix cache's hashes.
"""

from __future__ import annotations

import random
import zlib
from collections import deque

import pytest

import pagedq.engine.core.scheduler as scheduler_module
from pagedq.engine import SamplingParams
from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.request import Request, RequestStatus, SampledToken
from pagedq.engine.core.scheduler import Scheduler
from pagedq.engine.core.swap import SwapSpace
from pagedq.engine.step.post_step import advance_sequences

BLOCK = 4


def _snapshot(scheduler: Scheduler, output) -> tuple:
    manager = scheduler.block_manager
    return (
        [(s.request.request_id, s.num_new_tokens, s.start_position, s.needs_sample, s.epoch) for s in output.scheduled],
        output.plan,
        [r.request_id for r in output.preempted],
        output.blocks_to_copy,
        output.blocks_to_swap_out,
        output.blocks_to_swap_in,
        {rid: list(table) for rid, table in manager._block_tables.items()},
        list(manager._fill),
        manager._filled_slots,
        manager.kv_slot_utilization(),
        {rid: list(hashes) for rid, hashes in manager._block_hashes.items()},
        dict(manager._hash_of_block),
        manager.num_free_blocks,
    )


def _traffic(seed: int, swap: bool, prefix_caching: bool, depth: int) -> tuple[list[tuple], dict[str, list[int]]]:
    """Snapshots of every step and every request's final tokens; `depth` steps in flight (2: async scheduling)."""
    rng = random.Random(seed)
    manager = BlockManager(16, BLOCK, enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(manager, 6, 20, swap_space=SwapSpace(16) if swap else None, max_model_len=40)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    requests: list[Request] = []
    in_flight: deque = deque()
    snapshots = []
    step = 0
    while step < 150 or scheduler.has_unfinished() or in_flight:
        if step < 120 and rng.random() < 0.3:
            max_tokens = rng.randint(1, 24)
            params = SamplingParams(max_tokens=max_tokens, n=rng.choice([1, 1, 2]), stop_token_ids=[3])
            prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randint(1, 8))]
            request = Request(f"r{step}", prompt, params, fan_out=params.best_of - 1, priority=rng.randint(-1, 1))
            request.eos_token_ids = (2,)
            scheduler.add_request(request)
            requests.append(request)
        live = [r for r in requests if not r.is_finished]
        if live and rng.random() < 0.04:
            scheduler.finish_request(rng.choice(live), RequestStatus.FINISHED_ABORTED)
        output = scheduler.schedule()
        snapshots.append(_snapshot(scheduler, output))
        if output.scheduled:
            in_flight.append(output)
        if in_flight and (len(in_flight) >= depth or not output.scheduled):
            done = in_flight.popleft()
            # tokens keyed by (request, position): the same in both runs whatever the step they land in
            sampled = {
                s.request.request_id: [
                    SampledToken(2 + zlib.crc32(f"{s.request.request_id}:{s.start_position}:{k}".encode()) % 40)
                    for k in range(1 + s.request.fan_out)
                ]
                for s in done.scheduled
                if s.needs_sample
            }
            advanced = advance_sequences(scheduler, done, sampled, max_model_len=40)
            requests += [r for r in advanced if r not in requests]
        step += 1
        assert step < 3000, "no progress"
    assert manager.num_free_blocks == manager.num_total_blocks
    assert scheduler.num_preemptions > 0
    return snapshots, {r.request_id: r.output_token_ids for r in requests}


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix", "no-prefix"])
@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
@pytest.mark.parametrize("seed", range(4))
def test_fast_path_matches_the_general_path(monkeypatch, seed, swap, prefix_caching, depth):
    real = scheduler_module.schedule_decodes
    taken = [0]

    def counted(running, index, *args):
        reached = real(running, index, *args)
        taken[0] += reached - index
        return reached

    monkeypatch.setattr(scheduler_module, "schedule_decodes", counted)
    fast = _traffic(seed, swap, prefix_caching, depth)
    monkeypatch.setattr(scheduler_module, "schedule_decodes", lambda running, index, *args: index)
    general = _traffic(seed, swap, prefix_caching, depth)
    assert taken[0] > 100  # the fast path did run, for most decode tokens
    assert len(fast[0]) == len(general[0])
    for step, (a, b) in enumerate(zip(fast[0], general[0], strict=True)):
        assert a == b, f"step {step} differs"
    assert fast[1] == general[1]
