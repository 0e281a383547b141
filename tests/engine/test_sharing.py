"""Memory sharing in the paged cache: forked samples, copy-on-write, prefix caching, swap preemption."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pagedq.engine import LLM, LLMEngine, RequestOutputKind, SamplingParams
from pagedq.engine.core.block_manager import BlockManager
from tests.conftest import random_tokens as _tokens
from tests.engine.helpers import TIGHT_POOLS, random_engine_traffic


# ---- block manager ----------------------------------------------------------------------------
def test_fork_shares_blocks_and_the_first_write_copies_the_partial_one():
    manager = BlockManager(10, 4)
    manager.allocate_slots("p", 0, 6)  # blocks [0, 1], the second half full
    manager.fork("p", "c")
    assert manager.block_table("c") == [0, 1] and manager.ref_count(1) == 2 and manager.num_used_blocks == 2
    copies = manager.allocate_slots("c", 6, 7)  # c writes position 6, inside shared block 1
    assert copies == [(1, 2)] and manager.block_table("c") == [0, 2]
    assert manager.ref_count(1) == 1 and manager.ref_count(0) == 2
    assert manager.allocate_slots("p", 6, 7) == []  # p owns block 1 alone now: no copy
    manager.free("p")
    manager.free("c")
    assert manager.num_free_blocks == 10


def test_prefix_cache_reuses_full_blocks_until_the_pool_needs_them():
    manager = BlockManager(4, 4)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2
    assert manager.match_prefix("a", prompt) == 0
    manager.allocate_slots("a", 0, 10)
    manager.cache_full_blocks("a", prompt, 10)
    a_table = manager.block_table("a")
    manager.free("a")
    assert manager.num_free_blocks == 4  # cached blocks count as free
    assert manager.match_prefix("b", [*prompt, 7]) == 8
    assert manager.block_table("b") == a_table[:2] and manager.num_free_blocks == 2
    manager.free("b")
    manager.allocate_slots("x", 0, 16)  # needs all 4 blocks: the cached ones are evicted
    manager.free("x")
    assert manager.match_prefix("c", prompt) == 0


def _take_one_block_at_a_time(manager: BlockManager, request_id: str, count: int) -> list[int]:
    """The blocks the pool hands out, in order, to a request that grows by one block per call."""
    size = manager.block_size
    for i in range(count):
        assert manager.allocate_slots(request_id, i * size, (i + 1) * size) == []
    return manager.block_table(request_id)


def test_prefix_cache_evicts_blocks_in_least_recently_used_order():
    """Which cached block goes first follows the access order, block by block, tail before head."""
    manager = BlockManager(6, 4)
    prompts = {name: list(range(100 * i, 100 * i + 8)) for i, name in enumerate("abc", 1)}  # 2 full blocks each
    head, tail = {}, {}
    for name, prompt in prompts.items():  # a, then b, then c: computed, cached, freed
        manager.allocate_slots(name, 0, 8)
        manager.cache_full_blocks(name, prompt, 8)
        head[name], tail[name] = manager.block_table(name)
        manager.free(name)
    assert manager.match_prefix("a again", prompts["a"] + [7]) == 8  # a is used again, both blocks
    manager.free("a again")
    assert manager.match_prefix("b head", [*prompts["b"][:4], 7]) == 4  # only b's first block is used again
    manager.free("b head")
    # Last uses, oldest first: b's tail (b's first round), c (freed tail first), a (again, tail first), b's head.
    expected = [tail["b"], tail["c"], head["c"], tail["a"], head["a"], head["b"]]
    assert manager.num_free_blocks == 6 and sorted(expected) == list(range(6))  # every block cached, none free
    assert _take_one_block_at_a_time(manager, "x", 6) == expected
    manager.free("x")
    assert all(manager.match_prefix(f"{name} later", prompt) == 0 for name, prompt in prompts.items())


def test_match_leaves_one_token_to_compute():
    manager = BlockManager(8, 4)
    prompt = list(range(8))
    manager.allocate_slots("a", 0, 8)
    manager.cache_full_blocks("a", prompt, 8)
    assert manager.match_prefix("b", prompt) == 4  # not 8: the last token's logits are needed


# ---- parallel sampling ------------------------------------------------------------------------------
def test_n4_shares_the_prompt_and_each_sample_equals_its_seed_alone(tiny_llama_dir):
    prompt = _tokens(200, seed=1)
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=100, ignore_eos=True)
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=64, block_size=16, enable_prefix_caching=False)
    engine.add_request("g", prompt, dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
    while engine.num_running_requests < 4:
        engine.step()  # prefill 200 tokens (13 blocks) once, then fork into four samples
    assert engine.num_total_blocks - engine.num_free_blocks == 13
    engine.step()  # each sample writes position 200 into the shared partial block: three copies
    assert engine.num_total_blocks - engine.num_free_blocks == 16
    assert engine.stats()["blocks_saved_by_sharing"] == 4 * 13 - 16
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert engine.num_free_blocks == 64
    samples = [c.token_ids for c in final.outputs]
    assert len(samples) == 4 and len({tuple(s) for s in samples}) == 4

    llm = LLM(tiny_llama_dir, num_kv_blocks=64, block_size=16)
    for index, sample in enumerate(samples):
        alone = llm.generate([prompt], dataclasses.replace(params, n=1, best_of=None, seed=100 + index))
        assert alone[0].outputs[0].token_ids == sample


def test_fan_out_groups_fit_max_num_seqs_and_each_sample_equals_its_seed_alone(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=128, block_size=16, max_num_seqs=8)
    seeds = [100, 200, 300, 400]
    prompts = [_tokens(20 + 5 * g, seed=10 + g) for g in range(len(seeds))]
    params = [
        SamplingParams(
            n=4, max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        for seed in seeds
    ]
    for group, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"g{group}", prompt, p)
    schedule, sizes = engine.scheduler.schedule, []

    def recording_schedule():
        scheduled = schedule()
        sizes.append(len(scheduled.scheduled))
        return scheduled

    engine.scheduler.schedule = recording_schedule
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        assert engine.num_running_requests <= 8  # forks included
    assert max(sizes) == 8 and all(size <= 8 for size in sizes), sizes

    llm = LLM(tiny_llama_dir, num_kv_blocks=64, block_size=16)
    for group, (prompt, p) in enumerate(zip(prompts, params)):
        samples = [c.token_ids for c in finals[f"g{group}"].outputs]
        alone = [
            llm.generate([prompt], dataclasses.replace(p, n=1, best_of=None, seed=p.seed + index))[0]
            .outputs[0]
            .token_ids
            for index in range(4)
        ]
        assert samples == alone


WAVES = [dict(n=12), dict(n=3, best_of=12), dict(n=12, structured_outputs={"regex": "[a-z]{2,5}( [a-z]{2,5})*"})]


@pytest.mark.parametrize("fan_out", WAVES, ids=["n", "best_of", "structured"])
def test_samples_past_max_num_seqs_wait_in_waves_and_equal_a_roomy_engines(tiny_llama_dir, fan_out):
    """pass@k sends n past max_num_seqs: the samples that find no seat wait (vLLM queues them too), in waves of
    max_num_seqs forked from their own prefill, the prompt's full blocks shared through the prefix cache. Each sample
    is the one an engine with seats for all of them draws."""
    prompt = _tokens(40, seed=5)  # two full blocks of 16 and 8 tokens
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, **fan_out)
    roomy = LLM(tiny_llama_dir, num_kv_blocks=64, block_size=16, max_num_seqs=16)
    expected = roomy.generate([prompt], params)[0].outputs
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=64, block_size=16, max_num_seqs=4)
    engine.add_request("g", prompt, dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
    final, running = None, []
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
        running.append(engine.num_running_requests)
    assert max(running) == 4 and engine.num_free_blocks == 64
    assert [(c.index, c.token_ids) for c in final.outputs] == [(c.index, c.token_ids) for c in expected]
    assert len(final.outputs) == params.n and len({tuple(c.token_ids) for c in final.outputs}) > 1
    # three waves prefill the prompt: the first in full, the others only past its cached full blocks
    assert engine.stats()["num_prefilled_tokens"] == 40 + 2 * (40 - 32)
    assert roomy.stats()["num_prefilled_tokens"] == 40


def test_pass_at_k_takes_n_200_through_generate(tiny_llama_dir):
    """As vLLM: n in the hundreds (pass@k), past max_num_seqs; sample i is the one seed + i draws alone."""
    prompt = _tokens(10, seed=8)
    params = SamplingParams(n=200, max_tokens=3, temperature=1.0, seed=3, ignore_eos=True)
    llm = LLM(tiny_llama_dir, num_kv_blocks=160, max_num_seqs=64)
    samples = llm.generate([prompt], params)[0].outputs
    assert [c.index for c in samples] == list(range(200)) and all(len(c.token_ids) == 3 for c in samples)
    for index in (0, 63, 64, 199):  # the first and last of the first wave, the first of the next, the very last
        alone = llm.generate([prompt], dataclasses.replace(params, n=1, best_of=None, seed=3 + index))[0]
        assert alone.outputs[0].token_ids == samples[index].token_ids


def test_greedy_samples_past_max_num_seqs_equal_transformers(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.engine.parity import assert_greedy_parity

    prompt = _tokens(20, seed=6)
    llm = LLM(tiny_llama_dir, num_kv_blocks=32, max_num_seqs=2, enable_prefix_caching=False)
    outputs = llm.generate([prompt], SamplingParams(n=5, max_tokens=10, temperature=0.0, ignore_eos=True))[0].outputs
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    reference = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    theirs, logits = reference.sequences[0, len(prompt) :].tolist(), [step[0] for step in reference.logits]
    assert len(outputs) == 5
    for sample in outputs:
        assert assert_greedy_parity(sample.token_ids, theirs, logits) == 0


def test_best_of_returns_the_most_likely_samples(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kv_blocks=64)
    prompt = _tokens(20, seed=2)
    params = SamplingParams(n=2, best_of=5, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    out = llm.generate([prompt], params)[0].outputs
    singles = [
        llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i, ignore_eos=True, logprobs=0))[
            0
        ].outputs[0]
        for i in range(5)
    ]
    ranked = sorted(singles, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out] == [c.token_ids for c in ranked]
    assert [c.cumulative_logprob for c in out] == pytest.approx([c.cumulative_logprob for c in ranked], abs=1e-4)


# ---- prefix caching ---------------------------------------------------------------------------------
def test_shared_system_prompt_is_prefilled_once(tiny_llama_dir):
    system = _tokens(100, seed=3)
    prompts = [system + _tokens(10, seed=10 + i) for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cached = LLM(tiny_llama_dir, num_kv_blocks=64, block_size=16)
    uncached = LLM(tiny_llama_dir, num_kv_blocks=64, block_size=16, enable_prefix_caching=False)
    with_cache = cached.generate(prompts, params)
    without = uncached.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in with_cache] == [o.outputs[0].token_ids for o in without]
    # decodes are not prefill; 6 full blocks (96 tokens) of the system prompt are computed once
    assert uncached.stats()["num_prefilled_tokens"] == 4 * 110
    assert cached.stats()["num_prefilled_tokens"] == 110 + 3 * (110 - 96)
    assert cached.stats()["prefix_cache_hit_rate"] == pytest.approx(3 * 96 / 440)
    # vLLM's RequestOutput.num_cached_tokens: the first computes the system prompt, the other three hit its 6 blocks
    assert [o.num_cached_tokens for o in with_cache] == [0, 96, 96, 96]
    assert [o.num_cached_tokens for o in without] == [0, 0, 0, 0]
    again = cached.generate([prompts[1], [*system, 7]], params)  # all 6 full blocks (96 tokens) are cached now
    assert [o.num_cached_tokens for o in again] == [96, 96]


def test_eviction_under_pressure_keeps_outputs_exact(tiny_llama_dir):
    prefixes = [_tokens(40, seed=20 + i) for i in range(3)]
    prompts = [prefixes[i % 3] + _tokens(5 + i, seed=40 + i) for i in range(9)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reference = LLM(tiny_llama_dir, enable_prefix_caching=False).generate(prompts, params)
    tight = LLM(tiny_llama_dir, num_kv_blocks=10, block_size=16, max_num_batched_tokens=48)
    outputs = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0 and tight.stats()["prefix_cache_hit_rate"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]


# ---- preemption modes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_modes_match_an_unpressured_run(tiny_llama_dir, mode):
    prompts = [_tokens(n, seed=n) for n in (7, 19, 33, 45, 12)]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
    reference = LLM(tiny_llama_dir).generate(prompts, params)
    tight = LLM(
        tiny_llama_dir,
        num_kv_blocks=8,
        block_size=16,
        preemption_mode=mode,
        swap_space_gib=0.01,
        enable_prefix_caching=False,
    )
    outputs = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    swap = tight.llm_engine.scheduler.swap_space
    if mode == "swap":
        assert swap.num_swapped_out > 0 and swap.num_swapped_in == swap.num_swapped_out
        assert swap.num_free_blocks == swap.num_total_blocks
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]


def test_a_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(tiny_llama_dir, monkeypatch):
    prompt = _tokens(70, seed=60)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = LLM(tiny_llama_dir, enable_prefix_caching=False).generate([prompt], params)[0].outputs[0].token_ids
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=32, block_size=16)
    runner = engine.model_runner
    real_device_work = runner._device_work

    def failing_device_work(step):
        raise RuntimeError("device error")

    monkeypatch.setattr(runner, "_device_work", failing_device_work)
    engine.add_request("doomed", prompt, params)
    with pytest.raises(RuntimeError, match="device error"):
        for _ in range(engine._pipeline_depth):  # async: the error surfaces when the step is finished, a call later
            engine.step()  # scheduled (and cached) 4 full blocks that were never written
    assert engine.num_free_blocks == 32 and engine.num_waiting_requests == 1  # back to be recomputed
    monkeypatch.setattr(runner, "_device_work", real_device_work)
    engine.add_request("again", prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["doomed"].outputs[0].token_ids == expected  # the retried request recovers
    assert finals["again"].outputs[0].token_ids == expected


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_mixed_sharing_workload_under_pressure_matches_a_roomy_run(tiny_llama_dir, mode):
    """Forked samples, shared prefixes, greedy and seeded rows together in a pool that forces preemption."""
    rng = random.Random(77)
    prefixes = [_tokens(35, seed=80), _tokens(20, seed=81)]
    prompts, params = [], []
    for i in range(10):
        prompts.append(rng.choice(prefixes) + _tokens(rng.randint(1, 12), seed=90 + i))
        params.append(
            SamplingParams(
                n=rng.choice([1, 2, 3]),
                max_tokens=rng.randint(5, 20),
                ignore_eos=True,
                temperature=rng.choice([0.0, 0.9]),
                top_k=rng.choice([-1, 20]),
                seed=i,
            )
        )
    roomy = LLM(tiny_llama_dir, enable_prefix_caching=False).generate(prompts, params)
    tight = LLM(
        tiny_llama_dir,
        num_kv_blocks=12,
        block_size=16,
        max_num_batched_tokens=32,
        preemption_mode=mode,
        swap_space_gib=0.01,
    )
    outputs = tight.generate(prompts, params)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    assert tight.llm_engine.num_free_blocks == 12
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in roomy]


def _run_with_arrivals(model_dir: str, seed: int, **engine_kwargs) -> tuple[dict[str, list[int]], int]:
    """Requests of mixed priorities arriving over the first steps; every request's final tokens."""
    rng = random.Random(seed)
    engine = LLMEngine(model_dir, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False, **engine_kwargs)
    finals: dict[str, list[int]] = {}
    for step in range(1000):
        if step < 60 and rng.random() < 0.3:
            params = SamplingParams(
                max_tokens=rng.randint(4, 16),
                temperature=0.0,
                ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            engine.add_request(
                f"r{step}", _tokens(rng.randint(2, 9), seed=1000 + step), params, priority=rng.randint(-2, 2)
            )
        finals.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
        if step >= 60 and not engine.has_unfinished_requests():
            break
    return finals, engine.scheduler.num_preemptions


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_priorities_under_pressure_keep_outputs_exact(tiny_llama_dir, mode):
    """A high-priority arrival preempts lower-priority requests that may already be in the step being built."""
    total_preemptions = 0
    for seed in range(6):
        roomy, _ = _run_with_arrivals(tiny_llama_dir, seed, num_kv_blocks=400)
        tight, preemptions = _run_with_arrivals(
            tiny_llama_dir, seed, num_kv_blocks=12, preemption_mode=mode, swap_space_gib=0.01
        )
        assert tight == roomy, f"seed {seed}"
        total_preemptions += preemptions
    assert total_preemptions >= 10


def _serve(model_dir: str, requests: list[tuple], **engine_kwargs) -> tuple[dict, int]:
    engine = LLMEngine(model_dir, block_size=4, **engine_kwargs)
    pending, finals, step = sorted(requests, key=lambda r: r[4]), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][4] <= step:
            kind, request_id, prompt, params, _, priority = pending.pop(0)
            add = engine.add_beam_search_request if kind == "beam" else engine.add_request
            add(request_id, prompt, params, priority=priority)
        finals.update({o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished})
        step += 1
        assert step < 5000, "no progress: the engine keeps preempting"
    assert engine.num_free_blocks == engine.num_total_blocks
    return finals, engine.scheduler.num_preemptions


@pytest.mark.parametrize("engine_kwargs", TIGHT_POOLS.values(), ids=TIGHT_POOLS.keys())
def test_random_mixed_traffic_under_pressure_matches_a_roomy_run(tiny_llama_dir, engine_kwargs):
    """Every feature at once in a pool that forces preemption: each request's outputs equal a roomy run's."""
    preemptions = 0
    for seed in range(5):
        requests = random_engine_traffic(seed)
        roomy, _ = _serve(
            tiny_llama_dir, requests, num_kv_blocks=2000, max_num_batched_tokens=512, enable_prefix_caching=False
        )
        tight, count = _serve(tiny_llama_dir, requests, **engine_kwargs)
        assert tight == roomy, f"seed {seed}"
        preemptions += count
    assert preemptions >= 5
