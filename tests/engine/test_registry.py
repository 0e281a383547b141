"""The model registry: architecture name -> model class. A new architecture is a model file plus one entry."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedq.engine import LLM, SamplingParams
from pagedq.engine.config.engine import ModelConfig
from pagedq.engine.models import registry
from pagedq.engine.models.gemma import GemmaForCausalLM
from pagedq.engine.models.llama import LlamaForCausalLM


class RecordingLlama(LlamaForCausalLM):
    """Stands for a new architecture's model file: the Llama tree, counting how often it is built."""

    built = 0

    def __init__(self, config, ops) -> None:
        super().__init__(config, ops)
        RecordingLlama.built += 1


def test_the_registry_serves_every_supported_architecture():
    gemmas = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}  # their own module tree
    assert all(registry.model_class(name) is GemmaForCausalLM for name in gemmas)
    assert set(registry.supported_architectures()) - gemmas == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        # mixture of experts
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "GptOssForCausalLM",
    }
    assert all(
        registry.model_class(name) is LlamaForCausalLM for name in set(registry.supported_architectures()) - gemmas
    )
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        registry.model_class("GPT2LMHeadModel")


def test_a_registered_architecture_is_built_by_the_loader(tiny_llama_dir, tmp_path, monkeypatch):
    folder = shutil.copytree(tiny_llama_dir, tmp_path / "custom")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["RecordingLlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'RecordingLlamaForCausalLM'"):
        ModelConfig.from_pretrained(folder)

    monkeypatch.setitem(registry._MODELS, "RecordingLlamaForCausalLM", (__name__, "RecordingLlama"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    custom = LLM(folder, num_kv_blocks=8)
    assert RecordingLlama.built == 1 and type(custom.llm_engine.model_runner.model) is RecordingLlama
    expected = LLM(tiny_llama_dir, num_kv_blocks=8).generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    assert custom.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids == expected
