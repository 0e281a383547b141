"""End to end: seeded sampling with forks (n=2, so copy-on-write) on the Triton path gives the reference path's
tokens exactly: the kernel's Gumbel noise is bit-identical, and copy_blocks copies the shared block."""

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


def test_engine_sampling_with_forks_on_triton_matches_reference(checkpoint_factory, monkeypatch):
    folder = checkpoint_factory("qwen3")
    rng = random.Random(11)
    # 17 tokens: the forks share a partly filled second block, which the first new token copies on write.
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(17)] for _ in range(2)]
    params = [
        SamplingParams(n=2, max_tokens=4, temperature=0.9, seed=5, ignore_eos=True),
        SamplingParams(n=2, max_tokens=4, temperature=0.7, top_k=20, seed=6, ignore_eos=True),  # filters, then T=1
    ]
    engine_kwargs = dict(num_kv_blocks=16, block_size=16, max_num_batched_tokens=64)

    monkeypatch.setenv("PAGEDQ_KERNELS", "reference")
    expected = LLM(folder, **engine_kwargs).generate(prompts, params)
    monkeypatch.setenv("PAGEDQ_KERNELS", "triton")
    calls: dict[str, int] = {}
    for name in ("copy_blocks", "gumbel_argmax"):
        monkeypatch.setattr(triton_ops, name, _spy(calls, name, getattr(triton_ops, name)))
    got = LLM(folder, **engine_kwargs).generate(prompts, params)
    assert set(calls) == {"copy_blocks", "gumbel_argmax"}, calls
    tokens = [[c.token_ids for c in o.outputs] for o in got]
    assert tokens == [[c.token_ids for c in o.outputs] for o in expected]
    assert any(len(set(map(tuple, forks))) > 1 for forks in tokens)  # the forks really sampled apart
