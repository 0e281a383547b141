"""The n-gram proposer against a brute-force scan of the whole history, and speculative_config parsing."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from pagedq.engine.config.speculative import SpeculativeConfig
from pagedq.engine.spec_decode import ngram
from pagedq.engine.spec_decode.ngram import NgramProposer


def reference(history: list[int], min_n: int, max_n: int, k: int, max_drafts: int) -> list[int]:
    """For n from max_n down to min_n: the latest earlier occurrence of the last n tokens, and what followed it."""
    limit, length = min(k, max_drafts), len(history)
    if limit <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        suffix = history[length - n :]
        for start in range(length - n - 1, -1, -1):  # the latest occurrence that starts before the suffix
            if n < length and history[start : start + n] == suffix:
                return history[start + n : start + n + limit]
    return []


def config(k: int, low: int, high: int) -> SpeculativeConfig:
    return SpeculativeConfig("ngram", k, prompt_lookup_max=high, prompt_lookup_min=low)


def repetitive_stream(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random tokens from a small vocabulary, with stretches copied from earlier (what prompt lookup feeds on)."""
    tokens: list[int] = []
    while len(tokens) < length:
        if tokens and rng.random() < 0.5:
            start = rng.randrange(len(tokens))
            tokens.extend(tokens[start : start + rng.randint(1, 12)])
        else:
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
    return tokens[:length]


def test_the_vllm_docstring_example():
    # vLLM's example: [4,2,3] has no earlier match, [2,3] does; 3 tokens follow it, fewer than k = 4
    proposer = NgramProposer(config(4, 2, 3))
    proposer.add_request("a", [1, 2, 3, 4, 2, 3])
    assert proposer.propose("a", 10) == [4, 2, 3]


@pytest.mark.parametrize(
    ("history", "low", "high", "k", "expected"),
    [
        ([7, 8, 1, 7, 8, 2, 7, 8], 2, 2, 1, [2]),  # the latest of two earlier occurrences
        ([5, 9, 1, 2, 3, 6, 2, 3, 9, 1, 2, 3], 2, 3, 2, [6, 2]),  # the longest n wins over an earlier shorter one
        ([1, 1, 1, 1], 1, 3, 3, [1]),  # self-overlapping: [1,1,1] at 0..2 is followed by the suffix's last token
        ([4, 5, 4, 5, 4], 2, 2, 5, [5, 4]),  # overlapping the suffix: drafts run to the end of the history
        ([3], 1, 2, 2, []),  # shorter than any n with an earlier occurrence
        ([3, 3], 2, 2, 2, []),  # the only [3,3] is the suffix itself
        ([3, 3], 1, 2, 2, [3]),
        ([1, 2, 3, 4], 1, 3, 4, []),  # no repeat at all
    ],
)
def test_small_histories(history, low, high, k, expected):
    proposer = NgramProposer(config(k, low, high))
    proposer.add_request("r", history)
    assert proposer.propose("r", 16) == expected == reference(history, low, high, k, 16)


def test_max_drafts_caps_the_proposal_and_numpy_tokens_are_accepted():
    proposer = NgramProposer(config(4, 1, 2))
    proposer.add_request("r", np.array([1, 2, 3, 4, 5, 6, 1, 2], dtype=np.int64))
    assert proposer.propose("r", 4) == [3, 4, 5, 6]
    assert proposer.propose("r", 2) == [3, 4]
    assert proposer.propose("r", 0) == [] and proposer.propose("r", -1) == []
    assert all(type(token) is int for token in proposer.propose("r", 4))


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_matches_the_brute_force_scan(seed):
    """Adds, appends of 1..k+1 tokens, forks, removes and proposals with random max_drafts, on repetitive streams."""
    rng = random.Random(seed)
    low = rng.randint(1, 3)
    high, k, vocab = low + rng.randint(0, 3), rng.randint(1, 6), rng.choice([2, 3, 5, 20])
    proposer = NgramProposer(config(k, low, high))
    histories: dict[str, list[int]] = {}
    for step in range(600):
        action = rng.random()
        if action < 0.08 or not histories:
            name = f"r{step}"
            histories[name] = repetitive_stream(rng, rng.randint(0, 60), vocab)
            proposer.add_request(name, histories[name])
        elif action < 0.13:
            parent = rng.choice(sorted(histories))
            histories[f"f{step}"] = list(histories[parent])
            proposer.fork(parent, f"f{step}")
        elif action < 0.17 and len(histories) > 1:
            name = rng.choice(sorted(histories))
            del histories[name]
            proposer.remove(name)
        else:
            name = rng.choice(sorted(histories))
            max_drafts = rng.randint(0, k + 2)
            assert proposer.propose(name, max_drafts) == reference(histories[name], low, high, k, max_drafts)
            # what a step makes final: some of the drafts, else any tokens, then one more
            drafts = proposer.propose(name, k)
            new = [*drafts[: rng.randint(0, len(drafts))], rng.randrange(vocab)]
            if rng.random() < 0.3:
                new = [rng.randrange(vocab) for _ in range(rng.randint(1, k + 1))]
            histories[name].extend(new)
            proposer.append(name, new)
    for name, history in histories.items():
        assert proposer.propose(name, k) == reference(history, low, high, k, k)
    assert len(proposer) == len(histories)


def test_forks_share_the_prefix_and_then_diverge():
    proposer = NgramProposer(config(3, 2, 2))
    proposer.add_request("p", [1, 2, 3, 9, 9])
    proposer.fork("p", "c")
    proposer.fork("c", "g")  # a fork of a fork
    proposer.append("p", [1, 2])  # the parent's later tokens are not the child's
    proposer.append("c", [5, 6, 5])
    proposer.append("g", [9, 9, 1, 2])
    assert proposer.propose("p", 3) == [3, 9, 9]
    assert proposer.propose("c", 3) == reference([1, 2, 3, 9, 9, 5, 6, 5], 2, 2, 3, 3) == []
    proposer.append("c", [6])  # [5, 6] occurred in the child's own part
    assert proposer.propose("c", 3) == [5, 6]
    proposer.remove("p")
    proposer.remove("c")  # the grandchild keeps what it shares
    assert proposer.propose("g", 3) == reference([1, 2, 3, 9, 9, 9, 9, 1, 2], 2, 2, 3, 3) == [3, 9, 9]
    # an n-gram that straddles the fork point is the child's own
    proposer.add_request("q", [4, 7])
    proposer.fork("q", "d")
    proposer.append("d", [8, 4, 7, 8, 4])
    assert proposer.propose("d", 3) == reference([4, 7, 8, 4, 7, 8, 4], 2, 2, 3, 3) == [7, 8, 4]


def test_add_request_restarts_and_unknown_ids():
    proposer = NgramProposer(config(2, 1, 1))
    proposer.add_request("r", [1, 2, 1])
    proposer.add_request("r", [3, 4, 5])  # a restart replaces the old history
    assert proposer.propose("r", 2) == []
    proposer.remove("nobody")
    with pytest.raises(KeyError):
        proposer.propose("nobody", 2)
    with pytest.raises(KeyError):
        proposer.append("nobody", [1])


def test_a_hash_collision_never_yields_a_wrong_draft(monkeypatch):
    """With a modulus of 7 nearly every n-gram collides: each proposal must still follow a true earlier match."""
    monkeypatch.setattr(ngram, "_MODULUS", 7)
    rng = random.Random(3)
    history = repetitive_stream(rng, 300, 4)
    proposer = NgramProposer(config(3, 2, 4))
    proposer.add_request("r", [])
    for cut in range(1, len(history)):
        proposer.append("r", history[cut - 1 : cut])
        drafts, seen = proposer.propose("r", 3), history[:cut]
        if drafts:
            assert any(
                seen[start : start + n] == seen[cut - n :] and seen[start + n : start + n + 3] == drafts
                for n in range(2, 5)
                for start in range(cut - n)
            )


# --- speculative_config -------------------------------------------------------------------------------------------


def test_vllm_defaults_for_the_lookup_bounds():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}) == config(3, 5, 5)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}) == (
        config(3, 4, 4)
    )
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}) == (
        config(3, 2, 2)
    )
    full = config(4, 2, 6)
    assert SpeculativeConfig.parse(json.dumps(full.to_dict())) == full
    assert SpeculativeConfig.parse(full) is full
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("null") is None


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "'lookahead'"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle'"),
        ({"num_speculative_tokens": 3}, "method"),
        ({"method": 1, "num_speculative_tokens": 3}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 3.0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 33}, "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": "4"}, "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": -1}, "prompt_lookup_min"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
        ),
        ("[1, 2]", "expected a JSON object"),
        ("{method: ngram}", "not valid JSON"),
    ],
)
def test_bad_configs_name_the_key(value, named):
    with pytest.raises(ValueError, match="speculative_config") as error:
        SpeculativeConfig.parse(value)
    assert named in str(error.value)


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig("ngram", 3, prompt_lookup_max=0, prompt_lookup_min=1)
