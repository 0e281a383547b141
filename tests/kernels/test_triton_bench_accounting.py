"""The benchmark's byte/FLOP accounting, checked against tensors built independently, and its CPU exit."""

from __future__ import annotations

import json

import pytest
import torch

from pagedq.bench import kernels as bench
from pagedq.bench import kernels_lora


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_causal_pairs_counts_the_visible_mask_entries():
    q_lens, context_lens = [5, 1, 7, 3], [5, 9, 20, 3]
    expected = 0
    for q_len, context_len in zip(q_lens, context_lens):
        q_pos = torch.arange(context_len - q_len, context_len)
        expected += int((torch.arange(context_len)[None, :] <= q_pos[:, None]).sum())
    assert bench.causal_pairs(q_lens, context_lens) == expected
    assert bench.prefill_attention_flops(q_lens, context_lens, 32, 128) == 4 * 128 * 32 * expected


def test_decode_bytes_match_the_tensors_touched():
    context_lens, hq, hkv, d, bs = [1, 16, 17, 100], 8, 2, 64, 16
    kv_rows = torch.empty(sum(context_lens), hkv, d, dtype=torch.bfloat16)
    query = torch.empty(len(context_lens), hq, d, dtype=torch.bfloat16)
    used_table_entries = torch.empty(1 + 1 + 2 + 7, dtype=torch.int32)
    lens = torch.empty(len(context_lens), dtype=torch.int32)
    expected = 2 * _nbytes(kv_rows) + 2 * _nbytes(query) + _nbytes(used_table_entries, lens)
    assert bench.decode_attention_bytes(context_lens, hq, hkv, d, 2, bs) == expected


def test_elementwise_bytes_match_the_tensors_touched():
    t, h, hq, hkv, d, i = 3, 40, 4, 2, 16, 24
    x, weight = torch.empty(t, h, dtype=torch.bfloat16), torch.empty(h, dtype=torch.float32)
    out = torch.empty(t, h, dtype=torch.float32)
    assert bench.rms_norm_bytes(t, h, 2, 4, 4, True) == _nbytes(x, x, weight, out, x)
    assert bench.rms_norm_bytes(t, h, 2, 4, 4, False) == _nbytes(x, weight, out)
    heads, head_weight = torch.empty(t, hq, d, dtype=torch.float16), torch.empty(d, dtype=torch.float16)
    assert bench.head_rms_norm_bytes(t, hq, d, 2, 2, 2) == _nbytes(heads, head_weight, heads)
    q, k = torch.empty(t, hq, d, dtype=torch.bfloat16), torch.empty(t, hkv, d, dtype=torch.bfloat16)
    cos_sin_rows, positions = torch.empty(t, d, dtype=torch.float32), torch.empty(t, dtype=torch.int64)
    assert bench.rotary_bytes(t, hq, hkv, d, 2) == 2 * _nbytes(q, k) + _nbytes(cos_sin_rows, positions)
    gate_up, act = torch.empty(t, 2 * i, dtype=torch.bfloat16), torch.empty(t, i, dtype=torch.bfloat16)
    assert bench.silu_and_mul_bytes(t, i, 2) == _nbytes(gate_up, act)
    key, cache_rows = torch.empty(t, hkv, d, dtype=torch.float32), torch.empty(t, hkv, d, dtype=torch.bfloat16)
    slots = torch.empty(t, dtype=torch.int64)
    assert bench.store_kv_cache_bytes(t, hkv, d, 4, 2) == 2 * _nbytes(key, cache_rows) + _nbytes(slots)
    assert bench.copy_bytes(10, 4) == 80
    assert bench.matmul_flops(2, 3, 4) == 48


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_lora_bytes_match_the_tensors_touched():
    t, hidden, n, r, slots = 5, 12, 3, 4, 2
    x, a_used = torch.empty(t, hidden, dtype=torch.bfloat16), torch.empty(slots, n, r, hidden, dtype=torch.bfloat16)
    buf = torch.empty(n, t, r)
    assert kernels_lora.lora_shrink_bytes(t, hidden, n, r, slots, 2) == _nbytes(x, a_used, buf)
    out_sizes = (12, 4, 4)
    y, b_used = torch.empty(t, 20, dtype=torch.bfloat16), torch.empty(slots, 20, r, dtype=torch.bfloat16)
    assert kernels_lora.lora_expand_bytes(t, out_sizes, r, slots, 2) == _nbytes(buf, b_used, y, y)


def test_bench_without_gpu_exits_2(capsys):
    assert bench.main(["--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_cpu_bench_honours_its_flags(capsys):
    """pagedq bench kernels hands its flags to the benchmark (they were once dropped): each shows in the records."""
    from pagedq.bench.cli import main

    argv = ["kernels", "--device", "cpu", "--batch", "3", "--context-lens", "20", "33", "--heads", "4:2"]
    argv += ["--head-dim", "16", "--dtype", "bfloat16", "--repeats", "1", "--prefill-lens", "7", "5"]
    assert main(argv) == 0
    records = [json.loads(line[5:]) for line in capsys.readouterr().out.splitlines() if line.startswith("JSON ")]
    assert [r["shape"] for r in records] == [
        "S=3 ctx=20 Hq=4 Hkv=2 D=16 bfloat16",
        "S=3 ctx=33 Hq=4 Hkv=2 D=16 bfloat16",
        "S=2 q=7.. Hq=4 Hkv=2 D=16 bfloat16",
        "decode T=3 S=8 R=16 in/out 64/64+32+32, 64/64, 64/170+170, 170/64 bfloat16",
        "prefill T=12 S=8 R=16 in/out 64/64+32+32, 64/64, 64/170+170, 170/64 bfloat16",
    ]
    assert all(r["max_abs_diff_vs_reference"] < 2e-2 for r in records[:2])
    lora_records = records[3:]
    # a few tokens per adapter: the native kernel's case, timed next to the torch ops it replaces
    assert all(r["native_ms"] > 0 and r["torch_ops_ms"] > 0 for r in lora_records)
    assert all(r["max_abs_diff_vs_reference"] < 2e-2 for r in lora_records)


@pytest.mark.parametrize(
    "argv,message",
    [(["--device", "cuda", "--head-dim", "64"], "--head-dim applies to --device cpu only"),
     (["--device", "cpu", "--heads", "9:2"], "KV dividing Q"), (["--device", "cpu", "--batch", "0"], "--batch")],
)  # fmt: skip
def test_kernel_bench_refuses_flags_it_cannot_honour(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_bench_glue_runs_on_tiny_shapes(device, monkeypatch, capsys):
    """The CUDA-only driver code, run once per case on tiny shapes with the timer stubbed out."""
    monkeypatch.setattr(bench, "_time_ms", lambda fn: (fn(), 1.0)[1])
    bench.bench_decode(device, batch=2, context_len=20, copy_gbps=100.0)
    bench.bench_prefill(device, [5, 3], [0, 17], matmul_tflops=100.0)
    bench.bench_elementwise(device, 100.0, tokens=2, hidden=64, intermediate=64)
    bench.bench_lora(device, 100.0, hidden=32, kv_out=16, num_slots=2, cases=((3, 16),))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("JSON ")]
    assert len(lines) == 2 + 1 + 5 + 3  # LoRA: shrink, expand, their composition
    decode_vs_sdpa = json.loads(lines[1][5:])
    assert decode_vs_sdpa["max_abs_diff"] < 2e-2  # bf16 paged decode agrees with SDPA on gathered K/V
