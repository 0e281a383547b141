"""Gemma 2 and Gemma 3 (text) against transformers: greedy parity with prefix caching, prompt logprobs of tied
checkpoints, the (1 + weight) norm and the embedding scale in bf16, and the configs we refuse.

(tests/engine/test_parity.py runs both families through chunked prefill and preemption, as every architecture.)
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from pagedq import kernels
from pagedq.engine import LLM, SamplingParams
from pagedq.engine.config.engine import ModelConfig
from pagedq.engine.layers import rope_cos_sin_cache
from pagedq.engine.layers.norm import GemmaRMSNorm
from pagedq.engine.models.loader import load_model
from tests.conftest import VOCAB_SIZE, _tiny_config, build_tokenizer, randomize_norms
from tests.engine.parity import assert_greedy_parity, hf_greedy

GEMMAS = ("gemma2", "gemma3")
HF_CLASSES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
WINDOW = 8  # the tiny configs' sliding window: every prompt here is longer


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


def _build(folder: Path, architecture: str, **overrides) -> Path:
    """A tiny checkpoint of `architecture`, its config changed by `overrides`, norms random."""
    config = _tiny_config(architecture)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = getattr(transformers, HF_CLASSES[architecture])(config)
    randomize_norms(model)
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def _hf(folder: Path, **config_overrides):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **config_overrides)
    return model.eval()


@pytest.mark.parametrize("architecture", GEMMAS)
def test_the_test_checkpoints_exercise_windows_caps_and_local_rope(checkpoint_factory, architecture):
    """Each feature the parity tests claim to cover changes transformers' own logits on these checkpoints."""
    folder = checkpoint_factory(architecture)
    prompt = torch.tensor([_prompt(40, seed=1)])
    with torch.no_grad():
        base = _hf(folder)(prompt).logits
        changes = {"sliding_window": 1000}
        if architecture == "gemma2":
            changes |= {"attn_logit_softcapping": None, "final_logit_softcapping": None}
        for name, value in changes.items():
            assert not torch.allclose(_hf(folder, **{name: value})(prompt).logits, base, atol=1e-3), name
        if architecture == "gemma3":
            rope = _tiny_config("gemma3").rope_parameters
            same_base = {**rope, "sliding_attention": rope["full_attention"]}
            assert not torch.allclose(_hf(folder, rope_parameters=same_base)(prompt).logits, base, atol=1e-3)


@pytest.mark.parametrize("architecture", GEMMAS)
def test_greedy_parity_with_prefix_caching_chunks_and_preemption(checkpoint_factory, architecture):
    folder = checkpoint_factory(architecture)
    hf = _hf(folder)
    prefix = _prompt(3 * WINDOW, seed=2)  # three blocks of 8, and longer than the window
    prompts = [prefix + _prompt(n, seed=n) for n in (3, 9, 17)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(folder, block_size=8, num_kv_blocks=10, max_num_batched_tokens=16, max_num_seqs=4)
    first = llm.generate(prompts[:1], params)  # caches the prefix's blocks
    rest = llm.generate(prompts[1:], params)
    stats = llm.stats()
    assert stats["prefix_cache_hit_rate"] > 0 and stats["num_preemptions"] > 0
    ties = 0
    for prompt, output in zip(prompts, first + rest):
        expected, logits = hf_greedy(hf, prompt, 24)
        ties += assert_greedy_parity(output.outputs[0].token_ids, expected, logits)
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"


def _assert_prompt_logprobs_match(prompt: list[int], entries: list, hf, k: int) -> None:
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        assert set(entries[j]) == set(reference[j - 1].topk(k).indices.tolist()) | {prompt[j]}, j
        for token_id, logprob in entries[j].items():
            assert logprob == pytest.approx(reference[j - 1, token_id].item(), abs=1e-4)


@pytest.mark.parametrize("architecture", GEMMAS)
def test_prompt_logprobs_of_tied_checkpoints_match_transformers(tmp_path, architecture):
    """Tied embeddings, as Gemma ships (no lm_head in the file); chunks of 8, a cached prefix, preemption."""
    folder = _build(tmp_path, architecture, tie_word_embeddings=True)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" not in handle.keys()  # noqa: SIM118  (safe_open handles do not iterate)
    hf = _hf(folder)
    prompts = [_prompt(n, seed=n) for n in (40, 35, 30)]
    llm = LLM(folder, max_num_batched_tokens=8, num_kv_blocks=10, block_size=8)
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    for prompt, output in zip(prompts, outputs):
        _assert_prompt_logprobs_match(prompt, output.prompt_logprobs, hf, 3)
    assert llm.generate(prompts[1], dataclasses.replace(params, prompt_logprobs=None))[0].prompt_logprobs is None


@pytest.mark.parametrize("hf_norm", [Gemma2RMSNorm, Gemma3RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemma_norm_is_transformers_bit_for_bit(hf_norm, dtype):
    theirs = hf_norm(96, eps=1e-6)
    ours = GemmaRMSNorm(96, 1e-6, kernels.bind("cpu"))
    with torch.no_grad():
        # weights of 1e-3 and below: 1 + weight rounds to 1 in bf16, so adding it in bf16 would show
        theirs.weight.copy_(torch.randn(96) * 1e-3)
        ours.weight.copy_(theirs.weight)
    theirs.to(dtype), ours.to(dtype)
    x, residual = (torch.randn(7, 96) * 3).to(dtype), torch.randn(7, 96).to(dtype)
    normed, new_residual = ours(x, residual)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(normed, theirs(residual + x))
    heads = x.view(7, 6, 16)
    theirs_heads = hf_norm(16, eps=1e-6).to(dtype)
    ours_heads = GemmaRMSNorm(16, 1e-6, kernels.bind("cpu")).to(dtype)
    with torch.no_grad():
        theirs_heads.weight.copy_(torch.randn(16))
        ours_heads.weight.copy_(theirs_heads.weight)
    assert torch.equal(ours_heads.per_head(heads), theirs_heads(heads))
    if dtype == torch.bfloat16:  # the test can tell: scaling by a bf16 (1 + weight) gives other values
        row = x.float()
        naive = (row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * (1 + ours.weight)
        assert not torch.equal(naive, ours(x)[0])


@pytest.mark.parametrize("architecture", GEMMAS)
def test_bf16_load_scales_embeddings_as_transformers_and_keeps_rope_tables_fp32(checkpoint_factory, architecture):
    folder = checkpoint_factory(architecture)
    config = ModelConfig.from_pretrained(folder)
    ours = load_model(folder, config, torch.bfloat16, "cpu")
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ids = torch.tensor(_prompt(32, seed=3))
    with torch.no_grad():
        assert torch.equal(ours.model.embed_tokens(ids) * ours.embed_scale, theirs.model.embed_tokens(ids[None])[0])
    tables = [ours.cos_sin_cache] + ([ours.local_cos_sin_cache] if architecture == "gemma3" else [])
    assert ours.local_cos_sin_cache is None or architecture == "gemma3"
    assert all(table.dtype == torch.float32 for table in tables)
    if architecture == "gemma3":
        assert not torch.equal(ours.cos_sin_cache, ours.local_cos_sin_cache)
        assert ours.model.layers[0].self_attn.scale == 16**-0.5
    else:
        assert ours.model.layers[0].self_attn.scale == 24**-0.5


def _save_config(folder: Path, architecture: str):
    config = _tiny_config(architecture)
    config.architectures = [HF_CLASSES[architecture]]
    config.save_pretrained(folder)


def test_config_only_folder_gets_identity_norms(tmp_path):
    _save_config(tmp_path, "gemma3")
    model = load_model(tmp_path, ModelConfig.from_pretrained(tmp_path), torch.float32, "cpu")
    norms = [m for m in model.modules() if isinstance(m, GemmaRMSNorm)]
    assert len(norms) == 4 * 4 + 4 * 2 + 1  # four per layer, q and k per layer, the final one
    assert all(not norm.weight.any() for norm in norms)


def test_gemma3_old_config_json_rope_local_base_freq_sets_the_local_table(tmp_path):
    """Older Gemma 3 config.json files write rope_theta and rope_local_base_freq, no rope_parameters."""
    _save_config(tmp_path, "gemma3")
    path = tmp_path / "config.json"
    old = {k: v for k, v in json.loads(path.read_text()).items() if k != "rope_parameters"}
    path.write_text(json.dumps({**old, "rope_theta": 200000.0, "rope_local_base_freq": 500.0}))
    config = ModelConfig.from_pretrained(tmp_path)

    def table(base: float) -> torch.Tensor:
        inv_freq = 1.0 / (base ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
        freqs = torch.arange(config.max_position_embeddings, dtype=torch.float)[:, None] * inv_freq[None, :]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    assert torch.equal(rope_cos_sin_cache(config, "sliding_attention"), table(500.0))
    assert torch.equal(rope_cos_sin_cache(config, "full_attention"), table(200000.0))


def test_gemma3_attention_takes_no_softcap_whatever_its_config_says(tmp_path):
    """transformers' Gemma3Attention never passes attn_logit_softcapping to its attention function; nor do we."""
    folder = _build(tmp_path, "gemma3", attn_logit_softcapping=1.0)
    assert transformers.AutoConfig.from_pretrained(folder).attn_logit_softcapping == 1.0
    assert ModelConfig.from_pretrained(folder).attn_logit_softcapping is None
    prompt = _prompt(30, seed=8)
    output = LLM(folder).generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    _assert_prompt_logprobs_match(prompt, output.prompt_logprobs, _hf(folder), 2)


def test_a_gemma_config_json_with_a_stale_hidden_act_loads(tmp_path):
    """Google's Gemma 2 config.json carries hidden_act beside hidden_activation; transformers reads the latter."""
    _save_config(tmp_path, "gemma2")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "hidden_act": "gelu_pytorch_tanh"}))
    assert ModelConfig.from_pretrained(tmp_path).hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize(
    "architecture,overrides,message",
    [
        (
            "gemma2",
            {"hidden_activation": "gelu"},
            r"unsupported hidden_activation 'gelu'; supported: gelu_pytorch_tanh \(for Gemma2ForCausalLM\)",
        ),
        ("gemma3", {"use_bidirectional_attention": True}, r"use_bidirectional_attention .* is not supported"),
        ("gemma2", {"query_pre_attn_scalar": 0}, r"query_pre_attn_scalar must be a number in \(0, 1e6\]"),
        ("gemma3", {"final_logit_softcapping": -1.0}, r"final_logit_softcapping must be a number in \(0, 1e6\]"),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                    "full_attention": {"rope_type": "proportional", "rope_theta": 1e6},
                }
            },
            r"unsupported rope type 'proportional'",
        ),
    ],
)
def test_unsupported_gemma_configs_are_refused_by_name(tmp_path, architecture, overrides, message):
    _save_config(tmp_path, architecture)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **overrides}))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(tmp_path)
