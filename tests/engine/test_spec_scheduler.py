"""Speculative drafts in the scheduler and block manager, with no model: a fake runner accepts what it is told."""

from __future__ import annotations

import itertools

from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.request import Request, SampledToken
from pagedq.engine.core.scheduler import Scheduler, SchedulerOutput
from pagedq.engine.sample.sampling_params import SamplingParams
from pagedq.engine.spec_decode.drafts import Speculation
from pagedq.engine.step.post_step import advance_sequences
from tests.engine.helpers import BLOCK, HistoryProposer

_distinct = itertools.count(5000)


class CountingProposer(HistoryProposer):
    """Proposes tokens 100, 101, ... (never what the fake runner draws, 7, unless told to accept)."""

    def propose(self, req_id: str, max_drafts: int) -> list[int]:
        return list(range(100, 100 + max_drafts))


def _setup(num_blocks: int = 64, budget: int = 64, k: int = 3, max_model_len: int = 10_000):
    manager = BlockManager(num_blocks, BLOCK)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_model_len)
    speculation = Speculation(CountingProposer(), k, vocab_size=1000, max_model_len=max_model_len)
    return manager, scheduler, speculation


def _request(request_id: str, prompt_len: int, max_tokens: int = 30) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(request_id, [next(_distinct), *range(1, prompt_len)], params)


def _step(scheduler: Scheduler, speculation: Speculation, accept: int = 0) -> SchedulerOutput:
    """Schedule with drafts; every row 'draws' its first `accept` drafts, then token 7."""
    output = scheduler.schedule(speculation)
    sampled = {
        s.request.request_id: [SampledToken(t) for t in (*s.draft_token_ids[:accept], 7)]
        for s in output.scheduled
        if s.needs_sample
    }
    advance_sequences(scheduler, output, sampled, max_model_len=scheduler.max_model_len)
    return output


def test_a_decode_row_brings_its_drafts_and_the_budget_counts_them():
    _, scheduler, speculation = _setup(budget=3)
    request = _request("a", 3)
    scheduler.add_request(request)
    (prefill,) = _step(scheduler, speculation).scheduled
    assert prefill.draft_token_ids == ()  # a prompt chunk never drafts
    (decode,) = _step(scheduler, speculation).scheduled
    # 3 drafts wanted, 2 fit the budget of 3 next to the last token
    assert decode.draft_token_ids == (100, 101) and decode.num_new_tokens == 3 and decode.start_position == 3


def test_no_drafts_in_a_partial_prefill_chunk():
    _, scheduler, speculation = _setup(budget=5)
    scheduler.add_request(_request("a", 12))
    for _ in range(3):  # chunks of 5, 5, 2
        (item,) = _step(scheduler, speculation).scheduled
        assert item.draft_token_ids == ()
    assert _step(scheduler, speculation).scheduled[0].draft_token_ids == (100, 101, 102)


def test_drafts_never_run_past_max_tokens_or_the_model_length():
    _, scheduler, speculation = _setup(k=4)
    short = _request("short", 4, max_tokens=3)
    scheduler.add_request(short)
    _step(scheduler, speculation)  # the prompt: 1 output
    (item,) = _step(scheduler, speculation).scheduled
    assert len(item.draft_token_ids) == 1  # 1 output so far + 1 token + 1 draft = max_tokens
    _, scheduler, speculation = _setup(k=4, max_model_len=8)
    scheduler.add_request(_request("long", 5))
    _step(scheduler, speculation)
    (item,) = _step(scheduler, speculation).scheduled
    assert len(item.draft_token_ids) == 1  # 6 tokens + the next + 1 draft = max_model_len


def test_lookahead_takes_only_spare_blocks_and_never_preempts():
    manager, scheduler, speculation = _setup(num_blocks=5, k=4)
    a, b = _request("a", 4), _request("b", 4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    _step(scheduler, speculation)  # both prompts: one full block each
    output = _step(scheduler, speculation)
    # a's drafts take a block and leave one for b's next token; b's would take that spare block: b goes without
    assert not output.preempted and [len(s.draft_token_ids) for s in output.scheduled] == [4, 0]
    assert manager.num_free_blocks == 1  # after the step: a rejected every draft, its lookahead block is back


def test_rejected_drafts_roll_back_computed_count_blocks_and_cache():
    manager, scheduler, speculation = _setup(k=3)
    request = _request("a", 6)
    scheduler.add_request(request)
    _step(scheduler, speculation)
    for accept in (0, 1, 3, 2, 0, 3):
        output = _step(scheduler, speculation, accept)
        (item,) = output.scheduled
        assert len(item.draft_token_ids) == 3
        assert request.num_computed_tokens == request.num_tokens - 1  # only final tokens have K/V
        assert len(manager.block_table("a")) == manager.blocks_for_tokens(request.num_computed_tokens)
        assert manager._filled_slots == request.num_computed_tokens
        # hashed blocks: full blocks of final tokens only, in a chain identical to one built without drafts
        hashes = manager._block_hashes["a"]
        assert len(hashes) * BLOCK <= request.num_tokens
        parent = b""
        for index, digest in enumerate(hashes):
            parent = manager._chain_hash(parent, request.all_token_ids[index * BLOCK : (index + 1) * BLOCK])
            assert digest == parent
    assert request.output_token_ids == [7, 7, 100, 7, 100, 101, 102, 7, 100, 101, 7, 7, 100, 101, 102, 7]
    assert speculation.stats()["num_verify_rows"] == 0  # the engine counts (record_step), not the scheduler


def test_a_sequence_that_stops_inside_its_drafts_drops_the_rest():
    _, scheduler, speculation = _setup(k=3)
    request = _request("a", 4, max_tokens=30)
    request.sampling_params.stop_token_ids = [101]
    scheduler.add_request(request)
    _step(scheduler, speculation)
    _step(scheduler, speculation, accept=3)
    assert request.output_token_ids == [7, 100, 101] and request.is_finished and request.stop_reason == 101
