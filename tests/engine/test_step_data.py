"""The scheduler -> runner hand-off is data only, and a runner that sees nothing but the plans keeps an exact copy."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedq.engine.core.request import Request
from pagedq.engine.core.step_plan import StepPlan
from pagedq.engine.sample.sampling_params import SamplingParams
from pagedq.engine.step.batch_state import BatchState
from tests.engine.helpers import random_traffic

VOCAB = 64


def _reachable_objects(value, seen=None):
    seen = seen if seen is not None else set()
    if id(value) in seen:
        return
    seen.add(id(value))
    yield value
    children = ()
    if isinstance(value, SamplingParams):  # the user's settings, shared read-only by every sequence of a group
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        children = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = value
    for child in children:
        yield from _reachable_objects(child, seen)


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
@pytest.mark.parametrize("seed", range(3))
def test_plans_alone_rebuild_every_scheduled_request(seed, swap):
    """Random traffic with forks, copy-on-write, prefix hits, aborts and both preemption modes: after applying each
    plan, the runner's rows hold exactly the scheduler's tokens and block tables, its penalty masks are the
    prompt tokens, and it holds no request that has left. No `Request` is reachable from a plan, and a plan is a
    snapshot (lists the scheduler later mutates are not shared)."""
    state = BatchState(VOCAB, torch.device("cpu"), capacity=2)
    new = cached = 0
    for scheduler, output in random_traffic(seed, swap, penalties=True):
        if output is None:
            continue
        plan = output.plan
        assert isinstance(plan, StepPlan)
        assert not any(isinstance(o, (Request, list)) for o in _reachable_objects(plan))
        state.apply(plan)
        state.run_device_ops()
        new, cached = new + len(plan.new_requests), cached + len(plan.cached_requests)
        assert set(state.rows) <= {r.request_id for r in scheduler.running}
        for item in output.scheduled:
            request, row = item.request, state.rows[item.request.request_id]
            info = state.info[row]
            assert info.token_ids == request.all_token_ids
            table = scheduler.block_manager.block_table(request.request_id)
            assert state.block_table[row, : state.num_blocks[row]].tolist() == table
            if request.sampling_params.needs_penalties:
                assert state.prompt_mask[row].nonzero().flatten().tolist() == sorted(set(request.prompt_token_ids))
    assert new > 0 and cached > 5 * new  # most of the traffic went as diffs


def test_penalty_state_of_forks_and_resumed_requests_equals_a_lone_run(tiny_llama_dir):
    """Penalty counts of a fork start from its tokens, of a resumed request from everything it generated: under
    preemption, each of n samples with all three penalties equals the same seed run alone, unforked, roomy."""
    from pagedq.engine import LLM, SamplingParams
    from tests.conftest import random_tokens

    prompts = [random_tokens(n, seed=n) for n in (30, 41, 25)]
    params = SamplingParams(
        n=3,
        max_tokens=20,
        temperature=0.8,
        seed=7,
        ignore_eos=True,
        repetition_penalty=1.4,
        presence_penalty=0.7,
        frequency_penalty=0.5,
    )
    tight = LLM(tiny_llama_dir, num_kv_blocks=14, block_size=8, enable_prefix_caching=False)
    outputs = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    roomy = LLM(tiny_llama_dir)
    for prompt, output in zip(prompts, outputs):
        for index, completion in enumerate(output.outputs):
            alone = roomy.generate([prompt], dataclasses.replace(params, n=1, best_of=None, seed=7 + index))
            assert alone[0].outputs[0].token_ids == completion.token_ids
