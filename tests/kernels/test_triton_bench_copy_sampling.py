"""Bench accounting and glue for copy_blocks and gumbel_argmax (the other kernels: test_triton_bench_accounting)."""

from __future__ import annotations

import json

import torch

from pagedq.bench import kernels as bench


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_copy_and_sampling_bytes_match_the_tensors_touched():
    pairs, caches, block = 5, 6, torch.empty(16, 2, 64, dtype=torch.bfloat16)
    mapping = torch.empty(pairs, 2, dtype=torch.int64)
    expected = 2 * pairs * caches * _nbytes(block) + _nbytes(mapping)
    assert bench.copy_blocks_bytes(pairs, caches, block.numel(), 2) == expected
    rows, vocab = 3, 1000
    logits, temps = torch.empty(rows, vocab), torch.empty(rows)
    seeds, positions, out = (torch.empty(rows, dtype=torch.int64) for _ in range(3))
    assert bench.gumbel_argmax_bytes(rows, vocab) == _nbytes(logits, temps, seeds, positions, out)


def test_copy_and_sampling_glue_runs_on_tiny_shapes(device, monkeypatch, capsys):
    monkeypatch.setattr(bench, "_time_ms", lambda fn: (fn(), 1.0)[1])
    bench.bench_copy_and_sampling(device, 100.0, num_layers=2, num_pairs=3, vocab_size=300, sample_rows=(2,))
    lines = [json.loads(line[5:]) for line in capsys.readouterr().out.splitlines() if line.startswith("JSON ")]
    assert [line["kernel"] for line in lines] == ["copy_blocks", "gumbel_argmax"]
    assert lines[1]["same_as_torch"] is True
