"""Adapters the engine cannot serve: one clear error naming the problem, before anything reaches a slot; the engine
keeps serving. And the LoRA options' and names' bounds."""

from __future__ import annotations

import shutil

import pytest

from pagedq.engine import LLM, LoRARequest, RequestRejected, SamplingParams
from pagedq.engine.config.engine import EngineConfig
from pagedq.engine.lora.adapter import LoRALoadError
from tests.engine.lora_adapters import ALL, edit_config, write_adapter

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def served(checkpoint_factory, tmp_path_factory):
    checkpoint = checkpoint_factory("llama")
    good = write_adapter(checkpoint, tmp_path_factory.mktemp("good") / "a", ALL, rank=8, seed=1)
    llm = LLM(checkpoint, enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=16)
    return checkpoint, good, llm


def _copy(good, tmp_path):
    return shutil.copytree(good, tmp_path / "bad")


def _bad_adapters(checkpoint_factory, tmp_path, good):
    """(name, folder, what the error must say) for each kind of bad adapter."""

    def edited(**changes):
        return edit_config(_copy(good, tmp_path), **changes)

    def without(file_name):
        folder = _copy(good, tmp_path)
        (folder / file_name).unlink()
        return folder

    def other_model():  # qwen3's q_proj is 64 -> 128 (head_dim 32 x 4 heads); llama's is 64 -> 64
        return write_adapter(checkpoint_factory("qwen3"), tmp_path / "other", ALL, rank=4, seed=2)

    def rank_too_high():
        return write_adapter(checkpoint_factory("llama"), tmp_path / "r16", ALL, rank=16, seed=3)

    def truncated():
        folder = _copy(good, tmp_path)
        (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
        return folder

    return {
        "missing folder": (lambda: tmp_path / "nowhere", "no such folder"),
        "no config": (lambda: without("adapter_config.json"), "no adapter_config.json"),
        "no weights": (lambda: without("adapter_model.safetensors"), "no weights"),
        "corrupt weights": (truncated, "cannot read adapter_model.safetensors"),
        "rank above max_lora_rank": (rank_too_high, "rank 16 exceeds max_lora_rank 8"),
        "another base model": (other_model, "another base model"),
        "a target the model lacks": (lambda: edited(target_modules=["q_proj", "c_attn"]), "c_attn"),
        "lm_head target": (lambda: edited(target_modules=["lm_head"]), "lm_head"),
        "DoRA": (lambda: edited(use_dora=True), "DoRA"),
        "bias": (lambda: edited(bias="all"), "bias 'all'"),
        "modules_to_save": (lambda: edited(modules_to_save=["lm_head"]), "modules_to_save"),
        "fan_in_fan_out": (lambda: edited(fan_in_fan_out=True), "fan_in_fan_out"),
        "not LoRA": (lambda: edited(peft_type="IA3"), "peft_type"),
        "layer out of range": (lambda: edited(layers_to_transform=[0, 7]), "layer 7"),
        "bad json": (
            lambda: (_copy(good, tmp_path) / "adapter_config.json").write_text("{") and tmp_path / "bad",
            "not valid JSON",
        ),
    }


CASES = [
    "missing folder", "no config", "no weights", "corrupt weights", "rank above max_lora_rank", "another base model",
    "a target the model lacks", "lm_head target", "DoRA", "bias", "modules_to_save", "fan_in_fan_out", "not LoRA",
    "layer out of range", "bad json",
]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_bad_adapter_is_refused_naming_the_problem_and_the_engine_keeps_serving(
    served, checkpoint_factory, tmp_path, case
):
    _, good, llm = served
    make, words = _bad_adapters(checkpoint_factory, tmp_path, good)[case]
    bad = LoRARequest(f"bad-{case.replace(' ', '-')}", str(make()))
    with pytest.raises(LoRALoadError, match=words) as raised:
        llm.llm_engine.add_lora(bad)
    assert bad.name in str(raised.value)
    with pytest.raises(RequestRejected, match=words):  # a request naming it: rejected, nothing queued
        llm.generate([[5, 6, 7]], PARAMS, lora_request=bad)
    assert not llm.llm_engine.has_unfinished_requests()
    assert bad.name not in [lora.name for lora in llm.llm_engine.list_loras()]
    good_request = LoRARequest("good", str(good))
    first = llm.generate([[5, 6, 7]], PARAMS, lora_request=good_request)[0].outputs[0].token_ids
    assert len(first) == 4  # still serving, adapters and all


def test_a_name_already_loaded_from_another_path_is_refused(served, tmp_path):
    _, good, llm = served
    llm.llm_engine.add_lora(LoRARequest("same", str(good)))
    llm.llm_engine.add_lora(LoRARequest("same", str(good)))  # the same path again: nothing to do
    other = shutil.copytree(good, tmp_path / "copy")
    with pytest.raises(RequestRejected, match="already loaded from"):
        llm.generate([[5]], PARAMS, lora_request=LoRARequest("same", str(other)))


def test_an_engine_without_lora_refuses_a_request_naming_one(tiny_llama_dir, tmp_path):
    llm = LLM(tiny_llama_dir, num_kv_blocks=8)
    with pytest.raises(RequestRejected, match="enable_lora=True"):
        llm.generate([[5]], PARAMS, lora_request=LoRARequest("x", str(tmp_path)))
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.llm_engine.add_lora(LoRARequest("x", str(tmp_path)))
    assert llm.llm_engine.list_loras() == []


@pytest.mark.parametrize(
    "name,words",
    [("", "must not be empty"), ("x" * 129, "at most 128"), ("a b", "only letters"), ("-a", "starts with"),
     ("a\nb", "only letters"), (7, "must be a string")],
)  # fmt: skip
def test_lora_names_are_bounded(name, words):
    with pytest.raises(ValueError, match=words):
        LoRARequest(name, "/some/path")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        LoRARequest("ok", "")
    assert LoRARequest("org/adapter-v1.2_x", "/p").name == "org/adapter-v1.2_x"


@pytest.mark.parametrize(
    "options,words",
    [
        ({"max_lora_rank": 0}, "max_lora_rank must be an integer in \\[1, 256\\]"),
        ({"max_lora_rank": 257}, "max_lora_rank"),
        ({"max_loras": 0}, "max_loras"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras \\(2\\) must be >= max_loras \\(4\\)"),
        ({"enable_lora": "yes"}, "enable_lora"),
    ],
)
def test_lora_options_are_bounded(options, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(model="m", device="cpu", **options)
    assert EngineConfig(model="m", device="cpu", max_loras=3).max_cpu_loras == 3  # None: max_loras
