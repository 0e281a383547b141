"""LoRA adapters end to end on the Triton path (under the interpreter here; compiled on a GPU, where decode steps
replay CUDA graphs holding the LoRA kernels): a batch mixing two adapters and the base model gives the reference
path's greedy tokens, through the eager path and through the decode-graph runner's padded static buffers."""

from __future__ import annotations

import random

import pytest
import torch

from pagedq.engine import LLM, LoRARequest, SamplingParams
from pagedq.engine.runner.cuda_graphs import DecodeGraphRunner
from tests.conftest import VOCAB_SIZE
from tests.engine.lora_adapters import ALL, ATTENTION, write_random_adapter

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed(checkpoint_factory, tmp_path_factory):
    checkpoint = checkpoint_factory("llama")
    folder = tmp_path_factory.mktemp("kernel-adapters")
    a = LoRARequest("ka", str(write_random_adapter(checkpoint, folder / "ka", ALL, rank=8, seed=31)))
    b = LoRARequest("kb", str(write_random_adapter(checkpoint, folder / "kb", ATTENTION, rank=4, seed=32)))
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (9, 5, 7)]
    return checkpoint, prompts, [a, b, None]


def _engine_kwargs(device: str) -> dict:
    return dict(device=device, dtype="float32", num_kv_blocks=16, block_size=16, enable_lora=True, max_loras=2)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def expected(mixed, device) -> list[list[int]]:
    """Each request alone on the reference kernels."""
    checkpoint, prompts, loras = mixed
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDQ_KERNELS", "reference")
        llm = LLM(checkpoint, enforce_eager=True, **_engine_kwargs(device))
        return [_tokens(llm.generate([p], PARAMS, lora_request=lora))[0] for p, lora in zip(prompts, loras)]


def test_mixed_adapters_on_triton_kernels_match_the_reference(mixed, expected, device, monkeypatch):
    checkpoint, prompts, loras = mixed
    monkeypatch.setenv("PAGEDQ_KERNELS", "triton")
    llm = LLM(checkpoint, enforce_eager=True, **_engine_kwargs(device))
    assert llm.llm_engine.model_runner.kernels.backend == "triton"
    assert _tokens(llm.generate(prompts, PARAMS, lora_request=loras)) == expected
    assert len({tuple(t) for t in expected}) == 3  # the two adapters and the base model differ


def test_decode_graphs_with_adapters_match_the_reference(mixed, expected, device, monkeypatch):
    """On a GPU the engine captures its decode graphs with the LoRA kernels in them; without one, the same padded
    static-buffer path runs eagerly (capture=False)."""
    checkpoint, prompts, loras = mixed
    monkeypatch.setenv("PAGEDQ_KERNELS", "triton")
    llm = LLM(checkpoint, max_num_seqs=4, **_engine_kwargs(device))
    runner = llm.llm_engine.model_runner
    if runner.decode_graphs is None:  # no CUDA: the padded path, uncaptured
        runner.decode_graphs = DecodeGraphRunner(
            runner.model,
            runner.kv_caches,
            runner.config.max_num_seqs,
            -(-runner.max_model_len // runner.block_size),
            runner.block_size,
            runner.device,
            capture=False,
            lora=runner.lora,
        )
    assert runner.decode_graphs.lora is runner.lora
    got = _tokens(llm.generate(prompts, PARAMS, lora_request=loras))
    assert llm.stats()["num_graph_steps"] >= PARAMS.max_tokens - 1  # decode steps went through the graph runner
    assert got == expected
    # and a base-only batch through the same graphs (no adapter token: the LoRA kernels skip every slot)
    base = _tokens(llm.generate(prompts[:2], PARAMS))
    monkeypatch.setenv("PAGEDQ_KERNELS", "reference")
    plain = LLM(checkpoint, enforce_eager=True, device=device, dtype="float32", num_kv_blocks=16, block_size=16)
    assert base == _tokens(plain.generate(prompts[:2], PARAMS))
    assert torch.device(device).type == runner.device.type
