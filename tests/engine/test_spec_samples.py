"""n > 1 with speculation: each sample proposes from its own history, its index forked from the group's prompt.

The proposer is the real NgramProposer, checked at every proposal against a brute-force scan (test_ngram_proposer's
oracle) of the engine's own token list for that sample (Request.all_token_ids, which it never reads itself)."""

from __future__ import annotations

import pytest

from pagedq.engine import LLM, SamplingParams
from pagedq.engine.config.speculative import SpeculativeConfig
from pagedq.engine.spec_decode.ngram import NgramProposer
from tests.conftest import random_tokens
from tests.engine.test_ngram_proposer import reference

K, LOW, HIGH = 3, 1, 3


class CheckedNgram(NgramProposer):
    """Records how requests were started and every proposal next to the brute-force one for the same history."""

    def __init__(self, llm: LLM) -> None:
        super().__init__(SpeculativeConfig("ngram", K, prompt_lookup_max=HIGH, prompt_lookup_min=LOW))
        self.scheduler = llm.llm_engine.scheduler
        self.added: list[str] = []
        self.forks: list[tuple[str, str]] = []
        self.proposals: list[tuple[str, list[int], list[int]]] = []  # (sample, proposed, brute force)

    def add_request(self, req_id, token_ids):
        self.added.append(req_id)
        super().add_request(req_id, token_ids)

    def fork(self, parent_id, child_id):
        self.forks.append((parent_id, child_id))
        super().fork(parent_id, child_id)

    def propose(self, req_id, max_drafts):
        drafts = super().propose(req_id, max_drafts)
        request = next(r for r in self.scheduler.running if r.request_id == req_id)
        self.proposals.append((req_id, drafts, reference(request.all_token_ids, LOW, HIGH, K, max_drafts)))
        return drafts


@pytest.mark.parametrize("n", [3])
def test_samples_propose_from_their_own_histories(tiny_llama_dir, n):
    llm = LLM(tiny_llama_dir, block_size=4)
    proposer = CheckedNgram(llm)
    llm.llm_engine.set_proposer(proposer, K)
    pattern = random_tokens(6, 11)
    prompts = [pattern * 4, random_tokens(9, 12) * 3]  # repeats: n-grams to look up
    params = [
        SamplingParams(max_tokens=24, n=n, temperature=1.0, top_k=3, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),  # n = 1: added whole, as before
    ]
    outputs = llm.generate(prompts, params)
    sampled = outputs[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) == n  # the samples diverged
    sample_ids = {r for r, _, _ in proposer.proposals if "#" in r or r == sampled.request_id}
    assert len(sample_ids) == n  # every sample proposed (the parent and its n - 1 forks)
    assert all(child in sample_ids for _, child in proposer.forks)
    assert {parent for parent, _ in proposer.forks} == {f"{sampled.request_id}\x00prompt"}
    assert not sample_ids & set(proposer.added)  # no sample re-added its history: they fork the prompt's
    assert proposer.proposals and all(got == expected for _, got, expected in proposer.proposals)
    assert any(got for r, got, _ in proposer.proposals if r in sample_ids)  # and some did find drafts
