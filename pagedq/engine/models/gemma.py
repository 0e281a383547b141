"""Gemma 2 and Gemma 3 (text) decoders over a flattened token batch and a paged KV cache.

What sets them apart from the Llama tree (pagedq/engine/models/llama.py), each as transformers defines it:
- RMSNorm scales by (1 + weight) in fp32 (GemmaRMSNorm), and every layer has four: before and after attention,
  before and after the MLP; the "after" norms apply to the sublayer's output before the residual add.
- The token embeddings are scaled by sqrt(hidden_size), rounded to the hidden dtype first.
- The MLP is GeGLU (gelu_pytorch_tanh), the attention scale is query_pre_attn_scalar ** -0.5, and the final
  logits may be soft-capped: cap * tanh(logits / cap).
- Layers alternate sliding-window ("sliding_attention") and global ("full_attention") attention; Gemma 2 also
  soft-caps the attention logits. The shared Attention layer reads both from ModelConfig.
- Gemma 3 adds per-head q/k norms (1 + weight) and one RoPE table per layer type (a local and a global base).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedq.engine.config.engine import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from pagedq.engine.layers import MLP, Attention, AttentionMetadata, rope_cos_sin_cache
from pagedq.engine.layers.linear import Linear
from pagedq.engine.layers.norm import GemmaRMSNorm
from pagedq.kernels import KernelSet


def has_local_rope(config: ModelConfig) -> bool:
    """Gemma 3 keeps one rope_parameters dict per layer type; Gemma 2 has one for every layer."""
    params = getattr(config.hf_config, "rope_parameters", None) or {}
    return SLIDING_ATTENTION in params


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelSet, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, ops, layer_idx)
        self.mlp = MLP(config, ops)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, ops)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, ops)

    def forward(self, hidden, residual, positions, cos_sin_cache, kv_cache, meta):
        """(hidden, residual) -> (this layer's output, the residual stream before it): the next norm adds them."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, kv_cache, meta)
        hidden, _ = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelSet) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, ops, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class GemmaForCausalLM(nn.Module):
    """Gemma2ForCausalLM and Gemma3ForCausalLM: the checkpoint's module tree (model.layers.N..., lm_head, tied to
    the embeddings unless the config says otherwise) with packed projections, as LlamaForCausalLM."""

    def __init__(self, config: ModelConfig, ops: KernelSet) -> None:
        super().__init__()
        self.config = config
        self.kernels = ops
        self.model = GemmaModel(config, ops)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # fp32, then rounded to the model's dtype with the weights, as transformers' embed_scale buffer
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.local_cos_sin_cache: torch.Tensor | None
        if has_local_rope(config):
            self.register_buffer("cos_sin_cache", rope_cos_sin_cache(config, FULL_ATTENTION), persistent=False)
            self.register_buffer("local_cos_sin_cache", rope_cos_sin_cache(config, SLIDING_ATTENTION), persistent=False)
        else:
            self.register_buffer("cos_sin_cache", rope_cos_sin_cache(config), persistent=False)
            self.local_cos_sin_cache = None
        self.layer_is_local = [kind == SLIDING_ATTENTION for kind in config.layer_types]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        hidden = self.model.embed_tokens(input_ids) * self.embed_scale
        residual = None
        local_table = self.local_cos_sin_cache if self.local_cos_sin_cache is not None else self.cos_sin_cache
        for layer, kv_cache, local in zip(self.model.layers, kv_caches, self.layer_is_local):
            table = local_table if local else self.cos_sin_cache
            hidden, residual = layer(hidden, residual, positions, table, kv_cache, meta)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
