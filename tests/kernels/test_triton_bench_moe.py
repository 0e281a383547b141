"""Bench accounting and glue for fused_moe (the other kernels: test_triton_bench_accounting)."""

from __future__ import annotations

import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from pagedq.bench import kernels as bench
from pagedq.bench import kernels_moe
from pagedq.kernels import reference


def test_fused_moe_flops_match_torchs_count_of_the_reference_matmuls():
    tokens, top_k, experts, hidden, inter = 3, 2, 4, 8, 5
    ids = torch.tensor([[0, 1], [1, 3], [3, 0]])
    with FlopCounterMode(display=False) as counter:
        reference.fused_moe(torch.randn(tokens, hidden), torch.randn(experts, 2 * inter, hidden),
                            torch.randn(experts, hidden, inter), torch.rand(tokens, top_k), ids)  # fmt: skip
    assert kernels_moe.fused_moe_flops(tokens, top_k, hidden, inter) == counter.get_total_flops()


def test_fused_moe_glue_runs_on_tiny_shapes(device, capsys):
    kernels_moe.bench_fused_moe(device, 100.0, lambda fn: (fn(), 1.0)[1], bench._report, [("tiny", 5, 4, 2, 64, 32)])
    lines = [json.loads(line[5:]) for line in capsys.readouterr().out.splitlines() if line.startswith("JSON ")]
    assert [line["kernel"] for line in lines] == ["fused_moe"]
    assert lines[0]["TFLOP/s"] == kernels_moe.fused_moe_flops(5, 2, 64, 32) / 1e-3 / 1e12
    assert lines[0]["max_abs_diff"] < 5e-2  # bf16 Triton and torch grouped paths agree
