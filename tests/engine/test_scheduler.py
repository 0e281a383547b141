"""Block manager and scheduler with no model: a fake runner 'samples' a fixed token for whoever needs one."""

from __future__ import annotations

import itertools

import pytest

from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.request import Request, RequestStatus, SampledToken
from pagedq.engine.core.scheduler import Scheduler
from pagedq.engine.core.swap import SwapSpace
from pagedq.engine.sample.sampling_params import SamplingParams
from pagedq.engine.step.post_step import advance_sequences
from tests.engine.helpers import BLOCK, random_traffic, run_step

_distinct = itertools.count(1000)


def make_request(request_id: str, prompt_len: int, max_tokens: int = 8, priority: int = 0) -> Request:
    """Prompts start with a token of their own, so no two share a cached prefix by accident."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(request_id, [next(_distinct), *list(range(1, prompt_len))], params, priority=priority)


def test_blocks_are_allocated_only_when_the_last_one_is_full():
    manager = BlockManager(num_blocks=10, block_size=BLOCK)
    assert manager.allocate_slots("a", 0, 5) == []
    assert len(manager.block_table("a")) == 2 and manager.num_free_blocks == 8
    for total in (6, 7, 8):  # still inside the second block
        assert manager.allocate_slots("a", total - 1, total) == []
        assert len(manager.block_table("a")) == 2
    assert manager.allocate_slots("a", 8, 9) == []
    assert len(manager.block_table("a")) == 3
    assert manager.kv_slot_utilization() == pytest.approx(9 / 12)
    manager.free("a")
    assert manager.num_free_blocks == 10 and manager.block_table("a") == []


def test_failed_allocation_changes_nothing():
    manager = BlockManager(num_blocks=3, block_size=BLOCK)
    assert manager.allocate_slots("a", 0, 8) == []
    assert manager.allocate_slots("b", 0, 8) is None
    assert manager.num_free_blocks == 1 and manager.block_table("b") == []


def test_a_growing_request_takes_the_next_free_block():
    # (the cache slots are derived from this table in pagedq/engine/step/step_inputs.py; the parity tests cover them)
    manager = BlockManager(num_blocks=6, block_size=BLOCK)
    manager.allocate_slots("x", 0, 4)
    manager.allocate_slots("y", 0, 4)
    manager.allocate_slots("x", 4, 6)
    assert manager.block_table("x") == [0, 2] and manager.block_table("y") == [1]


def test_chunked_prefill_samples_only_on_the_last_chunk():
    scheduler = Scheduler(BlockManager(64, BLOCK), max_num_seqs=4, max_num_batched_tokens=6)
    request = make_request("a", prompt_len=14)
    scheduler.add_request(request)
    chunks = []
    while request.num_output_tokens == 0:
        output, _ = run_step(scheduler)
        (item,) = output.scheduled
        chunks.append((item.num_new_tokens, item.needs_sample))
    assert chunks == [(6, False), (6, False), (2, True)]
    output, _ = run_step(scheduler)
    assert [(s.num_new_tokens, s.start_position) for s in output.scheduled] == [(1, 14)]


def test_budget_mixes_decodes_and_prefill_chunks():
    scheduler = Scheduler(BlockManager(64, BLOCK), max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", prompt_len=3))
    run_step(scheduler)  # a prefilled, now decoding
    scheduler.add_request(make_request("b", prompt_len=20))
    output, _ = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 1), ("b", 7)]
    assert output.num_batched_tokens == 8


def test_max_num_seqs_caps_the_running_set():
    scheduler = Scheduler(BlockManager(64, BLOCK), max_num_seqs=2, max_num_batched_tokens=100)
    for name in "abc":
        scheduler.add_request(make_request(name, prompt_len=2))
    output, _ = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["a", "b"]
    assert scheduler.num_waiting == 1


def test_finished_requests_free_their_blocks():
    manager = BlockManager(16, BLOCK)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    requests = [make_request(str(i), prompt_len=5, max_tokens=3) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished():
        run_step(scheduler)
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3 for r in requests)
    assert manager.num_free_blocks == 16


def test_abort_of_running_and_waiting_requests_leaks_nothing():
    manager = BlockManager(16, BLOCK)
    scheduler = Scheduler(manager, max_num_seqs=1, max_num_batched_tokens=64)
    running, waiting = make_request("r", prompt_len=9), make_request("w", prompt_len=3)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler)
    assert running.status is RequestStatus.RUNNING and manager.num_free_blocks == 13
    scheduler.finish_request(running, RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request(waiting, RequestStatus.FINISHED_ABORTED)
    assert manager.num_free_blocks == 16 and not scheduler.has_unfinished()


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first():
    manager = BlockManager(6, BLOCK)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    first, second, third = (make_request(n, prompt_len=8, max_tokens=8) for n in ("first", "second", "third"))
    for request in (first, second, third):
        scheduler.add_request(request)
    run_step(scheduler)  # all three prefilled: 2 blocks each, pool empty
    assert manager.num_free_blocks == 0
    late = make_request("late", prompt_len=2)
    scheduler.add_request(late)
    output, _ = run_step(scheduler)  # first needs a 3rd block: third (last admitted) is preempted
    assert [r.request_id for r in output.preempted] == ["third"]
    assert third.status is RequestStatus.PREEMPTED and third.num_computed_tokens == 0
    assert [r.request_id for r in scheduler.waiting] == ["third", "late"]  # ahead of the new arrival
    assert not any(s.request is late for s in output.scheduled)  # nobody is admitted in a preempting step


def test_waiting_queue_admits_the_lowest_priority_value_first():
    """vLLM's sense: a lower value is served sooner."""
    scheduler = Scheduler(BlockManager(16, BLOCK), max_num_seqs=1, max_num_batched_tokens=64)
    for name, priority in (("low", 1), ("mid", 0), ("high", -5), ("mid2", 0)):
        scheduler.add_request(make_request(name, 2, priority=priority))
    assert [r.request_id for r in scheduler.waiting] == ["high", "mid", "mid2", "low"]


def test_lower_priority_is_preempted_before_a_later_higher_priority_one():
    manager = BlockManager(4, BLOCK)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    low, high = make_request("low", 4, priority=1), make_request("high", 4, priority=-5)
    scheduler.add_request(low)
    run_step(scheduler)
    scheduler.add_request(high)
    run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["low", "high"]  # high is the most recent
    preempted = []
    while not preempted:
        output, _ = run_step(scheduler)
        preempted = output.preempted
    assert [r.request_id for r in preempted] == ["low"]


def test_the_lowest_priority_value_runs_first_and_is_preempted_last():
    """vLLM's sense end to end in the scheduler: of three arrivals on a pool too small for all, the lowest value is
    admitted first and never preempted, the highest is the first victim, and they finish in priority order."""
    manager = BlockManager(5, BLOCK, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=3, max_num_batched_tokens=64)
    requests = [
        make_request(name, 4, max_tokens=8, priority=p) for name, p in (("bulk", 5), ("mid", 0), ("urgent", -5))
    ]
    for request in requests:  # arrival order: the least urgent first
        scheduler.add_request(request)
    output, _ = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["urgent", "mid", "bulk"]  # admitted in that order
    preempted: list[str] = []
    finished: list[str] = []
    while scheduler.has_unfinished():
        output, _ = run_step(scheduler)
        preempted += [r.request_id for r in output.preempted]
        finished += [r.request_id for r in requests if r.is_finished and r.request_id not in finished]
    assert preempted == ["bulk", "mid"]  # the pool runs dry twice: the highest value goes first, urgent never
    assert finished == ["urgent", "mid", "bulk"]


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_a_victim_scheduled_earlier_in_the_step_leaves_the_step(swap):
    """low (admitted first) is scheduled, then high needs a block and low, the lowest priority, is preempted:
    low's token must leave the step, else the model would write it into blocks high now owns."""
    manager = BlockManager(3, BLOCK, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, swap_space=SwapSpace(8) if swap else None)
    low, high = make_request("low", 5, priority=1), make_request("high", 4, priority=-5)
    scheduler.add_request(low)
    run_step(scheduler)  # low: 5 prompt tokens computed in 2 blocks, 1 output
    scheduler.add_request(high)
    run_step(scheduler)  # high: 4 prompt tokens in the last free block, 1 output; low: 1 more output
    assert [r.request_id for r in scheduler.running] == ["low", "high"] and manager.num_free_blocks == 0
    output = scheduler.schedule()  # low's next token fits its block; high's needs a block: low must go
    assert [r.request_id for r in output.preempted] == ["low"]
    assert [s.request.request_id for s in output.scheduled] == ["high"]
    assert output.num_batched_tokens == 1 and output.blocks_to_copy == []
    assert low.status is RequestStatus.PREEMPTED and low.num_computed_tokens == 0  # never swapped: recomputed
    assert output.blocks_to_swap_out == []
    advance_sequences(scheduler, output, {"high": [SampledToken(7)]}, max_model_len=10_000)
    assert low.num_output_tokens == 2 and high.num_output_tokens == 2  # low got nothing from this step
    _check_block_invariants(manager)


def test_preempted_request_resumes_and_recomputes_its_outputs():
    manager = BlockManager(5, BLOCK, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_request("a", 7, max_tokens=6), make_request("b", 7, max_tokens=6)
    scheduler.add_request(a)
    scheduler.add_request(b)
    recomputed = []
    while scheduler.has_unfinished():
        output, _ = run_step(scheduler)
        recomputed += [s.num_new_tokens for s in output.scheduled if s.request is b and s.start_position == 0]
    assert b.num_preemptions >= 1
    assert len(recomputed) >= 2 and recomputed[-1] > 7  # re-admitted with prompt + earlier outputs
    assert a.num_output_tokens == b.num_output_tokens == 6
    assert manager.num_free_blocks == 5


def _check_block_invariants(manager: BlockManager) -> None:
    tables = manager._block_tables.values()
    counts: dict[int, int] = {}
    for table in tables:
        for block_id in table:
            counts[block_id] = counts.get(block_id, 0) + 1
    assert all(manager.ref_count(b) == n for b, n in counts.items()), "ref counts disagree with the tables"
    assert manager.num_used_blocks == len(counts), "a block in use is in no table, or a free one in a table"
    assert manager.num_free_blocks + manager.num_used_blocks == manager.num_total_blocks


def _check_step(manager: BlockManager, output) -> None:
    """Everything a step will run is still running and owns every block its tokens are written to."""
    for item in output.scheduled:
        assert item.request.status is RequestStatus.RUNNING, f"{item.request.request_id} scheduled but preempted"
        end = manager.blocks_for_tokens(item.start_position + item.num_new_tokens)
        assert all(manager.ref_count(b) > 0 for b in manager.block_table(item.request.request_id)[:end])
    targets = [dst for _, dst in output.blocks_to_copy]
    assert all(manager.ref_count(b) > 0 for b in targets), "a copy-on-write target was freed"


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_the_pool_consistent(seed, swap):
    """After every step the reference counts match the tables exactly, and when everything is done every block
    is free again."""
    for scheduler, output in random_traffic(seed, swap):
        manager = scheduler.block_manager
        if output is not None:
            _check_step(manager, output)
        _check_block_invariants(manager)
    swap_space = scheduler.swap_space
    assert manager.num_free_blocks == manager.num_total_blocks
    assert scheduler.num_preemptions > 0
    if swap:
        assert swap_space is not None
        assert swap_space.num_swapped_out > 0 and swap_space.num_free_blocks == swap_space.num_total_blocks
