"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3; and with expert blocks Mixtral, Qwen2-MoE, Qwen3-MoE)
over a flattened token batch and a paged KV cache.

No padding anywhere: the batch is [T] tokens from many requests; attention finds each token's request
through `AttentionMetadata`. Q/K/V and gate/up are packed into one matmul each. The numerics follow
transformers (RMSNorm variance in fp32, neox RoPE from transformers' own inv_freq functions) so greedy
outputs match it token for token in fp32. A MoE model's sparse layers take the expert block for their MLP
(`layers.moe.feed_forward`). The layers live in pagedq/engine/layers/; this file only composes them.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedq.engine.config.engine import ModelConfig
from pagedq.engine.layers import Attention, AttentionMetadata, RMSNorm, rope_cos_sin_cache
from pagedq.engine.layers.linear import Linear
from pagedq.engine.layers.moe import feed_forward
from pagedq.kernels import KernelSet


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelSet, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, ops, layer_idx)
        self.mlp = feed_forward(config, ops, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, hidden, residual, positions, cos_sin_cache, kv_cache, meta):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelSet) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, ops, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """Checkpoint-compatible module tree (model.layers.N.self_attn..., lm_head) with packed projections.

    `ops` are the kernels every layer calls, bound once for the model's device (`kernels.bind`).
    """

    def __init__(self, config: ModelConfig, ops: KernelSet) -> None:
        super().__init__()
        self.config = config
        self.kernels = ops
        self.model = LlamaModel(config, ops)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(config), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]. positions index the RoPE table only (each
        token's row: its position, or LongRoPE's short-factor row, pagedq/engine/layers/rotary.py)."""
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, positions, self.cos_sin_cache, kv_cache, meta)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
