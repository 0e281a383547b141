"""Speculative decoding for structured requests: drafts the grammar refuses are cut before verification, every verify
position samples under the mask a plain step would use there, and the outputs are token-identical to runs without
speculation (json schema, regex, choice; greedy and seeded sampling with filters; n > 1; next to plain requests;
tight pools that preempt by recompute and by swap; both scheduling paths via PAGEDQ_TEST_SCHEDULING). An independent
GrammarMatcher replays every structured output (structured_oracle.py)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from pagedq.engine import LLM, SamplingParams, StructuredOutputsParams
from tests.conftest import VOCAB_SIZE
from tests.engine.helpers import HistoryProposer
from tests.engine.structured_oracle import GrammarReplay, text_matches

K = 4
BLOCK = 4
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "tag": {"enum": ["fox", "dog"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    StructuredOutputsParams(regex=r"[0-9]{2,6}-(fox|dog)"),
    StructuredOutputsParams(choice=["red", "green", "blue"]),
]
MODES = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=11, top_k=40, top_p=0.9),
]
PROMPTS = ["The quick brown fox", "Paged attention stores the key", "Redis streams carry jobs", "Numbers like 12345"]
CONFIGS = {
    "roomy": dict(num_kv_blocks=256),
    "recompute": dict(num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=8),
    "swap": dict(
        num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=8, preemption_mode="swap", swap_space_gib=0.01
    ),
}


class DraftProposer(HistoryProposer):
    """Drafts from the true continuation (`truths`: prompt + output of a run without speculation), corrupted at one
    random place with probability `error_rate`; with `random_only`, random tokens (nearly all grammar-invalid)."""

    def __init__(self, truths: Sequence[list[int]] = (), error_rate: float = 0.0, random_only: bool = False) -> None:
        super().__init__()
        self.truths = [list(t) for t in truths]
        self.error_rate, self.random_only = error_rate, random_only
        self.rng = random.Random(0)

    def propose(self, req_id: str, max_drafts: int) -> list[int]:
        history = self.histories[req_id]
        if self.random_only:
            return [self.rng.randrange(VOCAB_SIZE) for _ in range(self.rng.randint(1, max_drafts))]
        truth = next((t for t in self.truths if len(t) > len(history) and t[: len(history)] == history), [])
        drafts = truth[len(history) : len(history) + max_drafts]
        if drafts and self.rng.random() < self.error_rate:
            drafts[self.rng.randrange(len(drafts))] = self.rng.randrange(VOCAB_SIZE)
        return drafts


def workload(tokenizer, structured_only: bool = False) -> list[tuple[list[int], SamplingParams]]:
    """Each constraint in each mode, a structured n = 2 request, and (unless structured_only) plain requests."""
    jobs = []
    for i, constraint in enumerate(CONSTRAINTS):
        for j, mode in enumerate(MODES):
            prompt = tokenizer.encode(PROMPTS[(i + j) % len(PROMPTS)])
            jobs.append((prompt, SamplingParams(max_tokens=24, structured_outputs=constraint, **mode)))
        if not structured_only:
            params = SamplingParams(max_tokens=24, temperature=1.0, seed=i, top_p=0.9, ignore_eos=True)
            jobs.append((tokenizer.encode(PROMPTS[i]), params))
    regex = CONSTRAINTS[1]
    jobs.append(
        (
            tokenizer.encode(PROMPTS[3]),
            SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, structured_outputs=regex),
        )
    )
    return jobs


def run(model_dir, jobs, config: dict, proposer: DraftProposer | None = None):
    llm = LLM(model_dir, block_size=BLOCK, **config)
    if proposer is not None:
        llm.llm_engine.set_proposer(proposer, K)
    outputs = llm.generate([p for p, _ in jobs], [s for _, s in jobs])
    return llm, outputs, llm.llm_engine.stats()


def summary(outputs) -> list[tuple]:
    return [
        (c.token_ids, c.finish_reason, c.stop_reason, o.error)
        for o in outputs
        for c in sorted(o.outputs, key=lambda c: c.index)
    ]


def truths(jobs, outputs) -> list[list[int]]:
    return [list(p) + c.token_ids for (p, _), o in zip(jobs, outputs) for c in o.outputs]


def check_replay(llm, jobs, outputs) -> None:
    engine = llm.llm_engine
    replay = GrammarReplay(engine.tokenizer, engine.model_config.vocab_size)
    stops = list(engine.model_config.eos_token_ids)
    for (_, params), output in zip(jobs, outputs):
        assert output.error is None, output.error
        constraint = params.structured_outputs
        for completion in output.outputs if constraint is not None else ():
            assert replay.refused(constraint, completion.token_ids, stops) == [], (constraint, completion)
            if completion.finish_reason == "stop":
                assert text_matches(constraint, completion.text), completion.text


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_grammar_invalid_drafts_are_cut_and_outputs_stay_identical(tiny_llama_dir, tokenizer, name):
    jobs = workload(tokenizer)
    config = CONFIGS[name]
    llm, expected, plain_stats = run(tiny_llama_dir, jobs, config)
    check_replay(llm, jobs, expected)
    assert any(
        c.finish_reason == "stop" for (_, s), o in zip(jobs, expected) if s.structured_outputs for c in o.outputs
    )
    if name != "roomy":
        assert plain_stats["num_preemptions"] > 0
    for proposer in (DraftProposer(truths(jobs, expected), error_rate=0.5), DraftProposer(random_only=True)):
        spec_llm, got, stats = run(tiny_llama_dir, jobs, config, proposer)
        assert summary(got) == summary(expected)
        check_replay(spec_llm, jobs, got)
        assert stats["num_grammar_cut_draft_tokens"] > 0  # the grammar refused some drafts before verification
        assert stats["num_verify_rows"] > 0  # and the plain requests' drafts still went to verification
        if name != "roomy":
            assert stats["num_preemptions"] > 0
    assert plain_stats["num_grammar_cut_draft_tokens"] == 0  # named even with speculation off


def test_structured_rows_accept_true_drafts(tiny_llama_dir, tokenizer):
    """Only structured requests, true drafts: they pass the grammar, are verified and accepted, in fewer steps; the
    only drafts cut are those that would finish the grammar (only the step's last token may: docs/engine.md)."""
    jobs = workload(tokenizer, structured_only=True)
    llm, expected, plain_stats = run(tiny_llama_dir, jobs, CONFIGS["roomy"])
    check_replay(llm, jobs, expected)
    spec_llm, got, stats = run(tiny_llama_dir, jobs, CONFIGS["roomy"], DraftProposer(truths(jobs, expected)))
    assert summary(got) == summary(expected)
    check_replay(spec_llm, jobs, got)
    assert stats["num_accepted_draft_tokens"] > 0
    assert stats["num_accepted_draft_tokens"] > stats["num_draft_tokens"] / 2
    assert stats["num_steps"] < plain_stats["num_steps"]
    finished = sum(c.finish_reason == "stop" for o in expected for c in o.outputs)
    assert stats["num_grammar_cut_draft_tokens"] <= finished * K
