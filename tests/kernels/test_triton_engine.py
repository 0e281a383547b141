"""End to end: the engine on the Triton path (under the interpreter here) gives the reference path's greedy tokens."""

from __future__ import annotations

import random

from pagedq.engine import LLM, SamplingParams
from pagedq.kernels import triton_ops
from tests.conftest import VOCAB_SIZE


def _spy(calls: dict[str, int], name: str, impl):
    """impl, counting its calls in calls[name]."""

    def spy(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return impl(*args, **kwargs)

    return spy


def test_engine_on_triton_kernels_matches_reference(checkpoint_factory, monkeypatch):
    folder = checkpoint_factory("qwen3")  # Qwen3 also exercises the per-head q/k norm
    rng = random.Random(9)
    # A 17-token prompt crosses a block boundary; the 5-token one decodes beside its prefill chunks.
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (17, 5)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine_kwargs = dict(num_kv_blocks=16, block_size=16, max_num_batched_tokens=12)

    monkeypatch.setenv("PAGEDQ_KERNELS", "reference")
    expected = LLM(folder, **engine_kwargs).generate(prompts, params)
    monkeypatch.setenv("PAGEDQ_KERNELS", "triton")
    calls: dict[str, int] = {}
    for name in triton_ops.__all__:  # count calls, so the test proves the Triton path really ran
        monkeypatch.setattr(triton_ops, name, _spy(calls, name, getattr(triton_ops, name)))
    got = LLM(folder, **engine_kwargs).generate(prompts, params)
    # copy_blocks and gumbel_argmax need forks and sampling: test_triton_engine_sampling covers them; Qwen3's MLP is
    # SwiGLU, not Gemma's GeGLU (gelu_tanh_and_mul: tests/kernels/test_triton_elementwise.py); fused_moe needs a
    # mixture-of-experts model (tests/kernels/test_triton_engine_moe.py)
    # other families' kernels, and LoRA's (tests/kernels/test_lora_engine.py)
    unused = {"copy_blocks", "gumbel_argmax", "gelu_tanh_and_mul", "fused_moe", "lora_shrink", "lora_expand"}
    unused.add("lora_add")
    assert set(calls) == set(triton_ops.__all__) - unused, calls
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_gemma3_on_triton_kernels_matches_reference(checkpoint_factory, monkeypatch):
    """Gemma 3 on the Triton path: GeGLU, the (1 + weight) norms and per-head q/k norms, sliding and global layers,
    a prompt past the window of 8."""
    folder = checkpoint_factory("gemma3")
    rng = random.Random(11)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (19, 6)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine_kwargs = dict(num_kv_blocks=16, block_size=16, max_num_batched_tokens=12)

    monkeypatch.setenv("PAGEDQ_KERNELS", "reference")
    expected = LLM(folder, **engine_kwargs).generate(prompts, params)
    monkeypatch.setenv("PAGEDQ_KERNELS", "triton")
    calls: dict[str, int] = {}
    for name in ("gelu_tanh_and_mul", "rms_norm", "head_rms_norm", "paged_decode_attention", "paged_prefill_attention"):
        monkeypatch.setattr(triton_ops, name, _spy(calls, name, getattr(triton_ops, name)))
    got = LLM(folder, **engine_kwargs).generate(prompts, params)
    assert len(calls) == 5, calls
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
