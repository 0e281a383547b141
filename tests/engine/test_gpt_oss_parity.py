"""gpt-oss (GptOssForCausalLM) against transformers' eager path (the one with the sinks) in fp32: a tiny checkpoint
of 4 layers alternating sliding (window 12) and full attention, sinks, q/k/v/o biases, 8 experts top-2 with biases
and the clamped SwiGLU (biases large enough that the clamps act), YaRN. Greedy token-exact past the window through
chunked prefill, recompute and swap preemption and a prefix-cache hit; prompt logprobs within 1e-4; every expert
hit; the interleaved gate/up checkpoint layout; and the checkpoints refused before any weight loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedq.engine import LLM, SamplingParams
from pagedq.engine.config.engine import ModelConfig
from pagedq.engine.layers.moe import SparseMoeBlock, route
from pagedq.kernels.reference import SWIGLU_OAI_LIMIT
from tests.conftest import random_tokens
from tests.engine.parity import assert_greedy_parity, hf_greedy

NEW_TOKENS = 24
WINDOW = 12  # tests/conftest.py _tiny_gpt_oss_config


@pytest.fixture(scope="module")
def gpt_oss(checkpoint_factory) -> Path:
    return checkpoint_factory("gpt_oss")


@pytest.fixture(scope="module")
def hf(gpt_oss):
    return AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32, attn_implementation="eager").eval()


def _greedy_parity(llm: LLM, hf, prompts: list[list[int]]) -> None:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    ties = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        expected, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        ties += assert_greedy_parity(output.outputs[0].token_ids, expected, logits)
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"


def test_the_config_reads_gpt_oss_options(gpt_oss):
    config = ModelConfig.from_pretrained(gpt_oss)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2 and config.sliding_window == WINDOW
    assert config.attention_sinks and config.qkv_bias and config.o_proj_bias
    moe = config.moe
    assert moe is not None and (moe.num_experts, moe.num_experts_per_tok, moe.sparse_layers) == (8, 2, (0, 1, 2, 3))
    assert (moe.scoring, moe.biases, moe.activation) == ("topk_softmax", True, "swiglu_oai") and moe.interleaved_gate_up
    assert config.max_position_embeddings == 128 * 4  # YaRN: original_max_position_embeddings * factor


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_parity_past_the_window_chunked_preempted_and_prefix_cached(gpt_oss, hf, preemption_mode):
    prompts = [random_tokens(n, seed=n) for n in (5, 13, 30, 47, 61)]
    shared = prompts[3][:40]  # cached by a first request, then the prefix of a later prompt
    prompts.append(shared + random_tokens(9, seed=3))
    # six requests of up to 85 tokens in 16-token chunks on 24 blocks of 8 (full tables: the full layers read all)
    llm = LLM(gpt_oss, block_size=8, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=8,
              enable_prefix_caching=True, preemption_mode=preemption_mode)  # fmt: skip
    model = llm.llm_engine.model_runner.model
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
    hits = {name: torch.zeros(8, dtype=torch.long) for name in blocks}

    def counter(name: str):
        def record(_module, _inputs, logits: torch.Tensor) -> None:
            _, ids = route(logits, blocks[name].moe)
            hits[name] += torch.bincount(ids.flatten(), minlength=8)

        return record

    for name, block in blocks.items():
        block.gate.register_forward_hook(counter(name))
    assert len(blocks) == 4
    llm.generate([prompts[3]], SamplingParams(max_tokens=1, temperature=0.0))
    _greedy_parity(llm, hf, prompts)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    for name, counts in hits.items():
        assert (counts > 0).all(), f"{name}: experts never chosen: {(counts == 0).nonzero().flatten().tolist()}"


def test_the_swiglu_clamps_act_in_this_checkpoint(hf):
    """The parity above covers the clamped SwiGLU only if the clamps change something: transformers' own experts see
    gate values above the limit and up values beyond +-limit for these prompts."""
    seen = {"gate": 0, "up": 0}
    experts = hf.model.layers[0].mlp.experts
    apply_gate = experts._apply_gate

    def spy(gate_up: torch.Tensor) -> torch.Tensor:
        seen["gate"] += int((gate_up[..., ::2] > SWIGLU_OAI_LIMIT).sum())
        seen["up"] += int((gate_up[..., 1::2].abs() > SWIGLU_OAI_LIMIT).sum())
        return apply_gate(gate_up)

    experts._apply_gate = spy
    try:
        with torch.no_grad():
            hf(torch.tensor([random_tokens(47, seed=47)]))
    finally:
        del experts._apply_gate
    assert seen["gate"] > 0 and seen["up"] > 0, seen


def test_prompt_logprobs_past_the_window(gpt_oss, hf):
    prompts = [random_tokens(n, seed=100 + n) for n in (41, 64)]
    llm = LLM(gpt_oss, block_size=8, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
        entries = output.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        for j in range(1, len(prompt)):
            assert set(entries[j]) == set(reference[j - 1].topk(2).indices.tolist()) | {prompt[j]}, j
            for token_id, logprob in entries[j].items():
                assert logprob == pytest.approx(reference[j - 1, token_id].item(), abs=1e-4)


def test_interleaved_experts_load_into_gate_then_up_rows(gpt_oss, hf):
    """Our stacked experts hold transformers' de-interleaved: w13[e] rows = gate columns (even), then up (odd)."""
    ours = LLM(gpt_oss).llm_engine.model_runner.model.model.layers[1].mlp.experts
    theirs = hf.model.layers[1].mlp.experts
    gate_up, bias = theirs.gate_up_proj.detach(), theirs.gate_up_proj_bias.detach()
    assert torch.equal(ours.w13, torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), dim=-1).transpose(1, 2))
    assert torch.equal(ours.w13_bias, torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=-1))
    assert torch.equal(ours.w2, theirs.down_proj.detach().transpose(1, 2))
    assert torch.equal(ours.w2_bias, theirs.down_proj_bias.detach())


def test_mxfp4_and_other_swiglu_settings_are_refused_before_weights_load(gpt_oss, tmp_path):
    config = json.loads((gpt_oss / "config.json").read_text())
    cases = (
        ({"quantization_config": {"quant_method": "mxfp4"}}, r"quant_method 'mxfp4'.*dequantize"),
        ({"swiglu_limit": 10.0}, r"unsupported swiglu_limit 10\.0"),
        ({"swiglu_alpha": 1.0}, r"unsupported swiglu_alpha 1\.0"),
    )
    for i, (change, message) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        (folder / "model.safetensors").write_bytes(b"not weights: never opened")
        with pytest.raises(ValueError, match=message):
            LLM(folder)


def test_a_missing_or_misshapen_gpt_oss_tensor_is_named(gpt_oss, tmp_path):
    tensors = load_file(gpt_oss / "model.safetensors")
    for missing in ("model.layers.2.self_attn.sinks", "model.layers.1.mlp.experts.down_proj_bias"):
        folder = tmp_path / missing
        folder.mkdir()
        (folder / "config.json").write_bytes((gpt_oss / "config.json").read_bytes())
        save_file({k: v for k, v in tensors.items() if k != missing}, folder / "model.safetensors")
        stem = missing.rpartition(".")[0].replace(".", r"\.")
        with pytest.raises(ValueError, match=rf"checkpoint is missing \d+ tensors.*{stem}"):
            LLM(folder)
    for name, tensor in (
        ("model.layers.0.mlp.experts.gate_up_proj", tensors["model.layers.0.mlp.experts.gate_up_proj"][:7]),
        ("model.layers.0.mlp.experts.down_proj_bias", tensors["model.layers.0.mlp.experts.down_proj_bias"][0]),
    ):
        folder = tmp_path / f"bad-{name}"
        folder.mkdir()
        (folder / "config.json").write_bytes((gpt_oss / "config.json").read_bytes())
        save_file({**tensors, name: tensor.contiguous()}, folder / "model.safetensors")
        with pytest.raises(ValueError, match=rf"checkpoint tensor {re.escape(name)} has shape"):
            LLM(folder)


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(gpt_oss, hf):
    """bf16 serving (the released weights' dtype) is not token-exact to anything; its oracle is its error: our bf16
    prompt logprobs stray from transformers' fp32 ones no further on average than transformers' own bf16 do."""
    hf16 = AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.bfloat16, attn_implementation="eager").eval()
    prompts = [random_tokens(n, seed=300 + n) for n in (41, 64)]
    llm = LLM(gpt_oss, dtype="bfloat16", block_size=8, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    ours, theirs = [], []
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            fp32 = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
            bf16 = torch.log_softmax(hf16(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for j in range(1, len(prompt)):
            token = prompt[j]
            ours.append(abs(output.prompt_logprobs[j][token] - fp32[j - 1, token].item()))
            theirs.append(abs(bf16[j - 1, token].item() - fp32[j - 1, token].item()))
    assert sum(ours) / len(ours) <= 1.25 * sum(theirs) / len(theirs), (max(ours), max(theirs))


# openai/gpt-oss-20b's config.json as the hub has it (rope_scaling in the pre-5 spelling, no swiglu_alpha), without
# its quantization_config unless a test adds it back
HUB_20B_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 201088,
}


def test_the_hub_config_of_gpt_oss_20b(tmp_path):
    """The released config reads as gpt-oss-20b is (no weights needed), its YaRN table equals transformers'
    GptOssRotaryEmbedding's, and with its MXFP4 quantization_config it is refused naming the method."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from pagedq.engine.layers.rotary import rope_cos_sin_cache

    (tmp_path / "config.json").write_text(json.dumps(HUB_20B_CONFIG))
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (24, 64, 8, 64)
    assert config.max_position_embeddings == 131072 and config.sliding_window == 128 and config.attention_sinks
    assert config.moe is not None and (config.moe.num_experts, config.moe.num_experts_per_tok) == (32, 4)
    assert config.moe.moe_intermediate_size == 2880 and config.moe.sparse_layers == tuple(range(24))
    table = rope_cos_sin_cache(config)
    positions = torch.tensor([[0, 1, 127, 4095, 4096, 65536, 131071]])
    cos, sin = GptOssRotaryEmbedding(config.hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(table[positions[0]], torch.cat((cos[0], sin[0]), dim=-1))

    quantized = {**HUB_20B_CONFIG, "quantization_config": {"modules_to_not_convert": [], "quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(quantized))
    with pytest.raises(ValueError, match=r"quant_method 'mxfp4'.*dequantize"):
        ModelConfig.from_pretrained(tmp_path)
