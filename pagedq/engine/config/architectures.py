"""The architectures pagedq serves (config.json's `architectures[0]`) and the module and class of each: plain data.

A leaf: pagedq/engine/config/engine.py checks a checkpoint against this table without importing model code, and
pagedq/engine/models/registry.py turns an entry into its class.
"""

from __future__ import annotations

# architecture name -> (module, class): Mistral, Qwen2 and Qwen3 share the Llama module tree (their differences,
# qkv bias and per-head q/k norm, are ModelConfig flags the shared layers read).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagedq.engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pagedq.engine.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pagedq.engine.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("pagedq.engine.models.llama", "LlamaForCausalLM"),
    # Gemma 2 and Gemma 3 (text): their own module tree (four (1 + weight) norms per layer, scaled embeddings)
    "Gemma2ForCausalLM": ("pagedq.engine.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("pagedq.engine.models.gemma", "GemmaForCausalLM"),
    # Phi-3: the Llama tree, its checkpoint already holding qkv_proj and gate_up_proj packed as ours
    "Phi3ForCausalLM": ("pagedq.engine.models.llama", "LlamaForCausalLM"),
    # mixture of experts: the same tree, whose sparse layers take the expert block for their MLP (ModelConfig.moe)
    "MixtralForCausalLM": ("pagedq.engine.models.llama", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("pagedq.engine.models.llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("pagedq.engine.models.llama", "LlamaForCausalLM"),
    # gpt-oss: the same tree; its expert block's options (router, biases, clamped SwiGLU) are ModelConfig.moe's, its
    # attention's (sliding/full layers, sinks, o_proj bias) ModelConfig's
    "GptOssForCausalLM": ("pagedq.engine.models.llama", "LlamaForCausalLM"),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(ARCHITECTURES)


def check_supported(architecture: str) -> None:
    """ValueError naming the supported architectures if `architecture` has no model class."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
