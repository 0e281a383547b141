"""Shared fixtures: small random-weight checkpoints made with transformers' own classes, and an offline tokenizer."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run only through Triton's interpreter, which Triton reads when a kernel is defined:
# set it before any test (an engine test on the Triton path, say) imports them in a worker that later runs
# tests/kernels. .ci/gpu-check sets TRITON_INTERPRET=0 itself.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests compare against transformers on CPU in fp32: keep torch's threading predictable on 2 cores, and with
# pytest-xdist's parallel workers (PYTEST_XDIST_WORKER_COUNT) share the cores out instead of oversubscribing them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))

VOCAB_SIZE = 512

# PAGEDQ_TEST_SCHEDULING=sync|async (default async, the engine's default) runs every engine built in the tests that
# way, so the whole suite can run both ways (CI does, for tests/engine).
_SCHEDULING = os.environ.get("PAGEDQ_TEST_SCHEDULING", "async")
if _SCHEDULING not in ("async", "sync"):
    raise ValueError(f"PAGEDQ_TEST_SCHEDULING must be 'async' or 'sync', got {_SCHEDULING!r}")
import pagedq.engine.config.engine as engine_config  # noqa: E402

engine_config.DEFAULT_ASYNC_SCHEDULING = _SCHEDULING == "async"


def random_tokens(n: int, seed: int) -> list[int]:
    """A seeded prompt of token ids the tiny checkpoints accept (ids below 3 are the special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the key value cache in fixed size blocks.",
    "A scheduler batches requests continuously; finished ones leave, new ones join.",
    "Redis streams carry jobs to workers and results back to producers.",
    "Numbers like 12345 and 67890, symbols like #, $, % and unicode like café or naïve.",
] * 20


def build_tokenizer(folder: Path):
    """A byte-level BPE tokenizer trained here, offline, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(folder)
    return tokenizer


# Untied: with tied embeddings scaled by sqrt(hidden), a random Gemma repeats its last token, and greedy parity
# would check little (tests/engine/test_gemma.py covers the tied checkpoints through their logprobs).
def _gemma2_config(common: dict):
    """4 layers alternating sliding (window 8, shorter than most test prompts) and global; both soft-caps small
    enough to bind on random weights; query_pre_attn_scalar != head_dim, so the attention scale is its own."""
    import transformers

    return transformers.Gemma2Config(
        **{**common, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        attn_logit_softcapping=2.0, final_logit_softcapping=4.0, tie_word_embeddings=False,
    )  # fmt: skip


def _gemma3_config(common: dict):
    """Gemma 3 text: per-head q/k norms, a local RoPE base for sliding layers and a linearly scaled global one."""
    import transformers

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
    }
    layer_types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    return transformers.Gemma3TextConfig(
        **{**common, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=layer_types, rope_parameters=rope, tie_word_embeddings=False,
    )  # fmt: skip


GEMMA_CONFIGS = {"gemma2": _gemma2_config, "gemma3": _gemma3_config}


def _tiny_config(architecture: str):
    import transformers

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
    )
    if architecture in GEMMA_CONFIGS:
        return GEMMA_CONFIGS[architecture](common)
    if architecture == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if architecture == "mistral":
        return transformers.MistralConfig(
            **{**common, "num_key_value_heads": 1}, sliding_window=None, tie_word_embeddings=False
        )
    if architecture == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    if architecture == "qwen3":
        # head_dim 32 with hidden 64 and 4 heads: head_dim != hidden / heads.
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, use_sliding_window=False)
    if architecture == "phi3":  # fused qkv_proj and gate_up_proj in the checkpoint
        return transformers.Phi3Config(**common, sliding_window=None, tie_word_embeddings=False)
    moe = _tiny_moe_config(architecture, common)
    if moe is not None:
        return moe
    if architecture == "gpt_oss":
        return _tiny_gpt_oss_config(common)
    raise ValueError(architecture)


def _tiny_moe_config(architecture: str, common: dict):
    """Mixture-of-experts checkpoints: 8 experts top-2 (Mixtral 4), a dense layer between sparse ones where the
    family has them, renormalised top-k and not, and Qwen2-MoE's shared expert."""
    import transformers

    experts = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, use_sliding_window=False)
    if architecture == "qwen3_moe":  # layers 0 and 2 sparse, 1 dense
        return transformers.Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3}, **experts, head_dim=32, norm_topk_prob=True, mlp_only_layers=[1]
        )
    if architecture == "qwen3_moe_unnormalised":  # every second layer sparse: layer 1 of 2
        return transformers.Qwen3MoeConfig(
            **common, **experts, norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True
        )
    if architecture == "mixtral":
        return transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False
        )
    if architecture == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common, **experts, shared_expert_intermediate_size=64, norm_topk_prob=False
        )
    return None


def _tiny_gpt_oss_config(common: dict):
    """gpt-oss (wt-gptoss): 4 layers alternating sliding (window 12) and full attention, with sinks and q/k/v/o
    biases; 8 experts top-2 with biases and the clamped SwiGLU; YaRN shaped as the released config's, scaled down
    (original 128 positions, factor 4)."""
    import transformers

    rope = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
    }
    return transformers.GptOssConfig(
        **{**common, "num_hidden_layers": 4, "intermediate_size": 32},
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=12,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters=rope,
        attention_bias=True,
        tie_word_embeddings=False,
    )


_MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
ARCHITECTURES = tuple(_MODEL_CLASSES)
MOE_MODEL_CLASSES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_moe_unnormalised": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
MOE_ARCHITECTURES = tuple(MOE_MODEL_CLASSES)
_MODEL_CLASSES.update(MOE_MODEL_CLASSES)
_MODEL_CLASSES["gpt_oss"] = "GptOssForCausalLM"  # tests/engine/test_gpt_oss_parity.py


def _randomize_gpt_oss_biases(model) -> None:
    """transformers initialises gpt-oss's biases at zero; random ones make the checkpoint test them (and the
    experts' gate_up bias is large enough that the SwiGLU's clamps at +-7 take effect)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 3.0 if name.endswith("gate_up_proj_bias") else 0.2)


def build_checkpoint(folder: Path, architecture: str, seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, _MODEL_CLASSES[architecture])(_tiny_config(architecture))
    if architecture in GEMMA_CONFIGS:
        randomize_norms(model)
    if architecture == "gpt_oss":
        _randomize_gpt_oss_biases(model)
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def randomize_norms(model) -> None:
    """Random norm weights (a fresh model's are all equal): each norm's scale then shows where it is applied."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(architecture: str) -> Path:
        if architecture not in cache:
            cache[architecture] = build_checkpoint(tmp_path_factory.mktemp(architecture), architecture)
        return cache[architecture]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(checkpoint_factory) -> Path:
    return checkpoint_factory("llama")


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from pagedq.engine.demo_model import demo_model_path

    return demo_model_path()
