"""End to end: a mixture-of-experts model on the Triton path (under the interpreter here) gives the reference
path's greedy tokens, its expert blocks on the fused MoE kernel."""

from __future__ import annotations

from pagedq.engine import LLM, SamplingParams
from pagedq.kernels import triton_ops
from tests.conftest import random_tokens
from tests.kernels.test_triton_engine import _spy


def test_moe_engine_on_triton_kernels_matches_reference(checkpoint_factory, monkeypatch):
    folder = checkpoint_factory("qwen3_moe")  # sparse layers 0 and 2, dense layer 1, q/k norm
    prompts = [random_tokens(17, seed=1), random_tokens(5, seed=2)]  # a prefill chunk beside a decode
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine_kwargs = dict(num_kv_blocks=16, block_size=16, max_num_batched_tokens=12)

    monkeypatch.setenv("PAGEDQ_KERNELS", "reference")
    expected = LLM(folder, **engine_kwargs).generate(prompts, params)
    monkeypatch.setenv("PAGEDQ_KERNELS", "triton")
    calls: dict[str, int] = {}
    monkeypatch.setattr(triton_ops, "fused_moe", _spy(calls, "fused_moe", triton_ops.fused_moe))
    got = LLM(folder, **engine_kwargs).generate(prompts, params)
    assert calls["fused_moe"] >= 2 * 6  # two sparse layers, every step
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_gpt_oss_on_triton_kernels_matches_reference(checkpoint_factory, monkeypatch):
    """gpt-oss: sinks and a sliding window (12) in the Triton attention kernels, expert biases and the clamped SwiGLU
    in the fused MoE kernel; prompts past the window."""
    folder = checkpoint_factory("gpt_oss")
    prompts = [random_tokens(21, seed=3), random_tokens(5, seed=4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine_kwargs = dict(num_kv_blocks=16, block_size=8, max_num_batched_tokens=12)

    monkeypatch.setenv("PAGEDQ_KERNELS", "reference")
    expected = LLM(folder, **engine_kwargs).generate(prompts, params)
    monkeypatch.setenv("PAGEDQ_KERNELS", "triton")
    calls: dict[str, int] = {}
    monkeypatch.setattr(triton_ops, "fused_moe", _spy(calls, "fused_moe", triton_ops.fused_moe))
    got = LLM(folder, **engine_kwargs).generate(prompts, params)
    assert calls["fused_moe"] >= 4 * 6  # four sparse layers, every step
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
