"""The kernel backend is bound once, when the model is built; a Triton kernel that is missing raises."""

from __future__ import annotations

import pytest
import torch

from pagedq import kernels
from pagedq.engine import LLM, SamplingParams
from pagedq.kernels import reference, triton_ops


def _spy(calls: dict[str, int], name: str, impl):
    """impl, counting its calls in calls[name]."""

    def spy(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return impl(*args, **kwargs)

    return spy


def _count_triton_calls(monkeypatch) -> dict[str, int]:
    calls: dict[str, int] = {}
    for name in triton_ops.__all__:
        monkeypatch.setattr(triton_ops, name, _spy(calls, name, getattr(triton_ops, name)))
    return calls


@pytest.mark.parametrize("built_with,changed_to", [("reference", "triton"), ("triton", "reference")])
def test_the_backend_chosen_at_build_time_stays(tiny_llama_dir, monkeypatch, built_with, changed_to):
    calls = _count_triton_calls(monkeypatch)
    monkeypatch.setenv("PAGEDQ_KERNELS", built_with)
    # eager: on a GPU, decode steps otherwise replay CUDA graphs captured at build, and a replay calls no Python
    llm = LLM(tiny_llama_dir, num_kv_blocks=8, block_size=16, enforce_eager=True)
    calls.clear()
    monkeypatch.setenv("PAGEDQ_KERNELS", changed_to)  # read once, at build: changing it now changes nothing
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.8, seed=1))
    if built_with == "reference":
        assert calls == {}
    else:
        assert {"rms_norm", "paged_prefill_attention", "paged_decode_attention", "gumbel_argmax"} <= set(calls)
    assert llm.llm_engine.model_runner.kernels.backend == built_with


def test_bind_resolves_each_backend(monkeypatch):
    monkeypatch.delenv("PAGEDQ_KERNELS", raising=False)
    bound = kernels.bind(torch.device("cpu"))
    assert bound.backend == "cpu" and bound.rms_norm is reference.rms_norm
    assert kernels.bind("cuda").backend == "triton"  # default on CUDA, resolved without a GPU
    assert all(getattr(kernels.bind("cuda"), name) is getattr(triton_ops, name) for name in kernels.KERNEL_NAMES)


def test_a_missing_triton_kernel_raises_instead_of_falling_back(tiny_llama_dir, monkeypatch):
    monkeypatch.delattr(triton_ops, "silu_and_mul")
    monkeypatch.setenv("PAGEDQ_KERNELS", "triton")
    with pytest.raises(NotImplementedError, match="silu_and_mul"):
        kernels.silu_and_mul(torch.randn(2, 8))  # the per-call functions raise too, never use the reference
    monkeypatch.delenv("PAGEDQ_KERNELS")
    with pytest.raises(NotImplementedError, match="silu_and_mul"):
        kernels.bind("cuda")
    monkeypatch.setenv("PAGEDQ_KERNELS", "triton")
    with pytest.raises(NotImplementedError, match="silu_and_mul"):
        LLM(tiny_llama_dir, num_kv_blocks=8)  # refused when the model is built, not at its first step
    monkeypatch.setenv("PAGEDQ_KERNELS", "reference")
    assert LLM(tiny_llama_dir, num_kv_blocks=8).llm_engine.model_runner.kernels.backend == "reference"


def test_an_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv("PAGEDQ_KERNELS", "cuda-magic")
    with pytest.raises(ValueError, match="PAGEDQ_KERNELS"):
        kernels.bind("cpu")
