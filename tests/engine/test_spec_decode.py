"""Speculative decoding on the engine: outputs identical with and without drafts, whatever the drafts.

The drafts come from proposers written here: the true continuation (taken from a run without speculation) corrupted
at random places, and random tokens. Every draft the first proposes should pass and the corrupted ones must not;
every draft the second proposes should fail. Neither may change a single output token, logprob or stop.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence

import pytest
import torch

from pagedq.engine import LLM, BeamSearchParams, LLMEngine, SamplingParams
from tests.conftest import VOCAB_SIZE
from tests.conftest import random_tokens as _tokens
from tests.engine.helpers import HistoryProposer

K = 4  # drafts per step
BLOCK = 4


class TestProposer(HistoryProposer):
    """Drafts from the true continuation (`truths`: prompt + output of runs without speculation), each step's run
    corrupted at one random place with probability `error_rate`; with `random_only`, random tokens only."""

    __test__ = False  # not a test class

    def __init__(self, truths: Sequence[list[int]] = (), error_rate: float = 0.0, random_only: bool = False) -> None:
        super().__init__()
        self.truths = [list(t) for t in truths]
        self.error_rate, self.random_only = error_rate, random_only
        self.rng = random.Random(0)
        self.num_proposed = 0

    def propose(self, req_id: str, max_drafts: int) -> list[int]:
        history = self.histories[req_id]
        if self.random_only:
            drafts = [self.rng.randrange(VOCAB_SIZE) for _ in range(self.rng.randint(1, max_drafts))]
        else:
            # the continuation of the truth this history is a prefix of (several may be: take the first)
            truth = next((t for t in self.truths if len(t) > len(history) and t[: len(history)] == history), [])
            drafts = truth[len(history) : len(history) + max_drafts]
            if drafts and self.rng.random() < self.error_rate:
                drafts[self.rng.randrange(len(drafts))] = self.rng.randrange(VOCAB_SIZE)
        self.num_proposed += len(drafts)
        return drafts


def _prompts() -> list[list[int]]:
    shared = _tokens(8, 100)  # two prompts share two blocks: prefix caching
    singles = [_tokens(length, seed) for length, seed in ((14, 4), (11, 5), (7, 6), (10, 7), (12, 8))]
    return [_tokens(6, 1), shared + _tokens(5, 2), shared + _tokens(9, 3), *singles, _tokens(9, 9)]


def _params(reference: list[list[int]], texts: list[str]) -> list[SamplingParams]:
    """One request per feature; stop ids and strings picked from a run without them, so they do hit mid-output."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    text = texts[6]
    return [
        greedy,
        dataclasses.replace(greedy, max_tokens=7),  # ends mid-draft
        dataclasses.replace(greedy, stop_token_ids=[reference[2][10]]),
        SamplingParams(
            max_tokens=30,
            temperature=0.9,
            top_k=40,
            top_p=0.9,
            repetition_penalty=1.2,
            presence_penalty=0.3,
            frequency_penalty=0.2,
            logit_bias={reference[3][5]: 2.0},
            seed=5,
            ignore_eos=True,
        ),
        # its stop id occurs before min_tokens: banned there, by position
        dataclasses.replace(greedy, max_tokens=30, min_tokens=12, stop_token_ids=[reference[4][3]], logprobs=2),
        SamplingParams(max_tokens=20, n=2, temperature=1.0, min_p=0.05, seed=7, ignore_eos=True),
        dataclasses.replace(greedy, stop=[text[len(text) // 2 : len(text) // 2 + 3]]),
        dataclasses.replace(greedy, max_tokens=12, prompt_logprobs=2, logprobs=1),
        # EOS (biased up so the random model does write it, after 13 tokens) ends it inside a draft
        dataclasses.replace(greedy, ignore_eos=False, min_tokens=6, logit_bias={2: 4.0}),
    ]


def _run(model_dir, config: dict, prompts, params, proposer: TestProposer | None = None) -> tuple[list, dict]:
    llm = LLM(model_dir, block_size=BLOCK, **config)
    if proposer is not None:
        llm.llm_engine.set_proposer(proposer, K)
    outputs = llm.generate(prompts, params)
    return outputs, llm.llm_engine.stats()


def _summary(outputs) -> list[tuple]:
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason)
        for output in outputs
        for c in sorted(output.outputs, key=lambda c: c.index)
    ]


def _assert_same_logprobs(ours, theirs) -> None:
    for mine, ref in zip(ours, theirs):
        if ref.prompt_logprobs is not None:
            for a, b in zip(mine.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
        for c, r in zip(mine.outputs, ref.outputs):
            if r.logprobs is not None:
                assert len(c.logprobs) == len(r.logprobs)
                for a, b in zip(c.logprobs, r.logprobs):
                    assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
            if r.cumulative_logprob is not None:
                assert c.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-3)


@pytest.fixture(scope="module")
def workload(tiny_llama_dir):
    prompts = _prompts()
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first, _ = _run(tiny_llama_dir, {"num_kv_blocks": 256}, prompts, plain)
    reference = [o.outputs[0].token_ids for o in first]
    return prompts, _params(reference, [o.outputs[0].text for o in first])


CONFIGS = {
    "roomy": {"num_kv_blocks": 256},
    "recompute": {"num_kv_blocks": 26, "max_num_seqs": 8},
    "swap": {"num_kv_blocks": 26, "max_num_seqs": 8, "preemption_mode": "swap", "swap_space_gib": 0.01},
    "chunked": {"num_kv_blocks": 256, "max_num_batched_tokens": 10},
    "no-prefix-cache": {"num_kv_blocks": 256, "enable_prefix_caching": False},
}


@pytest.mark.parametrize("drafts", ["mostly-right", "random"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_identical_with_and_without_speculation(tiny_llama_dir, workload, name, drafts):
    prompts, params = workload
    config = CONFIGS[name]
    expected, plain_stats = _run(tiny_llama_dir, config, prompts, params)
    truths = [list(p) + c.token_ids for p, o in zip(prompts, expected) for c in o.outputs]
    proposer = TestProposer(truths, error_rate=0.3) if drafts == "mostly-right" else TestProposer(random_only=True)
    got, stats = _run(tiny_llama_dir, config, prompts, params, proposer)
    assert _summary(got) == _summary(expected)
    _assert_same_logprobs(got, expected)
    assert expected[-1].outputs[0].finish_reason == "stop" and expected[-1].outputs[0].stop_reason is None  # EOS
    assert stats["num_verify_rows"] > 0
    # all proposed drafts are verified, except where a tight pool had no spare block for their slots
    assert stats["num_draft_tokens"] == proposer.num_proposed or name in ("recompute", "swap")
    if drafts == "mostly-right":
        assert stats["num_accepted_draft_tokens"] > stats["num_draft_tokens"] / 2
        assert stats["num_steps"] < plain_stats["num_steps"]
    if name in ("recompute", "swap"):
        assert stats["num_preemptions"] > 0 and plain_stats["num_preemptions"] > 0
    assert plain_stats["num_draft_tokens"] == plain_stats["num_verify_rows"] == 0  # named even when off


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_both_scheduling_paths_give_the_same_tokens(tiny_llama_dir, workload, async_scheduling):
    prompts, params = workload
    config = {"num_kv_blocks": 26, "max_num_seqs": 8, "async_scheduling": async_scheduling}
    expected, _ = _run(tiny_llama_dir, {"num_kv_blocks": 256, "async_scheduling": False}, prompts, params)
    truths = [list(p) + c.token_ids for p, o in zip(prompts, expected) for c in o.outputs]
    got, stats = _run(tiny_llama_dir, config, prompts, params, TestProposer(truths, error_rate=0.3))
    assert _summary(got) == _summary(expected) and stats["num_accepted_draft_tokens"] > 0


def test_rejected_drafts_never_enter_the_prefix_cache(tiny_llama_dir):
    """A sequence that rejected many drafts, then a prompt that is that sequence: it is served from the prefix
    cache, and its continuation is the one computed without any cache or speculation."""
    prompt = _tokens(9, 11)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_llama_dir, block_size=BLOCK, num_kv_blocks=256)
    llm.llm_engine.set_proposer(TestProposer(random_only=True), K)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    engine = llm.llm_engine
    assert engine.stats()["num_draft_tokens"] > 20
    follow = prompt + first
    again = llm.generate([follow], dataclasses.replace(params, max_tokens=8))[0]
    assert again.num_cached_tokens >= len(follow) - BLOCK
    plain = LLM(tiny_llama_dir, block_size=BLOCK, num_kv_blocks=256, enable_prefix_caching=False)
    assert (
        again.outputs[0].token_ids
        == plain.generate([follow], dataclasses.replace(params, max_tokens=8))[0].outputs[0].token_ids
    )


def test_kv_slot_utilization_counts_only_slots_holding_tokens(tiny_llama_dir):
    """After every step the filled slots are exactly the tokens with K/V (as without speculation): rejected drafts'
    slots are not counted, and the blocks holding only them are back in the pool."""
    engine = LLMEngine(
        tiny_llama_dir, block_size=BLOCK, num_kv_blocks=64, async_scheduling=False, enable_prefix_caching=False
    )
    engine.set_proposer(TestProposer(random_only=True), K)
    params = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", _tokens(5 + 3 * i, 20 + i), params)
    manager = engine.block_manager
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        assert manager._filled_slots == sum(r.num_computed_tokens for r in running)
        assert manager.num_used_blocks == sum(manager.blocks_for_tokens(r.num_computed_tokens) for r in running)
        assert 0.0 <= engine.kv_slot_utilization <= 1.0
    assert engine.stats()["num_verify_rows"] > 0


def test_beam_search_is_refused_with_speculation(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, block_size=BLOCK, num_kv_blocks=64)
    engine.set_proposer(TestProposer(random_only=True), K)
    with pytest.raises(ValueError, match="speculative"):
        engine.add_beam_search_request("b", _tokens(5, 1), BeamSearchParams(beam_width=2, max_tokens=4))


def test_the_verify_budget_caps_drafts_per_row_and_switches_wide_steps_off(tiny_llama_dir):
    """A step's verify tokens stay within max_verify_tokens: with R running each row drafts at most
    max_verify_tokens // R - 1 (within k), and a step where that is under one runs as a plain decode."""
    budget = 7  # R = 1: k (4) drafts; R = 2: 2; R = 3: 1; R = 4: none
    llm = LLM(tiny_llama_dir, block_size=BLOCK, num_kv_blocks=256)
    prompts = [_tokens(6, i) for i in range(4)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (4, 8, 16, 40)]
    truths = [p + o.outputs[0].token_ids for p, o in zip(prompts, llm.generate(prompts, params))]
    engine = llm.llm_engine
    engine.set_proposer(TestProposer(truths), K, max_verify_tokens=budget)  # right drafts: limits stay at k
    schedule, seen = engine.scheduler.schedule, []

    def recording_schedule(*args):
        output = schedule(*args)
        drafts = [len(item.draft_token_ids) for item in output.scheduled]
        seen.append((len(engine.scheduler.running), max(drafts, default=0), sum(drafts) + len(drafts)))
        return output

    engine.scheduler.schedule = recording_schedule
    assert [p + o.outputs[0].token_ids for p, o in zip(prompts, llm.generate(prompts, params))] == truths
    for running, most, verify_tokens in seen:
        assert most <= max(0, min(K, budget // running - 1)), (running, most)
        assert most == 0 or verify_tokens <= budget
    widths: dict[int, int] = {}  # running sequences -> the most drafts a row brought then
    for running, most, _ in seen:
        widths[running] = max(widths.get(running, 0), most)
    assert widths.get(1) == K and widths.get(2) == 2 and widths.get(4, 0) == 0  # long alone, shorter in company
    assert engine.stats()["num_spec_off_steps"] > 0


def test_steps_whose_proposals_all_come_back_empty_back_off(tiny_llama_dir):
    """A proposer that never finds a draft costs the overlap of the steps that ask it: the next ones do not ask."""
    llm = LLM(tiny_llama_dir, block_size=BLOCK, num_kv_blocks=256)
    llm.llm_engine.set_proposer(TestProposer(), K, max_backoff_steps=8)  # no truths: it never proposes
    llm.generate([_tokens(6, 40)], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stats = llm.llm_engine.stats()
    assert stats["num_verify_rows"] == 0 and stats["num_spec_off_steps"] >= 15


def test_on_the_cpu_every_step_asks_the_proposer(tiny_llama_dir):
    """The CPU default: no back-off (engine/spec_decode/drafts.py), so drafts that appear late are found at once."""
    llm = LLM(tiny_llama_dir, block_size=BLOCK, num_kv_blocks=256)
    proposer = AskedProposer()  # no truths: it never proposes
    llm.llm_engine.set_proposer(proposer, K)
    llm.generate([_tokens(6, 40)], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    (asked,) = proposer.asked.values()
    assert llm.llm_engine.stats()["num_spec_off_steps"] == 0 and len(asked) >= 28


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_sampling_with_speculation_keeps_the_target_distribution(tiny_llama_dir, hf_model):
    """χ² against transformers' own logits and logits processors (an independent oracle): the second output token
    (drawn at a verify position whose draft is the target's likeliest token, so it is accepted about as often as
    it is rejected) and the third (drawn after that draft was accepted: its penalty counts the draft)."""
    from scipy.stats import chisquare
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    prompt = _tokens(6, 33)  # its likeliest first and second tokens have p = 0.44 and 0.37 under these settings
    settings = dict(temperature=0.6, top_k=12, top_p=0.95, min_p=0.02, repetition_penalty=1.4)
    processors = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]),
            TemperatureLogitsWarper(settings["temperature"]),
            TopKLogitsWarper(settings["top_k"]),
            TopPLogitsWarper(settings["top_p"]),
            MinPLogitsWarper(settings["min_p"]),
        ]
    )

    def target(history: list[int]) -> torch.Tensor:
        ids = torch.tensor([history])
        with torch.no_grad():
            logits = hf_model(ids).logits[:, -1].float()
        return torch.softmax(processors(ids, logits), dim=-1)[0]

    first = int(target(prompt).argmax())
    second = int(target([*prompt, first]).argmax())
    drafts = [second, int(target([*prompt, first, second]).argmax())]

    class FixedDrafts(TestProposer):
        def propose(self, req_id: str, max_drafts: int) -> list[int]:
            history = self.histories[req_id]
            return drafts[:max_drafts] if history == [*prompt, first] else []

    num_samples = 2400
    engine = LLMEngine(tiny_llama_dir, block_size=BLOCK, num_kv_blocks=1024, max_num_seqs=256)
    engine.set_proposer(FixedDrafts(), 2, max_verify_tokens=10**6)
    for i in range(num_samples):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=3, seed=1000 + i, ignore_eos=True, **settings))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    assert engine.stats()["num_verify_rows"] > 0
    after_first = [o for o in outputs if o[0] == first]
    for history, observed in (
        ([*prompt, first], [o[1] for o in after_first]),
        ([*prompt, first, second], [o[2] for o in after_first if o[1] == second]),
    ):
        assert len(observed) > 200
        probs = target(history)
        support = torch.nonzero(probs > 0).flatten().tolist()
        assert set(observed) <= set(support)
        counts = torch.bincount(torch.tensor(observed), minlength=len(probs))[support].double()
        expected = probs[support].double() * len(observed)
        # pool the rare tokens so every χ² cell expects at least 5
        rare = expected < 5
        if rare.any():
            counts = torch.cat([counts[~rare], counts[rare].sum()[None]])
            expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
        expected *= counts.sum() / expected.sum()  # fp32 probabilities sum to 1 only within rounding
        assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3, (counts, expected)


def test_ngram_speculation_from_the_config_keeps_outputs_and_accepts_drafts(tiny_llama_dir, workload):
    """The real proposer, configured as vLLM's users do (JSON text, as on the command line): a random tiny model
    repeats itself now and then, so prompt lookup finds drafts, and a few pass (4 of 181 on the long greedy runs)."""
    prompts, params = workload
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts, params = prompts + [_tokens(8, i) for i in range(4)], params + [long] * 4
    expected, _ = _run(tiny_llama_dir, {"num_kv_blocks": 256}, prompts, params)
    config = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    got, stats = _run(tiny_llama_dir, {"num_kv_blocks": 256, "speculative_config": json.dumps(config)}, prompts, params)
    assert _summary(got) == _summary(expected)
    assert stats["num_accepted_draft_tokens"] > 0 and stats["num_verify_rows"] > 0


def test_a_bad_speculative_config_is_refused_naming_the_key(tiny_llama_dir):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLMEngine(tiny_llama_dir, num_kv_blocks=16, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="prompt_lookup_typo"):
        LLMEngine(
            tiny_llama_dir,
            num_kv_blocks=16,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_typo": 3},
        )


class AskedProposer(TestProposer):
    """A TestProposer that records, per request, how many drafts each call allowed."""

    __test__ = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: dict[str, list[int]] = {}

    def propose(self, req_id: str, max_drafts: int) -> list[int]:
        self.asked.setdefault(req_id, []).append(max_drafts)
        return super().propose(req_id, max_drafts)


def test_draft_lengths_follow_each_requests_acceptance(tiny_llama_dir, workload):
    """After a rejection a request drafts at most what held plus one; after full acceptance two more, up to K.
    Wrong drafts only (random): from its second proposal on, a request is asked for one draft at a time (random
    tokens pass ~never); right drafts only (the truth): always K. Outputs stay identical either way."""
    prompts = [_tokens(6, 60 + i) for i in range(3)]
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected, _ = _run(tiny_llama_dir, {"num_kv_blocks": 256}, prompts, greedy)
    wrong = AskedProposer(random_only=True)
    got, _ = _run(tiny_llama_dir, {"num_kv_blocks": 256}, prompts, greedy, wrong)
    assert _summary(got) == _summary(expected)
    for asked in wrong.asked.values():
        assert asked[0] == K and len(asked) > 5 and max(asked[1:]) <= 2 and asked.count(1) >= len(asked) - 3
    truths = [p + o.outputs[0].token_ids for p, o in zip(prompts, expected)]
    right = AskedProposer(truths)
    got, stats = _run(tiny_llama_dir, {"num_kv_blocks": 256}, prompts, greedy, right)
    assert _summary(got) == _summary(expected)
    assert stats["num_accepted_draft_tokens"] == stats["num_draft_tokens"] > 0
    for asked in right.asked.values():  # K, but never past max_tokens: the last proposals may ask for fewer
        assert asked[:-2] == [K] * (len(asked) - 2)
