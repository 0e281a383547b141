"""logit_bias: the sampler's sparse add against a dense one, and the engine's greedy picks under +100 / -100."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedq.engine import LLM, SamplingParams
from pagedq.engine.sample.sampler import SamplingBatch, sample

PROMPTS = ["The quick brown fox", "Paged attention stores"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _batch(rows: int, temperature: float, **extra) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((rows,), temperature),
        top_k=torch.full((rows,), 40, dtype=torch.long),
        top_p=torch.full((rows,), 0.9),
        min_p=torch.zeros(rows),
        seeds=torch.arange(rows, dtype=torch.long) * 31,
        positions=torch.zeros(rows, dtype=torch.long),
        max_num_logprobs=2,
        **extra,
    )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sparse_bias_equals_a_dense_add_and_leaves_logprobs_raw(temperature):
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    dense = torch.zeros(3, 64)
    dense[0, 5], dense[0, 9], dense[2, 5] = 100.0, -3.5, 7.25
    rows, ids = torch.tensor([0, 0, 2]), torch.tensor([5, 9, 5])
    sparse = sample(logits, _batch(3, temperature, logit_bias=(rows, ids, dense[rows, ids])))
    reference = sample(logits + dense, _batch(3, temperature))
    assert sparse.token_ids.tolist() == reference.token_ids.tolist() and sparse.token_ids[0] == 5
    plain = sample(logits, _batch(3, temperature))
    assert torch.equal(sparse.top_logprobs, plain.top_logprobs)  # logprobs are the model's, before any bias


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_kv_blocks=64, max_num_batched_tokens=64)


def test_plus_100_makes_greedy_pick_a_token_and_minus_100_bans_it(llm):
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    favourite = plain[0][0]
    forced = 1 + max(max(p) for p in plain) % 50  # a token greedy did not pick
    assert forced not in plain[0]
    biased = llm.generate(PROMPTS, [dataclasses.replace(GREEDY, logit_bias={forced: 100.0}), GREEDY])
    assert biased[0].outputs[0].token_ids == [forced] * GREEDY.max_tokens
    assert biased[1].outputs[0].token_ids == plain[1]  # its neighbour in the batch is untouched
    banned = llm.generate(PROMPTS[0], dataclasses.replace(GREEDY, logit_bias={favourite: -100.0}))[0].outputs[0]
    assert favourite not in banned.token_ids
    n2 = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True, n=2, seed=3, logit_bias={forced: 100}))
    assert [c.token_ids for c in n2[0].outputs] == [[forced] * GREEDY.max_tokens] * 2  # every sample of a fan-out


def test_out_of_vocab_and_out_of_range_biases_are_refused(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, "):
        llm.llm_engine.add_request("oov", PROMPTS[0], SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="logit_bias values must be"):
        SamplingParams(logit_bias={1: 100.5})
    with pytest.raises(ValueError, match="at most 300 tokens"):
        SamplingParams(logit_bias={t: 1.0 for t in range(301)})
    assert not llm.llm_engine.has_unfinished_requests()
