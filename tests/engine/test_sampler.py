"""The batched sampler against direct, per-row computations."""

from __future__ import annotations

import pytest
import torch

from pagedq.engine.sample.sampler import SamplingBatch, sample
from pagedq.kernels.reference import gumbel_noise

VOCAB = 50


def make_batch(
    rows: int, temperature=1.0, top_k=VOCAB, top_p=1.0, min_p=0.0, seeds=None, positions=None, logprobs=None
) -> SamplingBatch:
    def full(value, dtype):
        return torch.full((rows,), value, dtype=dtype)

    return SamplingBatch(
        temperature=full(temperature, torch.float32),
        top_k=full(top_k, torch.long),
        top_p=full(top_p, torch.float32),
        min_p=full(min_p, torch.float32),
        seeds=seeds if seeds is not None else torch.arange(rows, dtype=torch.long) * 7919,
        positions=positions if positions is not None else torch.zeros(rows, dtype=torch.long),
        max_num_logprobs=logprobs,
    )


def allowed_set(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens a sampler may return, computed the slow, obvious way for one row."""
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))[:top_k]
    probs = torch.softmax(logits[order] / temperature, dim=0).tolist()
    kept, mass = [], 0.0
    for token, p in zip(order, probs):
        if kept and mass >= top_p:
            break
        kept.append((token, p))
        mass += p
    best = kept[0][1]
    return {token for token, p in kept if p >= min_p * best}


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (VOCAB, 0.5, 0.0), (VOCAB, 1.0, 0.2), (10, 0.8, 0.05)])
def test_filters_never_sample_outside_the_allowed_set(top_k, top_p, min_p):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, VOCAB, generator=generator) * 3
    for position in range(20):
        batch = make_batch(
            64, temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p, positions=torch.full((64,), position)
        )
        tokens = sample(logits, batch).token_ids.tolist()
        for row, token in enumerate(tokens):
            assert token in allowed_set(logits[row], 0.8, top_k, top_p, min_p)


def test_gumbel_max_draws_from_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    draws = 20000
    batch = SamplingBatch(
        temperature=torch.ones(draws),
        top_k=torch.full((draws,), 6),
        top_p=torch.ones(draws),
        min_p=torch.zeros(draws),
        seeds=torch.full((draws,), 1234, dtype=torch.long),
        positions=torch.arange(draws, dtype=torch.long),
        needs_filters=False,
    )
    tokens = sample(logits.expand(draws, -1).clone(), batch).token_ids
    frequencies = torch.bincount(tokens, minlength=6).float() / draws
    expected = torch.softmax(logits, dim=0)
    # Binomial standard error is at most 0.0036 here; 4 sigma.
    assert torch.allclose(frequencies, expected, atol=0.015), (frequencies, expected)


def test_noise_depends_only_on_seed_position_and_token():
    seeds = torch.tensor([1, 2, 1, -5, 2**62], dtype=torch.long)
    positions = torch.tensor([0, 0, 3, 0, 9], dtype=torch.long)
    noise = gumbel_noise(seeds, positions, VOCAB)
    again = gumbel_noise(seeds.flip(0), positions.flip(0), VOCAB).flip(0)
    assert torch.equal(noise, again)
    assert torch.isfinite(noise).all()
    assert not torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])


def test_greedy_rows_take_the_argmax_and_logprobs_are_log_softmax():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, VOCAB, generator=generator)
    batch = make_batch(8, temperature=0.0, logprobs=3)
    result = sample(logits, batch)
    expected_lp = torch.log_softmax(logits, dim=-1)
    assert torch.equal(result.token_ids, logits.argmax(dim=-1))
    assert torch.allclose(result.sampled_logprobs, expected_lp.max(dim=-1).values)
    top = expected_lp.topk(3, dim=-1)
    assert torch.allclose(result.top_logprobs, top.values) and torch.equal(result.top_token_ids, top.indices)


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    batch = make_batch(4)
    batch.temperature = torch.tensor([0.0, 1.0, 0.0, 1.0])
    tokens = sample(logits, batch).token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    batch = make_batch(1, temperature=0.0)
    batch.repetition_penalty = torch.tensor([2.0])
    batch.presence_penalty = torch.tensor([0.5])
    batch.frequency_penalty = torch.tensor([0.25])
    batch.prompt_token_mask = torch.tensor([[False, True, False, False, False]])
    batch.output_token_counts = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0]])
    from pagedq.engine.sample.sampler import apply_penalties

    penalised = apply_penalties(logits, batch)
    # token 1: prompt only -> -1 * 2; token 3: output twice -> 3/2 - 0.25*2 - 0.5
    assert torch.allclose(penalised, torch.tensor([[2.0, -2.0, 0.5, 0.5, 0.0]]))
    assert sample(logits, batch).token_ids.item() == 0


def _real_shaped_logits(rows: int, seed: int = 0) -> torch.Tensor:
    """SmolLM2's vocabulary size and a peaked distribution: a few likely tokens over a long, thin tail."""
    logits = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(seed)) * 2.5
    logits[:, :5] += 15
    return logits


def test_top_p_one_keeps_every_token_of_a_real_sized_vocabulary():
    from pagedq.engine.sample.sampler import apply_filters

    logits = _real_shaped_logits(4)
    filtered = apply_filters(logits, make_batch(4, top_k=logits.shape[-1], top_p=1.0))
    assert torch.equal(filtered, logits)  # a descending fp32 running sum reached 1.0 and cut thousands of tokens


def _rows_batch(rows: list[dict], positions: int, needs_filters: bool) -> SamplingBatch:
    """One sampling row per (setting, position): rows[i] at positions 0..positions-1, all with seed 7."""
    settings = [row for row in rows for _ in range(positions)]

    def column(name, dtype):
        return torch.tensor([row[name] for row in settings], dtype=dtype)

    return SamplingBatch(
        temperature=column("temperature", torch.float32),
        top_k=column("top_k", torch.long),
        top_p=column("top_p", torch.float32),
        min_p=torch.zeros(len(settings)),
        seeds=torch.full((len(settings),), 7, dtype=torch.long),
        positions=torch.arange(positions, dtype=torch.long).repeat(len(rows)),
        needs_filters=needs_filters,
    )


def test_a_plain_rows_draw_does_not_depend_on_a_filtering_neighbour():
    from pagedq.engine.sample.sampler import apply_filters

    positions, logits = 32, _real_shaped_logits(2, seed=1)
    vocab = logits.shape[-1]
    plain = dict(temperature=1.0, top_k=vocab, top_p=1.0)
    neighbour = dict(temperature=0.7, top_k=50, top_p=0.9)
    plain_logits = logits[0].expand(positions, vocab)
    mixed_logits = torch.cat([plain_logits, logits[1].expand(positions, vocab)])
    alone = sample(plain_logits, _rows_batch([plain], positions, needs_filters=False)).token_ids
    mixed_batch = _rows_batch([plain, neighbour], positions, needs_filters=True)
    mixed = sample(mixed_logits, mixed_batch).token_ids
    assert torch.equal(mixed[:positions], alone)
    # What makes it so: the filter path hands the plain rows' distribution on untouched.
    assert torch.equal(apply_filters(mixed_logits, mixed_batch)[:positions], plain_logits)
    allowed = allowed_set(logits[1], 0.7, 50, 0.9, 0.0)
    assert set(mixed[positions:].tolist()) <= allowed
    neighbour_alone = sample(logits[1].expand(positions, vocab), _rows_batch([neighbour], positions, True)).token_ids
    assert torch.equal(mixed[positions:], neighbour_alone)
