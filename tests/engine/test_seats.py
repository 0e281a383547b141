"""Seat preemption (pagedq/engine/core/seats.py): with no model (a fake runner, as in test_scheduler.py), then on a tiny
checkpoint, where a preempted sequence must resume with exactly the output it has with room to spare."""

from __future__ import annotations

import itertools
import random

import pytest

from pagedq.engine import LLMEngine, RequestOutputKind, SamplingParams
from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.request import Request, RequestStatus
from pagedq.engine.core.scheduler import Scheduler
from pagedq.engine.core.seats import SeatPolicy
from pagedq.engine.core.swap import SwapSpace
from tests.conftest import random_tokens
from tests.engine.helpers import BLOCK, run_step

_distinct = itertools.count(5000)


def _request(name: str, priority: int = 0, prompt_len: int = 5, max_tokens: int = 30) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(name, [next(_distinct), *range(1, prompt_len)], params, priority=priority)


def _scheduler(seats: int, policy: SeatPolicy, swap: bool = False) -> Scheduler:
    return Scheduler(BlockManager(64, BLOCK), seats, 64, swap_space=SwapSpace(32) if swap else None, seat_policy=policy)


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_a_higher_priority_arrival_takes_the_lowest_most_recent_seat_in_the_same_step(swap):
    scheduler = _scheduler(3, SeatPolicy(interval=2, max_count=2), swap)
    old_low, mid, new_low = _request("old_low", 1), _request("mid", 0), _request("new_low", 1)
    for request in (old_low, mid, new_low):
        scheduler.add_request(request)
    for _ in range(3):
        run_step(scheduler)
    urgent = _request("urgent", -5)
    scheduler.add_request(urgent)
    output, _ = run_step(scheduler)
    assert [r.request_id for r in output.preempted] == ["new_low"]
    assert urgent.status is RequestStatus.RUNNING and any(s.request is urgent for s in output.scheduled)
    assert new_low.status is (RequestStatus.SWAPPED if swap else RequestStatus.PREEMPTED)
    assert bool(output.blocks_to_swap_out) is swap
    assert (new_low.num_seat_preemptions, scheduler.num_seat_preemptions, scheduler.num_preemptions) == (1, 1, 1)
    assert [r.request_id for r in scheduler.waiting] == ["new_low"]
    while scheduler.has_unfinished():
        run_step(scheduler)
    assert all(r.num_output_tokens == 30 for r in (old_low, mid, new_low, urgent))
    assert scheduler.block_manager.num_free_blocks == 64


def test_equal_priority_and_a_disabled_policy_never_take_a_seat():
    for policy, priority in ((SeatPolicy(interval=1), 0), (SeatPolicy(interval=0), -5), (SeatPolicy(max_count=0), -5)):
        scheduler = _scheduler(1, policy)
        scheduler.add_request(_request("running"))
        for _ in range(3):
            run_step(scheduler)
        scheduler.add_request(_request("waiting", priority))
        output, _ = run_step(scheduler)
        assert not output.preempted and scheduler.num_waiting == 1


def test_a_seat_taken_recently_is_kept_for_the_interval():
    scheduler = _scheduler(1, SeatPolicy(interval=4, max_count=9))
    scheduler.add_request(_request("bulk"))
    run_step(scheduler)  # admitted at step 1
    scheduler.add_request(_request("urgent", -5))
    steps_waited = 0
    while scheduler.num_seat_preemptions == 0:
        run_step(scheduler)
        steps_waited += 1
    assert steps_waited == 4  # taken at step 5, four steps after it took the seat


def _random_mixed(seed: int, swap: bool, policy: SeatPolicy):
    """Bulk (priority 1) and interactive (priority -1..-3) arrivals at random on a few seats; yields the scheduler
    after every step and records, for each seat preemption, how many steps the victim had held its seat."""
    rng = random.Random(seed)
    scheduler = _scheduler(4, policy, swap)
    requests: list[Request] = []
    held_for: list[int] = []
    for step in range(300):
        if rng.random() < 0.35 and step < 220:
            priority = rng.choice([1, 1, -1, -2, -3])
            request = _request(f"r{step}", priority, rng.randint(2, 9), rng.randint(1, 25))
            scheduler.add_request(request)
            requests.append(request)
        before = {r.request_id: scheduler.num_schedules + 1 - r.seat_since_step for r in scheduler.running}
        output, _ = run_step(scheduler)
        held_for += [before[r.request_id] for r in output.preempted if r.request_id in before]
        yield scheduler, requests, held_for
    while scheduler.has_unfinished():
        run_step(scheduler)
    yield scheduler, requests, held_for


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
@pytest.mark.parametrize("seed", range(3))
def test_the_bound_holds_over_random_traffic(seed, swap):
    """Every victim held its seat for at least `interval` steps, none loses it more than `max_count` times, and
    every request still gets all its tokens."""
    policy = SeatPolicy(interval=3, max_count=2)
    for state in _random_mixed(seed, swap, policy):
        assert all(r.num_seat_preemptions <= policy.max_count for r in state[1])
    scheduler, requests, held_for = state
    assert scheduler.num_seat_preemptions > 0 and held_for and min(held_for) >= policy.interval
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in requests)
    assert scheduler.block_manager.num_free_blocks == 64


def test_bad_policies_are_named():
    for kwargs in ({"interval": -1}, {"max_count": 10**9}, {"interval": 1.5}, {"interval": True}):
        with pytest.raises(ValueError, match="seat preemption"):
            SeatPolicy(**kwargs)


def _run(engine: LLMEngine, bulk: list[list[int]], urgent: list[list[int]], params: SamplingParams) -> dict:
    """Bulk requests first; the urgent ones (priority -5) arrive while the bulk ones decode."""
    for i, prompt in enumerate(bulk):
        engine.add_request(f"bulk{i}", prompt, params, priority=1)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests() or steps < 12:
        steps += 1
        if steps in (6, 9) and urgent:
            engine.add_request(f"urgent{steps}", urgent.pop(), params, priority=-5)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_seat_preempted_sequences_resume_with_identical_output(tiny_llama_dir, mode, temperature):
    params = SamplingParams(
        max_tokens=20, temperature=temperature, seed=11, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    bulk = [random_tokens(6 + 3 * i, seed=i) for i in range(3)]
    urgent = [random_tokens(5, seed=40), random_tokens(9, seed=41)]
    common = dict(num_kv_blocks=64, block_size=4, preemption_mode=mode, swap_space_gib=0.01)
    roomy = LLMEngine(tiny_llama_dir, max_num_seqs=8, **common)
    expected = _run(roomy, bulk, list(urgent), params)
    tight = LLMEngine(tiny_llama_dir, max_num_seqs=3, seat_preemption_interval=2, **common)
    got = _run(tight, bulk, list(urgent), params)
    assert roomy.stats()["num_seat_preemptions"] == 0
    assert tight.stats()["num_seat_preemptions"] >= 2
    assert got == expected and len(got) == 5
