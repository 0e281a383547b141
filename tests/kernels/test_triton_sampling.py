"""gumbel_argmax (fused temperature + counter-based Gumbel noise + argmax) against kernels.reference."""

from __future__ import annotations

import pytest
import torch

from pagedq.kernels import reference
from pagedq.kernels.sampling import BLOCK_V, gumbel_argmax_split, gumbel_noise_triton

VOCAB = 2 * BLOCK_V + 452  # three tiles, the last one partial
# Found by search: with the earlier 24-bit uniform, gumbel_noise(seed 3060, position 0) was +inf at token 949.
INF_SEED, INF_POSITION, INF_TOKEN = 3060, 0, 949


def _rows(num_rows, device):
    edge_seeds = torch.tensor([0, -1, 2**40 + 7, -(2**62), 2**63 - 1])
    seeds = torch.cat([edge_seeds, torch.randint(-(2**62), 2**62, (num_rows,))])
    positions = torch.cat([torch.tensor([0, 2**33 + 1, 5, 2**31, 7]), torch.randint(0, 2**40, (num_rows,))])
    return seeds[:num_rows].to(device), positions[:num_rows].to(device)


def test_noise_is_bit_identical_to_reference(device):
    seeds, positions = _rows(7, device)
    got = gumbel_noise_triton(seeds, positions, VOCAB)
    expected = reference.gumbel_noise(seeds, positions, VOCAB)
    assert got.dtype == torch.float32 and got.shape == (7, VOCAB)
    assert torch.equal(got, expected), int((got != expected).sum())


def _sampling_case(device, num_rows=24):
    seeds, positions = _rows(num_rows, device)
    logits = torch.randn(num_rows, VOCAB) * torch.linspace(0.5, 6.0, num_rows)[:, None]
    temperature = torch.tensor([0.0, 0.5, 1.0, 2.0, 1e-9, -1.0, 0.7, 0.0] * (num_rows // 8))
    top_k = torch.randint(1, 60, (num_rows,))
    filtered = torch.arange(VOCAB)[None, :] >= top_k[:, None]  # top-k style filter in rank order
    ranks = logits.argsort(dim=-1, descending=True).argsort(dim=-1)
    logits[torch.gather(filtered, 1, ranks) & (torch.arange(num_rows)[:, None] % 3 == 0)] = float("-inf")
    return logits.to(device), temperature.to(device), seeds, positions


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_gumbel_argmax_matches_reference(device, num_splits):
    logits, temperature, seeds, positions = _sampling_case(device)
    got = gumbel_argmax_split(logits, temperature, seeds, positions, num_splits)
    expected = reference.gumbel_argmax(logits, temperature, seeds, positions)
    assert got.dtype == torch.int64 and torch.equal(got, expected)
    sampled = temperature > 0.1
    assert bool((got[sampled] != logits[sampled].argmax(-1)).any())  # the noise really changes choices
    assert torch.isfinite(logits.gather(1, got[:, None])).all()


def test_gumbel_argmax_public_entry_and_strided_rows(ops, device):
    logits, temperature, seeds, positions = _sampling_case(device, num_rows=8)
    wide = torch.full((8, VOCAB + 100), 1e9, device=device)  # a column slice: row stride != VOCAB
    wide[:, 50 : 50 + VOCAB] = logits
    got = ops.gumbel_argmax(wide[:, 50 : 50 + VOCAB], temperature, seeds, positions)
    assert torch.equal(got, reference.gumbel_argmax(logits, temperature, seeds, positions))


def test_noise_is_always_finite(device):
    """Regression: with 24 bits, (2**24 - 1 + 0.5) / 2**24 rounded to 1.0 and gave +inf noise (seed 3060, token 949)."""
    seeds = torch.cat([torch.tensor([INF_SEED]), torch.randint(-(2**62), 2**62, (63,))]).to(device)
    positions = torch.cat([torch.tensor([INF_POSITION]), torch.randint(0, 2**20, (63,))]).to(device)
    assert torch.isfinite(reference.gumbel_noise(seeds, positions, VOCAB)).all()
    assert torch.isfinite(gumbel_noise_triton(seeds, positions, VOCAB)).all()


def test_filtered_tokens_never_win(device):
    rows = 32
    seeds = torch.randint(-(2**62), 2**62, (rows,), device=device)
    positions = torch.randint(0, 2**20, (rows,), device=device)
    logits = torch.full((rows, VOCAB), float("-inf"), device=device)
    allowed = torch.tensor([3, BLOCK_V + 7, VOCAB - 1], device=device)  # survivors in three different tiles
    logits[:, allowed] = torch.randn(rows, 3, device=device)
    got = gumbel_argmax_split(logits, torch.full((rows,), 5.0, device=device), seeds, positions, 2)
    assert torch.isin(got, allowed).all()
    assert torch.equal(got, reference.gumbel_argmax(logits, torch.full((rows,), 5.0, device=device), seeds, positions))


def test_greedy_ties_and_all_filtered_rows(device):
    logits = torch.randn(4, VOCAB)
    logits[0, [100, BLOCK_V + 100, 2 * BLOCK_V + 3]] = 50.0  # equal maxima in three tiles: the first wins
    logits[1:3] = float("-inf")  # nothing left: token 0, as torch.argmax
    logits[3] = float("-inf")
    logits[3, VOCAB - 1] = -1e30  # the only candidate is the very last token
    temperature = torch.tensor([0.0, 0.0, 1.0, 1.0])
    seeds, positions = _rows(4, "cpu")
    for splits in (1, 3):
        got = gumbel_argmax_split(
            logits.to(device), temperature.to(device), seeds.to(device), positions.to(device), splits
        )
        assert got.tolist() == [100, 0, 0, VOCAB - 1]


def test_empty_batch(ops, device):
    empty_i64 = torch.zeros(0, dtype=torch.int64, device=device)
    got = ops.gumbel_argmax(torch.zeros(0, 10, device=device), torch.zeros(0, device=device), empty_i64, empty_i64)
    assert got.shape == (0,) and got.dtype == torch.int64


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(logits=a["logits"].double()), r"logits must be float32, got torch.float64"),
        (lambda a: a.update(logits=a["logits"][0]), r"logits must be \[B, V\]"),
        (lambda a: a.update(logits=a["logits"][:, :0]), r"logits has an empty vocabulary"),
        (lambda a: a.update(logits=a["logits"].t().contiguous().t()), r"logits must have a contiguous last dimension"),
        (lambda a: a.update(temperature=a["temperature"][:2]), r"temperature has 2 entries for 3 rows"),
        (lambda a: a.update(temperature=a["temperature"].half()), r"temperature must be float32"),
        (lambda a: a.update(seeds=a["seeds"].int()), r"seeds must be int64"),
        (lambda a: a.update(positions=a["positions"][:, None]), r"positions must be \[B\]"),
    ],
)
def test_gumbel_argmax_rejects_bad_arguments(ops, device, mutate, message):
    args = dict(logits=torch.randn(3, 40, device=device), temperature=torch.ones(3, device=device),
                seeds=torch.zeros(3, dtype=torch.int64, device=device),
                positions=torch.zeros(3, dtype=torch.int64, device=device))  # fmt: skip
    mutate(args)
    with pytest.raises(ValueError, match="^gumbel_argmax: " + message):
        ops.gumbel_argmax(**args)
